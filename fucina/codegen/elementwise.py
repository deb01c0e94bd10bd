"""Elementwise kernels: one generator for every pointwise op, every dtype and every layout.

The exec layer broadcasts the operands to the output shape and coalesces the axes, so a kernel
sees an output of rank r (contiguous) and inputs whose strides are runtime arguments. What the
key fixes is the *role* of each input's innermost axis:

  unit    — stride 1: vector loads          (a contiguous operand, a tail-broadcast bias)
  zero    — stride 0: one load, splatted     (a scalar, a column broadcast)
  strided — any other stride: scalar loop   (a transposed view)
  param   — no tensor: a scalar passed by value in the argument block (x * 2.0)

The outer axes are walked with a carried multi-index, so one kernel serves every shape of its
class. Vector width comes from the target; the last partial vector uses masked loads/stores.

Argument block: out, in_0..in_{k-1} (pointer, or the param's bits), n, chunk, shape[r],
then r strides per tensor input.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import activations, masks, typed
from . import irutil as u
from .emit import nan_max, nan_min
from .vpow import pow as _pow
from .kernels import KernelKey, register
from .target import host


def _pick(b, g, idx, pos):
    """g where idx == pos else 0: routes a reduction's gradient to the chosen element."""
    return b.select(b.icmp_signed("==", idx, pos), g, u.const(g.type, 0.0))


def _tie_grad(cmp):
    """Gradient of maximum/minimum to the first operand: g if it wins, g/2 on an exact tie."""
    def emit(b, g, x, y):
        zero = u.const(g.type, 0.0)
        half = b.fmul(g, u.const(g.type, 0.5))
        return b.select(b.fcmp_ordered(cmp, x, y), g, b.select(b.fcmp_ordered("==", x, y), half, zero))
    return emit


def _pow_grad_base(b, g, x, e):
    """g * e * x^(e-1)"""
    return b.fmul(g, b.fmul(e, _pow(b, x, b.fsub(e, u.const(e.type, 1.0)))))


def _pow_grad_exp(b, g, x, y):
    """g * ln(x) * y, with 0 where x == 0 (torch's convention; the true limit for e >= 0)."""
    from . import vmath

    d = b.fmul(g, b.fmul(vmath.log(b, x), y))
    return b.select(b.fcmp_ordered("==", x, u.const(x.type, 0.0)), u.const(x.type, 0.0), d)


ARITHMETIC = {
    "copy": (1, lambda b, x: x),
    "neg": (1, lambda b, x: b.fneg(x)),
    "add": (2, lambda b, x, y: b.fadd(x, y)),
    "sub": (2, lambda b, x, y: b.fsub(x, y)),
    "mul": (2, lambda b, x, y: b.fmul(x, y)),
    "div": (2, lambda b, x, y: b.fdiv(x, y)),
    "maximum": (2, nan_max),
    "minimum": (2, nan_min),
    "pow": (2, _pow),
    "add_scaled": (3, lambda b, x, y, a: b.fadd(x, b.fmul(a, y))),  # x + a*y
    # backward rules (g first)
    "div_grad_b": (3, lambda b, g, x, y: b.fneg(b.fdiv(b.fmul(g, x), b.fmul(y, y)))),
    "maximum_grad": (3, _tie_grad(">")),
    "minimum_grad": (3, _tie_grad("<")),
    "pow_grad_base": (3, _pow_grad_base),
    "pow_grad_exp": (3, _pow_grad_exp),
    "pick": (3, _pick),
}

# every float op: arithmetic here, activations and masks in their own modules
FLOAT_OPS = {**ARITHMETIC, **activations.OPS, **masks.OPS, **typed.CASTS}

INT_OPS = typed.OPS  # i64 and bool arithmetic lives in codegen/typed.py


def op_table(compute_dtype: str, op: str = "") -> dict:
    if op.startswith("elemental:") and compute_dtype == "f32":  # user scalar ops (SPEC §3.5)
        from .elemental import op_entry

        return {op: op_entry(op)}
    if op.startswith("add_then:") and compute_dtype == "f32":  # x + bias, then an activation
        act = FLOAT_OPS[op[len("add_then:"):]][1]
        return {op: (2, lambda b, x, y: act(b, b.fadd(x, y)))}
    return INT_OPS if compute_dtype in ("i64", "bool") else FLOAT_OPS


def domain(in_dtypes) -> str:
    """Which table an op comes from: the compute dtype of the first non-bool input (a bool
    condition or mask does not make `where` an integer op)."""
    return next((compute_dtype(d) for d in in_dtypes if d != "bool"), "bool")


def compute_dtype(dtype: str) -> str:
    return {"f16": "f32", "bf16": "f32"}.get(dtype, dtype)


@register
@dataclass(frozen=True)
class ElementwiseKey(KernelKey):
    family = "elementwise"
    op: str
    in_dtypes: tuple   # storage dtype per input (a param's dtype is its compute dtype)
    out_dtype: str
    rank: int          # coalesced rank of the output
    roles: tuple       # per input: "unit" | "zero" | "strided" | "param"
    out_role: str = "linear"  # "linear" (a fresh contiguous result) | "unit" | "strided" (a view)

    def ir(self, symbol: str) -> str:
        return str(_build(self, symbol))


def _build(key: ElementwiseKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    k, r = len(key.roles), key.rank
    cdt = domain(key.in_dtypes)
    arity, fn = op_table(cdt, key.op)[key.op]
    assert arity == k, (key.op, k)
    ctype = u.COMPUTE[cdt]
    lanes = host().vector_bits // (ctype.width if isinstance(ctype, ir.IntType) else 32)

    out = u.arg_ptr(b, args, 0)
    ins = []
    for j, role in enumerate(key.roles):
        if role == "param":
            raw = u.arg(b, args, 1 + j)
            ins.append(b.bitcast(b.trunc(raw, u.I32), u.F32) if ctype == u.F32 else raw)
        else:
            ins.append(u.arg_ptr(b, args, 1 + j))
    n = u.arg(b, args, k + 1)
    chunk = u.arg(b, args, k + 2)
    shape = [u.arg(b, args, k + 3 + d) for d in range(r)]
    tensors = [j for j, role in enumerate(key.roles) if role != "param"]
    if key.out_role != "linear":
        tensors.append(-1)  # the output is a strided view: its strides come last
    strides = {j: [u.arg(b, args, k + 3 + r + t * r + d) for d in range(r)]
               for t, j in enumerate(tensors)}

    e0 = b.mul(c0, chunk)
    e1 = u.smin(b, b.mul(c1, chunk), n)
    scalar_only = "strided" in key.roles or key.out_role == "strided"

    def inner(e, offs, length):
        """out[e : e+length] = op(inputs at offs ...), along the innermost axis."""
        bases = {}
        for j in tensors:
            if j >= 0:
                bases[j] = b.gep(ins[j], [offs[j]], source_etype=u.STORAGE[key.in_dtypes[j]])
        obase = b.gep(out, [offs[-1] if key.out_role != "linear" else e],
                      source_etype=u.STORAGE[key.out_dtype])

        def operands(i, width, mask=None):
            vals = []
            for j, role in enumerate(key.roles):
                if role == "param":
                    vals.append(ins[j] if width is None else u.splat(b, ins[j], width))
                elif role == "zero":
                    s = u.load(b, bases[j], u.i64(0), key.in_dtypes[j])
                    vals.append(s if width is None else u.splat(b, s, width))
                elif role == "unit":
                    vals.append(u.load(b, bases[j], i, key.in_dtypes[j], width, mask))
                else:
                    vals.append(u.load(b, bases[j], b.mul(i, strides[j][r - 1]), key.in_dtypes[j]))
            return vals

        if scalar_only:
            with u.Loop(b, u.i64(0), length, 1, "s") as i:
                o = b.mul(i, strides[-1][r - 1]) if key.out_role == "strided" else i
                u.store(b, fn(b, *operands(i, None)), obase, o, key.out_dtype)
            return
        full = b.sub(length, b.srem(length, u.i64(lanes)))
        with u.Loop(b, u.i64(0), full, lanes, "v") as i:
            u.store(b, fn(b, *operands(i, lanes)), obase, i, key.out_dtype)
        rest = b.sub(length, full)
        with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
            mask = u.tail_mask(b, rest, lanes)
            u.store(b, fn(b, *operands(full, lanes, mask)), obase, full, key.out_dtype, mask)

    if r == 1:
        offs = {j: b.mul(e0, strides[j][0]) for j in tensors}
        inner(e0, offs, b.sub(e1, e0))
        b.ret_void()
        return mod

    # Multi-index of e0, innermost last; offsets are recomputed from it after each row.
    idx = [u.entry_alloca(b, u.I64, f"idx{d}") for d in range(r)]
    rem = e0
    for d in reversed(range(r)):
        b.store(b.srem(rem, shape[d]), idx[d])
        rem = b.sdiv(rem, shape[d])
    e_var = u.entry_alloca(b, u.I64, "e")
    b.store(e0, e_var)
    head = b.function.append_basic_block("row.head")
    body = b.function.append_basic_block("row.body")
    done = b.function.append_basic_block("row.done")
    b.branch(head)
    b.position_at_end(head)
    e = b.load(e_var)
    b.cbranch(b.icmp_signed("<", e, e1), body, done)
    b.position_at_end(body)
    cur = [b.load(p) for p in idx]
    offs = {}
    for j in tensors:
        acc = u.i64(0)
        for d in range(r):
            acc = b.add(acc, b.mul(cur[d], strides[j][d]))
        offs[j] = acc
    length = u.smin(b, b.sub(shape[r - 1], cur[r - 1]), b.sub(e1, e))
    inner(e, offs, length)
    b.store(b.add(e, length), e_var)
    # advance the multi-index by `length` (which always ends the row or the chunk)
    last = b.add(cur[r - 1], length)
    b.store(last, idx[r - 1])
    carry = b.icmp_signed("==", last, shape[r - 1])
    for d in reversed(range(r - 1)):
        with b.if_then(carry):
            b.store(u.i64(0), idx[d + 1])
            b.store(b.add(b.load(idx[d]), u.i64(1)), idx[d])
        carry = b.and_(carry, b.icmp_signed("==", b.load(idx[d]), shape[d]))
    b.branch(head)
    b.position_at_end(done)
    b.ret_void()
    return mod
