"""The routed MoE expert FFN (SPEC §3.17): inference-only, below the tag facade.

    y = fu.moe_expert_ffn(x, gate, up, down, selected, weights, out_pe, act)          # one token
    y = fu.moe_expert_ffn_batch(x, gate, up, down, selected, weights, top_k, out_pe, act)

Operands (shapes only; tag names are not read):
  x        f32 [1, hidden] (or [hidden]) for one token, [tokens, hidden] for the batch entry;
  gate, up f32 or f16 expert stacks of [out_pe, hidden] matrices: rank 3 [experts, out_pe,
           hidden] or the reference's rank-2 stacking [experts * out_pe, hidden]; contiguous,
           so expert e is the row-contiguous block e (a zero-copy sub-view);
  down     the same for [hidden, out_pe] matrices (its own dtype, f32 or f16);
  selected, weights  flat sequences (lists as router_top_k fills them, or numpy arrays) of
           top_k entries per token, token-major;
  act      a GatedOp: glu, swiglu, geglu, situ or swiglu_clamp10, applied as src(up)·act(gate);
  profile  None or a dict, filled with the call's nanoseconds (total, plan, gate_up, down) and
           counts (pairs, active_experts, max_expert_m, tokens).
The result has x's tags and shape: y_t = sum over t's slots s, in slot order, of
weights[t, s] · down_e(act(gate_e · x_t, up_e · x_t)), e = selected[t, s]. No gradient: an
operand that requires grad (with grad mode on) raises UnsupportedGradient.

Block-quantized stacks (any decodable format: q8_0, q4_k, q6_k, tq2_0, ...; SPEC's MoeRhs arms)
follow SPEC's dense-dequantized reference semantics: the routed experts' matrices (only those)
are decoded to f32 by the fused get_rows kernel, then the f32 path runs on that compact stack.
"""
from __future__ import annotations

import numbers

from ..errors import (DTypeError, IndexOutOfBounds, InvalidArgument, InvalidArgumentType,
                      InvalidShape, ShapeMismatch, UnsupportedGradient)
from ..exec import elementwise as ew
from ..exec import moe as xm
from ..exec import quant as xq
from ..exec.dtypes import BLOCKS
from ..exec.raw import contiguous_strides
from .checks import same_ctx
from .engine import needs_graph

ACTS = ("glu", "swiglu", "geglu", "situ", "swiglu_clamp10")


def _count(op: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an integer {name}, got {v!r}")
    if v < 1:
        raise InvalidShape(f"{op}: expected {name} >= 1, got {v}")
    return int(v)


def _run(op: str, x, gate, up, down, selected, weights, top_k, out_pe, act, profile, single):
    xr = x._live(op)
    for w in (gate, up, down):
        same_ctx(op, x, w)
    if act not in ACTS:
        raise InvalidArgument(f"{op}: expected act in {ACTS}, got {act!r}")
    if profile is not None and not isinstance(profile, dict):
        raise InvalidArgumentType(f"{op}: expected profile to be None or a dict, got {type(profile).__name__}")
    if needs_graph(x, gate, up, down):
        raise UnsupportedGradient(f"{op}: inference-only; expected operands that do not require "
                                  f"grad (or fu.no_grad())")
    if xr.dtype != "f32":
        raise DTypeError(f"{op}: x: expected f32 activations, got {xr.dtype}")
    F = _count(op, "out_pe", out_pe)
    if single:
        if xr.rank not in (1, 2) or (xr.rank == 2 and xr.shape[0] != 1):
            raise ShapeMismatch(f"{op}: x: expected one token, [1, hidden] or [hidden], got shape {xr.shape}")
        T, H = 1, xr.shape[-1]
        top_k = len(selected) if hasattr(selected, "__len__") else 0
    else:
        if xr.rank != 2:
            raise ShapeMismatch(f"{op}: x: expected [tokens, hidden], got shape {xr.shape}")
        T, H = xr.shape
        top_k = _count(op, "top_k", top_k)
    ctx = xr.ctx
    g, u, d = (w._live(op) for w in (gate, up, down))
    if any(r.dtype in BLOCKS for r in (g, u, d)):
        sel = _flat(op, selected)
        g, u, d, selected = _routed_f32(ctx, op, (g, u, d), ((F, H), (F, H), (H, F)), sel)
    E = xm.expert_stack(op, "gate", g, F, H)
    if xm.expert_stack(op, "up", u, F, H) != E or u.dtype != g.dtype:
        raise ShapeMismatch(f"{op}: up: expected gate's shape {g.shape} and dtype {g.dtype}, got "
                            f"{u.shape} {u.dtype}")
    if xm.expert_stack(op, "down", d, H, F) != E:
        raise ShapeMismatch(f"{op}: down: expected {E} experts of [{H}, {F}], got shape {d.shape}")
    sel, w = xm.routes(op, selected, weights, T * top_k, E)
    xc = ew.materialize(ctx, xr).view((T, H), (H, 1))
    y = xm.expert_ffn(ctx, xc, g, u, d, sel, w, top_k, F, act, profile)
    return x._result(y.view(xr.shape, contiguous_strides(xr.shape)), x.tags)


def _flat(op, selected):
    try:
        return [int(e) for e in selected]
    except (TypeError, ValueError):
        raise InvalidArgumentType(f"{op}: selected: expected a flat sequence of expert indices, got "
                        f"{selected!r}") from None


def _routed_f32(ctx, op, stacks, dims, sel):
    """The routed experts of each stack decoded to a compact f32 stack [n, rows, cols] (n =
    distinct experts in `sel`, ascending) and `sel` renumbered into it."""
    used = sorted(set(sel))
    out = []
    for name, r, (rows, cols) in zip(("gate", "up", "down"), stacks, dims):
        if r.dtype not in BLOCKS:
            raise DTypeError(f"{op}: {name}: expected every stack block-quantized when one is "
                             f"(got {r.dtype} beside a quantized stack); dequantize it with .to('f32')")
        if r.rank == 3 and r.shape[1:] == (rows, cols):
            E, idx = r.shape[0], used
        elif r.rank == 2 and r.shape[1] == cols and r.shape[0] % rows == 0:
            E, idx = r.shape[0] // rows, [e * rows + i for e in used for i in range(rows)]
        else:
            raise ShapeMismatch(f"{op}: {name}: expected [experts, {rows}, {cols}] or "
                                f"[experts * {rows}, {cols}], got {r.shape}")
        bad = [e for e in used if not 0 <= e < E]
        if bad:
            raise IndexOutOfBounds(f"{op}: selected: expected expert indices in [0, {E}), got {bad[0]}")
        f = xq.get_rows(ctx, r, 0, ctx.from_numpy(idx, (len(idx),), "i64", op), op)
        out.append(f.view((len(used), rows, cols), contiguous_strides((len(used), rows, cols))))
    remap = {e: i for i, e in enumerate(used)}
    return (*out, [remap[e] for e in sel])


def moe_expert_ffn(x, gate, up, down, selected, weights, out_pe, act, profile=None):
    """SPEC §3.17 for one token: the route-weighted sum over `selected` experts of
    down(act(gate(x), up(x))); see the module docstring for operand shapes."""
    return _run("moe_expert_ffn", x, gate, up, down, selected, weights, None, out_pe, act,
                profile, True)


def moe_expert_ffn_batch(x, gate, up, down, selected, weights, top_k, out_pe, act, profile=None):
    """SPEC §3.17 for x [tokens, hidden]: `top_k` routes per token (token-major, as
    router_top_k fills them); each routed expert's weights are read once for all its tokens."""
    return _run("moe_expert_ffn_batch", x, gate, up, down, selected, weights, top_k, out_pe, act,
                profile, False)
