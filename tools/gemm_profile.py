"""Where one LoRA step's time goes: every GEMM call (shape, operand orientation, path, the
time of its pack and tile launches, GFLOP/s) and the time outside GEMM (issue 18).

    PYTHONPATH=. python -m tools.gemm_profile [--threads 1] [--seq 256] [--targets q,v]
        [--model PATH] [--steps 2] [--cpu] [--compute bf16] [--set DIRECT_B=0 ...]

Every ctx.launch is timed (the launches are synchronous); matmul.gemm is wrapped so that the
launches it issues are charged to it. GEMMs of the same (M, K, N, orientation, path) are
summed over the step. The last of `--steps` steps is reported (the first compiles kernels).
"""
from __future__ import annotations

import argparse
import resource
import time
from collections import defaultdict

import numpy as np


def profile(path: str, targets, threads: int, seq: int, steps: int, clock=time.perf_counter,
            compute: str = "f32") -> dict:
    import fucina as fu
    from fucina.exec import matmul as mm
    from fucina.llm.decoder import Model, Trainer

    from fucina.cli.finetune import TRAIN_CACHE_BYTES
    ctx = fu.ExecContext(threads=threads, cache_bytes=TRAIN_CACHE_BYTES)   # as fucina finetune
    model = (Model.from_gguf(ctx, path, widen_frozen=True) if compute == "f32" else
             Model.from_gguf(ctx, path, compute=compute))
    tr = Trainer(model, targets, fu.lora.LoraConfig(8, 16), 42)
    opt = fu.optim.AdamW(lr=1e-3, weight_decay=0.0)
    tr.register_all_params(opt)
    tokens = np.random.default_rng(seq).integers(0, model.config.vocab, seq + 1)

    launches = []            # (addr, seconds, gemm id or None)
    calls = []               # per gemm call: (M, K, N, orient, kind)
    faults = []              # per gemm call: minor page faults
    current = [None]
    real_launch = ctx.launch

    def timed_launch(addr, n, cost, *args):
        t0 = clock()
        real_launch(addr, n, cost, *args)
        launches.append((addr, clock() - t0, current[0]))

    real_gemm = mm.gemm

    def gemm(c, a, b, out=None, accumulate=False, scale=1.0, **kw):
        if current[0] is not None:
            return real_gemm(c, a, b, out, accumulate, scale, **kw)
        M, K = a.shape[-2:]
        N = b.shape[-1]
        batch = int(np.prod(a.shape[:-2])) if a.rank > 2 else 1
        orient = ("aᵀ" if a.strides[-2] == 1 and M > 1 else "a") + \
                 (" bᵀ" if b.strides[-2] == 1 and N > 1 else " b")
        try:
            kind = mm.path_of(a, b)
        except Exception:
            kind = "?"
        calls.append((batch, M, K, N, orient + (" acc" if accumulate else ""), kind))
        current[0] = len(calls) - 1
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return real_gemm(c, a, b, out, accumulate, scale, **kw)
        finally:
            current[0] = None
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

    def step():
        with ctx.exec_scope():
            loss = tr.loss(tokens[:-1], tokens[1:])
            loss.backward()
            loss.item()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()

    for s in range(steps):
        launches.clear()
        calls.clear()
        faults.clear()
        patched = s == steps - 1
        if patched:
            ctx.launch = timed_launch
            mods = _patch(real_gemm, gemm)
        t0 = clock()
        step()
        wall = clock() - t0
        if patched:
            del ctx.launch
            _unpatch(mods, real_gemm)
    from fucina.codegen import kernels
    fam = kernels.keys_by_address()
    groups = defaultdict(lambda: {"n": 0, "pack_a": 0.0, "pack_b": 0.0, "tile": 0.0, "other": 0.0,
                                  "flop": 0.0, "faults": 0})
    gemm_t = 0.0
    non_gemm = defaultdict(float)
    for addr, dt, gid in launches:
        key = fam.get(addr)
        fname = key.family if key is not None else "?"
        if gid is None:
            non_gemm[fname] += dt
            continue
        gemm_t += dt
        g = groups[calls[gid]]
        if fname == "gemm_pack":
            g["pack_a" if key.width == _mr() else "pack_b"] += dt
        elif fname in ("gemm_tile", "gemm_tile_direct", "gemm_small"):
            g["tile"] += dt
        else:
            g["other"] += dt
    for c, f in zip(calls, faults):
        groups[c]["n"] += 1
        groups[c]["faults"] += f
        batch, M, K, N = c[:4]
        groups[c]["flop"] += 2.0 * batch * M * K * N
    return {"wall": wall, "gemm": gemm_t, "groups": dict(groups), "non_gemm": dict(non_gemm),
            "launch_total": sum(dt for _, dt, _ in launches), "n_launches": len(launches)}


def _mr():
    from fucina.codegen import gemm as g
    return g.mr()


def _patch(real, wrapper):
    import sys
    mods = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("fucina") and getattr(mod, "gemm", None) is real:
            mod.gemm = wrapper
            mods.append(mod)
    return mods


def _unpatch(mods, real):
    for mod in mods:
        mod.gemm = real


def report(r: dict) -> str:
    lines = [f"step wall {r['wall'] * 1e3:.1f} ms; launches {r['n_launches']} "
             f"({r['launch_total'] * 1e3:.1f} ms); GEMM {r['gemm'] * 1e3:.1f} ms; Python and "
             f"dispatch {(r['wall'] - r['launch_total']) * 1e3:.1f} ms",
             f"{'batch':>5} {'M':>5} {'K':>6} {'N':>6} {'orient':<10} {'path':<16} {'n':>4} "
             f"{'packA':>7} {'packB':>7} {'tile':>8} {'other':>7} {'total ms':>9} {'GF/s':>6} "
             f"{'tileGF/s':>8} {'faults':>7}"]
    rows = sorted(r["groups"].items(), key=lambda kv: -(kv[1]["pack_a"] + kv[1]["pack_b"]
                                                         + kv[1]["tile"] + kv[1]["other"]))
    for (batch, M, K, N, orient, kind), g in rows:
        tot = g["pack_a"] + g["pack_b"] + g["tile"] + g["other"]
        lines.append(f"{batch:>5} {M:>5} {K:>6} {N:>6} {orient:<10} {kind:<16} {g['n']:>4} "
                     f"{g['pack_a'] * 1e3:>7.2f} {g['pack_b'] * 1e3:>7.2f} "
                     f"{g['tile'] * 1e3:>8.2f} {g['other'] * 1e3:>7.2f} {tot * 1e3:>9.2f} "
                     f"{g['flop'] / max(tot, 1e-12) / 1e9:>6.0f} "
                     f"{g['flop'] / max(g['tile'], 1e-12) / 1e9:>8.0f} {g['faults']:>7}")
    flop = sum(g["flop"] for g in r["groups"].values())
    lines.append(f"GEMM total {r['gemm'] * 1e3:.1f} ms for {flop / 1e9:.1f} GFLOP = "
                 f"{flop / r['gemm'] / 1e9:.0f} GFLOP/s; step {flop / r['wall'] / 1e9:.0f} GFLOP/s")
    lines.append("outside GEMM (launch time by kernel family, ms): " + ", ".join(
        f"{k} {v * 1e3:.1f}" for k, v in sorted(r["non_gemm"].items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--targets", default="q,v")
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--compute", default="f32", choices=("f32", "bf16"),
                   help="bf16: frozen matrices held as bf16 (Model.from_gguf compute=); their "
                        "GEMMs show as launches of the gemm_bf16 families outside GEMM")
    p.add_argument("--cpu", action="store_true",
                   help="time with the thread's CPU clock (1 thread on a busy machine: other "
                        "processes' time slices are not counted)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a planning constant of fucina.exec.matmul (an int)")
    ns = p.parse_args(argv)
    from fucina.exec import matmul as mm
    for item in ns.set:
        name, value = item.split("=")
        if not hasattr(mm, name):
            raise SystemExit(f"gemm_profile: --set {item}: fucina.exec.matmul has no {name}")
        setattr(mm, name, type(getattr(mm, name))(int(value)))
    path = ns.model
    if path is None:
        from fucina.cli.finetune import smollm2_file
        path = smollm2_file()
    clock = time.thread_time if ns.cpu else time.perf_counter
    if ns.cpu and ns.threads != 1:
        raise SystemExit("gemm_profile: --cpu needs --threads 1 (the team's threads are not "
                         "counted)")
    print(report(profile(path, tuple(ns.targets.split(",")), ns.threads, ns.seq, ns.steps,
                         clock, ns.compute)))


if __name__ == "__main__":
    main()
