"""Talk to a GGUF model: an interactive multi-turn chat, or one answer.

    fucina chat MODEL.gguf                         # the REPL: type, read the streamed reply
    fucina chat MODEL.gguf --prompt "Hi"           # one reply on stdout, nothing else there
        [--system TEXT] [--max-new N] [--temperature F] [--top-k N] [--top-p F] [--min-p F]
        [--repetition-penalty F] [--seed N] [--stop TEXT ...] [--threads N]
        [--adapters DIR [--alpha A]] [--kv-dtype f32|f16] [--matvec exact|q8]

Turns are rendered with the model file's own chat template (fu.llm.load), so the model sees
what it was trained on. After each reply a line on stderr gives the token counts and the
prefill and decode speeds. In the REPL, Ctrl-C during a reply ends that reply (the part already
shown stays in the conversation), Ctrl-C at the prompt, Ctrl-D or /exit end the session, /reset
starts the conversation over. A sampled reply is reproducible: turn t draws with seed + t.
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fucina chat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL.gguf")
    ap.add_argument("--prompt", help="answer this one message and exit")
    ap.add_argument("--system", help="a system message opening the conversation")
    ap.add_argument("--max-new", type=int, default=256, help="tokens per reply (default 256)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], metavar="TEXT",
                    help="a stop string (repeatable)")
    ap.add_argument("--threads", type=int, help="worker threads (default: all cores)")
    ap.add_argument("--adapters", metavar="DIR", help="LoRA adapters of a finetune save directory")
    ap.add_argument("--alpha", type=float, help="the adapters' alpha (default: as recorded)")
    ap.add_argument("--kv-dtype", choices=("f32", "f16"), default="f32")
    ap.add_argument("--matvec", choices=("exact", "q8"), default="exact",
                    help="q8: decode steps round activations to 8 bits per block for integer "
                         "dots with q4_0/q4_1/q5_0/q5_1/q8_0/q2_k..q6_k weights (not exact; "
                         "1.2-1.5x the exact decode on AVX2 CPUs such as Zen 3, no faster on "
                         "Zen 5)")
    return ap


def _settings(a, turn: int) -> dict:
    return dict(max_new=a.max_new, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed + turn,
                stop=a.stop or None)


def _stats(g) -> str:
    return (f"[{g.prompt_tokens} prompt tokens at {g.prefill_tokens_per_s:.0f} tok/s, "
            f"{len(g.ids)} new at {g.decode_tokens_per_s:.1f} tok/s, {g.finish_reason}]")


def reply(lm, messages, a, turn: int, out) -> tuple:
    """Stream one reply to `out`; (text, Generation or None when interrupted)."""
    box, pieces = [], []
    try:
        for piece in lm.stream(messages=messages, result=box, **_settings(a, turn)):
            pieces.append(piece)
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        return "".join(pieces), None
    return "".join(pieces), box[0]


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.max_new < 1 or (a.threads is not None and a.threads < 1):
        ap.error("--max-new and --threads must be >= 1")
    if a.alpha is not None and a.adapters is None:
        ap.error("--alpha needs --adapters")
    import fucina as fu
    try:
        fu.llm.sampling.Settings(a.temperature, a.top_k, a.top_p, a.min_p, a.repetition_penalty)
        ctx = fu.ExecContext(threads=a.threads)
        lm = fu.llm.load(a.model, ctx, adapters=a.adapters, alpha=a.alpha, kv_dtype=a.kv_dtype,
                         matvec=a.matvec)
    except (fu.FucinaError, OSError) as e:
        print(f"fucina chat: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    history = [{"role": "system", "content": a.system}] if a.system else []
    if a.prompt is not None:
        try:
            text, g = reply(lm, history + [{"role": "user", "content": a.prompt}], a, 0,
                            sys.stdout)
        except fu.FucinaError as e:
            print(f"\nfucina chat: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        sys.stdout.write("\n")
        if g is not None:
            print(_stats(g), file=sys.stderr)
        return 0 if g is not None else 130
    print(f"fucina chat: {lm!r}\n(Ctrl-C ends a reply, Ctrl-D or /exit quits, /reset starts "
          f"over)", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            text, g = reply(lm, history, a, turn, sys.stdout)
        except fu.FucinaError as e:       # e.g. the conversation outgrew the context
            history.pop()
            print(f"\nfucina chat: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": text})
        print(_stats(g) if g is not None else "[interrupted]", file=sys.stderr)
        turn += 1


if __name__ == "__main__":
    sys.exit(main())
