"""The output bytes of every templated kernel over a fixed set of inputs, as sha256 per case.

Moving a formula into `fucina/kernel_templates/` must not change a single output bit. This
script runs each kernel whose scalar formula is a template — the activations and their
backward rules, the float arithmetic and its backward rules, the elementwise losses and their
derivatives, the SGD, Adam/AdamW, Muon and APOLLO element maps, the i64 arithmetic (wrapping,
the guarded divisions), the masks (where, logical ops, compares, isnan/isinf/isfinite on every
dtype) — over fixed inputs (lengths with and without a vector tail, f32 and 16-bit storage,
special values: NaN, ±inf, ±0, subnormals, huge magnitudes) and records one digest per case.
tests/test_kernel_templates.py recomputes the table and compares it with the committed JSON.

    python -m tools.kernel_outputs            # print the table
    python -m tools.kernel_outputs --write    # rewrite this host's table (golden())
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

GOLDENS = Path(__file__).resolve().parent.parent / "tests" / "goldens"


def golden() -> Path:
    """The committed table of this host's vector width: kernel_outputs.json (512-bit, recorded
    before the formulas moved), kernel_outputs.256.json (AVX2). The two differ in 20 cases,
    every one an output holding NaN: x86 gives a NaN made by an invalid operation the sign bit
    set and a propagated one its operand's sign, and which operand an instruction propagates
    follows instruction selection, which differs between the widths (measured on Zen 3 for
    the activation grads and KL dx; SPEC leaves a NaN's sign open). Twelve of them came with
    the 8-lane kernels' 32-lane steps for long formulas (codegen/elementwise.vectors_per_step):
    there such a NaN's sign can differ from the one the same input gets in the last vectors."""
    from fucina.codegen.target import host

    bits = host().vector_bits
    return GOLDENS / ("kernel_outputs.json" if bits == 512 else f"kernel_outputs.{bits}.json")

SPECIAL = np.array([
    np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754944e-38,
    3.4028235e38, -3.4028235e38, 1e30, -1e30, 1e10, -1e10, 104.0, -104.0, 88.5, -88.5, 87.5,
    -87.5, 64.5, -64.5, 20.0, -20.0, 10.0, -10.0, 9.999, -9.999, 1.0, -1.0, 0.5, -0.5, 2.5,
    -2.5, 1e-7, -1e-7, 8388607.5, -8388609.0, 0.7, -0.7, 3.0, -3.0, 0.25, 1e-3], np.float32)
LENGTHS = (1, 17, 100, 533)   # a scalar, one vector plus a tail, several vectors plus a tail


def inputs(n: int, seed: int, low: float = -8.0, high: float = 8.0) -> np.ndarray:
    """n float32 values: the special values first, then uniform ones on [low, high)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(low, high, n).astype(np.float32)
    k = min(n, SPECIAL.size)
    x[:k] = np.roll(SPECIAL, seed)[:k]
    return x


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _activation_cases(ctx, table):
    from fucina.codegen import activations
    from fucina.exec import elementwise as ew

    params = {"leaky_relu": (0.01,), "leaky_relu_grad": (0.2,), "clamp": (-1.5, 2.0),
              "clamp_grad": (-1.5, 2.0)}
    for op, (arity, _) in sorted(activations.OPS.items()):
        extra = params.get(op, ())
        tensors = arity - len(extra)
        dtypes = ("f32", "bf16", "f16") if tensors == 1 else ("f32", "bf16")
        for dtype in dtypes:
            for n in LENGTHS:
                ins = [ctx.from_numpy(inputs(n, 7 * j + n), (n,), dtype) for j in range(tensors)]
                out = ew.run(ctx, op, dtype, (n,), [*ins, *extra])
                table[f"act/{op}/{dtype}/{n}"] = _digest(out.to_numpy())
        # a broadcast (zero-stride) first operand and a strided one
        n = 40
        src = [ctx.from_numpy(inputs(2 * n, 11 + j), (2 * n,), "f32") for j in range(tensors)]
        ins = [src[0].view((n,), (0,))] + [s.view((n,), (2,)) for s in src[1:]]
        out = ew.run(ctx, op, "f32", (n,), [*ins, *extra])
        table[f"act/{op}/f32/layout"] = _digest(out.to_numpy())


def _arithmetic_cases(ctx, table):
    from fucina.codegen.elementwise import ARITHMETIC
    from fucina.exec import elementwise as ew

    for op, (arity, _) in sorted(ARITHMETIC.items()):
        for dtype in ("f32", "bf16"):
            for n in LENGTHS:
                if op == "pick":   # g, then the chosen index and the position (i64)
                    ins = [ctx.from_numpy(inputs(n, n), (n,), dtype),
                           ctx.from_numpy(np.arange(n) % 3, (n,), "i64"),
                           ctx.from_numpy(np.arange(n)[::-1] % 4, (n,), "i64")]
                    out = ew.run(ctx, op, dtype, (n,), ins)
                else:
                    ins = [ctx.from_numpy(inputs(n, 13 * j + n), (n,), dtype) for j in range(arity)]
                    if op == "add_scaled":  # x + a·y: a is a by-value parameter
                        ins[-1] = 0.375
                    out = ew.run(ctx, op, dtype, (n,), ins)
                table[f"arith/{op}/{dtype}/{n}"] = _digest(out.to_numpy())


def _loss_cases(ctx, table):
    from fucina.ag import loss
    from fucina.exec import elementwise as ew

    texts = {name: getattr(loss, name) for name in dir(loss)
             if name.endswith(("_FWD", "_DX", "_DT")) and isinstance(getattr(loss, name), str)}
    params = {"HUBER": (1.5,), "BCEP": (loss.BCE_EPS, 1.0 - loss.BCE_EPS)}
    for name, text in sorted(texts.items()):
        stem, part = name.rsplit("_", 1)
        extra = params.get(stem, ())
        fwd = part == "FWD"
        for n in LENGTHS:
            lo, hi = (0.0, 1.0) if stem in ("BCEP", "KL") else (-8.0, 8.0)
            x = ctx.from_numpy(inputs(n, 3 + n, lo, hi), (n,), "f32")
            t = ctx.from_numpy(inputs(n, 5 + n, lo, hi)[::-1].copy(), (n,), "f32")
            if fwd:
                out = ew.run(ctx, text, "f32", (n,), [x, t, *extra])
            else:
                g = ctx.from_numpy(inputs(n, 9 + n), (n,), "f32")
                out = ew.run(ctx, text, "f32", (n,), [g, x, t, 0.125, *extra])
            table[f"loss/{name}/{n}"] = _digest(out.to_numpy())


def _f32_bits(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32))


def _optim_cases(ctx, table):
    from fucina.codegen.optim import AdamKey, SgdKey
    from fucina.exec import optim

    n = 533

    def buffers(param, state_dtypes, seed):
        p32 = inputs(n, seed, -2.0, 2.0)
        p = ctx.from_numpy(p32, (n,), param)
        master = ctx.from_numpy(p.to_numpy().astype(np.float32), (n,), "f32") \
            if param != "f32" else None
        g = ctx.from_numpy(inputs(n, seed + 1, -3.0, 3.0), (n,), "f32")
        states = [ctx.from_numpy(np.abs(inputs(n, seed + 2 + k, 0.0, 1.0)), (n,), dt)
                  for k, dt in enumerate(state_dtypes)]
        return p, master, g, states

    def outputs(*ts):
        return "".join(_digest(t.to_numpy()) for t in ts if t is not None)

    for param in ("f32", "bf16"):
        for state in ("none", "f32", "bf16"):
            for decay in (False, True):
                for nesterov in (False, True):
                    for first in (False, True):
                        if state == "none" and (nesterov or first):
                            continue
                        key = SgdKey(param, state, decay, nesterov, first)
                        p, master, g, states = buffers(param, [] if state == "none" else [state], 1)
                        buf = states[0] if states else None
                        scalars = [_f32_bits(v) for v in (0.05, 0.9, 1.0 - 0.1, 0.01)]
                        optim.update(ctx, key, [(n, (p.addr, master.addr if master else 0,
                                                     g.addr, buf.addr if buf else 0))],
                                     tuple(scalars))
                        table[f"optim/sgd/{param}/{state}/{decay}/{nesterov}/{first}"] = \
                            hashlib.sha256(outputs(p, master, buf).encode()).hexdigest()
        for decoupled in (False, True):
            for mv in (("f32", "f32"), ("bf16", "bf16")):
                for decay in (False, True):
                    key = AdamKey(decoupled, param, mv[0], mv[1], decay)
                    p, master, g, (m, v) = buffers(param, list(mv), 2)
                    scalars = [_f32_bits(x) for x in (1.0 - 1e-3 * 0.1, 0.1, 0.1, 0.999, 0.001,
                                                      1e-8, 0.0316, 1e-3 / 0.19)]
                    optim.update(ctx, key, [(n, (p.addr, master.addr if master else 0, g.addr,
                                                 m.addr, v.addr))], tuple(scalars))
                    table[f"optim/adam/{decoupled}/{param}/{mv[0]}/{decay}"] = \
                        hashlib.sha256(outputs(p, master, m, v).encode()).hexdigest()


def _lowrank_cases(ctx, table):
    from fucina.codegen.optim_lowrank import (ApolloApplyKey, HfAdamwKey, MuonApplyKey,
                                              MuonMomentumKey)
    from fucina.exec import optim_lowrank as lr

    n = 533

    def f32(seed, lo=-2.0, hi=2.0, shape=(n,)):
        k = int(np.prod(shape))
        return ctx.from_numpy(inputs(k, seed, lo, hi).reshape(shape), shape, "f32")

    def digest(*ts):
        text = "".join(_digest(t.to_numpy()) for t in ts if t is not None)
        return hashlib.sha256(text.encode()).hexdigest()

    for state in ("f32", "bf16"):
        for nesterov in (False, True):
            for m_small in (False, True):
                for n_small in (False, True):
                    key = MuonMomentumKey(state, nesterov, m_small, n_small)
                    g, out = f32(21), f32(22)
                    m = ctx.from_numpy(inputs(n, 23, -1.0, 1.0), (n,), state)
                    w, beta = (0.05, 0.95) if m_small else (0.7, 0.3)
                    lr.muon_momentum(ctx, key, g, m.addr, out, w, beta)
                    table[f"optim/muon_momentum/{state}/{nesterov}/{m_small}/{n_small}"] = \
                        digest(m, out)
    for param in ("f32", "bf16"):
        p = ctx.from_numpy(inputs(n, 31, -2.0, 2.0), (n,), param)
        master = f32(31) if param != "f32" else None
        lr.muon_apply(ctx, MuonApplyKey(param), p, master, f32(32), 0.999, 0.02)
        table[f"optim/muon_apply/{param}"] = digest(p, master)
        p = ctx.from_numpy(inputs(n, 33, -2.0, 2.0), (n,), param)
        master = f32(33) if param != "f32" else None
        lr.apollo_apply(ctx, ApolloApplyKey(param), p, master, f32(34), (1.5, 0.7, 0.01, -1e-3))
        table[f"optim/apollo_apply/{param}"] = digest(p, master)
        p = ctx.from_numpy(inputs(n, 35, -2.0, 2.0), (n,), param)
        master = f32(35) if param != "f32" else None
        m, v = f32(36, -1.0, 1.0), f32(37, 0.0, 1.0)
        lr.hf_adamw(ctx, HfAdamwKey(param), p, master, f32(38), m.addr, v.addr,
                    (0.9, 0.1, 0.999, 0.001, 1e-6, 0.01, -1e-3))
        table[f"optim/hf_adamw/{param}"] = digest(p, master, m, v)
    out, x = f32(41), f32(42)
    lr.axpby(ctx, out, x, f32(43), 2.0315, -4.7750)
    table["optim/ns_axpby"] = digest(out)
    for mode, shape in (("tall", (40, 8)), ("wide", (8, 40)), ("tensor", (8, 40))):
        r = f32(51, shape=shape)
        m, v = f32(52, -1.0, 1.0, shape), f32(53, 0.0, 1.0, shape)
        channels = {"tall": shape[0], "wide": shape[1], "tensor": 1}[mode]
        s = f32(54, shape=(channels,))
        lr.apollo_scale(ctx, r, m.addr, v.addr, s, mode, (0.9, 0.1, 0.999, 0.001, 1e-6))
        table[f"optim/apollo_scale/{mode}"] = digest(m, v, s)
        for front in (None, 1.7):
            out = f32(55, shape=shape)
            lr.apollo_build(ctx, out, f32(56, shape=shape), s, mode, front)
            table[f"optim/apollo_build/{mode}/{front}"] = digest(out)


INT_SPECIAL = np.array([0, 1, -1, 2, -2, 3, -3, 7, -7, 2**63 - 1, -2**63, -2**63 + 1, 2**62,
                        -2**62, 10**18, -10**18], np.int64)


def int_inputs(n: int, seed: int) -> np.ndarray:
    """n int64 values: the special ones (0, ±1, the extremes) first, then small and wide ones."""
    rng = np.random.default_rng(seed)
    x = np.where(rng.random(n) < 0.5, rng.integers(-20, 20, n),
                 rng.integers(-2**62, 2**62, n)).astype(np.int64)
    k = min(n, INT_SPECIAL.size)
    x[:k] = np.roll(INT_SPECIAL, seed)[:k]
    return x


def _typed_cases(ctx, table):
    from fucina.codegen import typed
    from fucina.exec import elementwise as ew

    ops = ("neg", "add", "sub", "mul", "maximum", "minimum", "div_trunc", "div_floor", "rem",
           "mod", "bit_and", "bit_or", "bit_xor")
    for op in ops:
        arity = typed.OPS[op][0]
        for n in LENGTHS:
            for shift in range(3):   # every special value meets every other as a divisor
                ins = [ctx.from_numpy(np.roll(int_inputs(n, 5 * j + n), shift * j), (n,), "i64")
                       for j in range(arity)]
                out = ew.run(ctx, op, "i64", (n,), ins)
                table[f"typed/{op}/i64/{n}/{shift}"] = _digest(out.to_numpy())
        if op.startswith("bit_"):
            ins = [ctx.from_numpy(np.random.default_rng(j).random(100) < 0.5, (100,), "bool")
                   for j in range(2)]
            table[f"typed/{op}/bool/100"] = _digest(ew.run(ctx, op, "bool", (100,), ins).to_numpy())


def _mask_cases(ctx, table):
    from fucina.codegen.masks import COMPARE_OPS
    from fucina.exec import elementwise as ew

    n = 100

    def operand(dtype, seed):
        if dtype == "bool":
            return ctx.from_numpy(np.random.default_rng(seed).random(n) < 0.5, (n,), "bool")
        if dtype == "i64":
            return ctx.from_numpy(int_inputs(n, seed) % 5 - 2, (n,), "i64")
        x = inputs(n, seed, -2.0, 2.0)
        x[x > 1.5] = 0.0   # zeros (and -0.0 from SPECIAL) for the truthiness
        return ctx.from_numpy(x, (n,), dtype)

    def run(name, op, out_dtype, dtypes):
        ins = [operand(dt, 17 * j + len(name)) for j, dt in enumerate(dtypes)]
        out = ew.run(ctx, op, out_dtype, (n,), ins)
        table[f"mask/{name}/{'-'.join(dtypes)}"] = _digest(out.to_numpy())

    for dts in (("bool", "f32", "f32"), ("f32", "f32", "f32"), ("i64", "f32", "f32"),
                ("bool", "bf16", "bf16"), ("bool", "i64", "i64"), ("f32", "i64", "i64")):
        run("where", "where", {"bf16": "bf16", "i64": "i64"}.get(dts[1], "f32"), dts)
    for op in ("logical_and", "logical_or", "logical_xor"):
        for dts in (("f32", "f32"), ("bool", "f32"), ("f32", "bool"), ("i64", "bool"),
                    ("bool", "bool"), ("bf16", "i64")):
            run(op, op, "bool", dts)
    for op in ("logical_not", "isnan", "isinf", "isfinite"):
        for dt in ("f32", "bf16", "i64", "bool"):
            run(op, op, "bool", (dt,))
    for op in COMPARE_OPS:
        for dt in ("f32", "bf16", "i64", "bool"):
            run("cmp_" + op, "cmp_" + op, "bool", (dt, dt))


def compute() -> dict:
    """The table {case: sha256 of the output bytes}, at one thread."""
    import fucina as fu

    table: dict = {}
    ctx = fu.ExecContext(threads=1)
    try:
        with np.errstate(over="ignore"):  # SPECIAL's 3.4e38 becomes inf in f16 storage: wanted
            _activation_cases(ctx, table)
            _arithmetic_cases(ctx, table)
            _loss_cases(ctx, table)
            _optim_cases(ctx, table)
            _lowrank_cases(ctx, table)
            _typed_cases(ctx, table)
            _mask_cases(ctx, table)
    finally:
        ctx.close()
    return dict(sorted(table.items()))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    table = compute()
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if "--write" in argv:
        golden().write_text(text)
        print(f"wrote {len(table)} cases to {golden()}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
