"""Matrix multiplication at the exec layer: validate once, plan once per layout, launch.

`gemm(ctx, a, b)` views a as [*batch, M, K] and b as [*batch, K, N] with any element strides
(a transposed operand is only swapped strides: packing reads every orientation) and returns a
contiguous f32 [*batch, M, N].

Paths (codegen/gemm.py), chosen from the shapes and strides alone:
  packed  — pack A and B into panels (one launch each, parallel over panels; a batch-broadcast
            operand is packed once), then one launch over a grid of (batch, M-block, N-block)
            tiles of C. The grid is a function of the problem size only.
  rowvec  — few rows of C (M <= 4) with b contiguous along n, or tiny problems: no packing.
  dot     — few rows (or few columns) of C with a and b contiguous along k (x · Wᵀ for one
            token, a skinny output): dot products vectorised along k.
Every path fixes the order of each element's k-sum by the shape, so a result is bitwise
identical for any thread count. Different shapes may take different paths.

A plan (kernel addresses, chunk counts and the static argument tails) is memoised on the
operands' layouts, so a repeated call costs a dict lookup, a pool allocation and the launches.
"""
from __future__ import annotations

from ..codegen import gemm as g
from ..codegen import kernels
from ..errors import DTypeError, ShapeMismatch
from .raw import RawTensor, numel

KC = 256                 # k block: a KC x NR panel of B stays in L1 across the MR panels of A
MC_PANELS = 8            # at most this many MR panels of A per tile (MC x KC of A stays in L2)
NC_PANELS = 8            # at most this many NR panels of B per tile
PACK_CHUNK = 1 << 16     # floats packed per chunk
SMALL_CHUNK = 1 << 15    # multiply-adds per chunk of the direct kernels
SMALL_M = 4              # at most this many rows of C go the direct way (rowvec / dot)
DOT_N = 16               # at most this many columns of C go the dot way (when K is long)
DOT_MIN_K = 128
TINY = 1 << 15           # M*N*K below this: no packing (rowvec) when b is contiguous along n

_plans: dict = {}


class _Plan:
    """What one layout triple needs: the output shape, scratch sizes and the launches.

    Each step is (addr, n_chunks, cost, ptrs, tail): `ptrs` name the pointer arguments as
    (base, byte offset) with base in "a", "b", "c", "s" (scratch), "p" (partial sums)."""

    __slots__ = ("shape", "scratch", "partial", "steps", "bt_copy", "outer")

    def __init__(self, shape):
        self.shape = shape
        self.scratch = 0      # floats
        self.partial = 0      # floats (accumulate with more than one KC block)
        self.steps = []
        self.bt_copy = False  # b must first be copied k-contiguous ([*batch, N, K]) for the dot path
        self.outer = None     # leading batch axes run in Python: (shape, a strides, b strides)


def _check(op, a, b, out):
    if not isinstance(a, RawTensor) or not isinstance(b, RawTensor):
        raise TypeError(f"{op}: expected RawTensor operands, got {type(a).__name__} and "
                        f"{type(b).__name__}")
    if a.dtype != "f32":
        raise DTypeError(f"{op}: operand a: expected dtype f32, got {a.dtype}")
    if b.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"{op}: operand b: expected dtype f32, f16 or bf16, got {b.dtype}")
    if a.rank < 2 or b.rank < 2 or a.rank != b.rank:
        raise ShapeMismatch(f"{op}: expected a [*batch, M, K] and b [*batch, K, N] of equal rank "
                            f">= 2, got shapes {a.shape} and {b.shape}")
    if a.shape[:-2] != b.shape[:-2]:
        raise ShapeMismatch(f"{op}: operand b: expected batch shape {a.shape[:-2]} (a's), "
                            f"got {b.shape[:-2]}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeMismatch(f"{op}: operand b: expected contraction length {a.shape[-1]} "
                            f"(a's last axis), got {b.shape[-2]} (shapes {a.shape}, {b.shape})")
    shape = a.shape[:-1] + b.shape[-1:]
    if out is not None:
        if not isinstance(out, RawTensor):
            raise TypeError(f"{op}: operand out: expected a RawTensor, got {type(out).__name__}")
        if out.dtype != "f32":
            raise DTypeError(f"{op}: operand out: expected dtype f32, got {out.dtype}")
        if out.shape != shape:
            raise ShapeMismatch(f"{op}: operand out: expected shape {shape}, got {out.shape}")
        if not out.is_contiguous():
            raise ShapeMismatch(f"{op}: operand out: expected a contiguous tensor, got strides "
                                f"{out.strides} for shape {out.shape}")
        if out.buf is a.buf or out.buf is b.buf:
            raise ValueError(f"{op}: operand out: expected a buffer distinct from a's and b's")
    return shape


def gemm(ctx, a: RawTensor, b: RawTensor, out: RawTensor | None = None,
         accumulate: bool = False) -> RawTensor:
    """c[*batch, M, N] = a[*batch, M, K] · b[*batch, K, N] (f32 accumulate); into `out` if given;
    with accumulate=True, out += a·b — one final rounding per element after the full k-sum."""
    op = "add_dot" if accumulate else "matmul"
    pk = (a.lay, b.lay, accumulate)
    plan = _plans.get(pk)
    if plan is None or out is not None:
        shape = _check(op, a, b, out)
        if accumulate and out is None:
            raise ValueError(f"{op}: accumulate=True needs out= (the tensor to add to)")
        if plan is None:
            plan = _plans[pk] = _make_plan(a, b, shape, accumulate)
    ctx.check_open(op)
    if out is None:
        out = ctx.empty(plan.shape, "f32")
    if plan.outer is None:
        _run(ctx, plan, a, b, out, 0, 0, 0)
    else:
        oshape, ast, bst = plan.outer
        inner = numel(plan.shape[len(oshape):])
        for idx in range(numel(oshape)):
            ao = bo = 0
            rem = idx
            for d in range(len(oshape) - 1, -1, -1):
                rem, i = divmod(rem, oshape[d])
                ao += i * ast[d]
                bo += i * bst[d]
            _run(ctx, plan, a, b, out, ao * 4, bo * b.lay.itemsize, idx * inner * 4)
    return out


def _run(ctx, plan, a, b, out, aoff, boff, coff):
    base = {"a": a.addr + aoff, "b": b.addr + boff, "c": out.addr + coff}
    keep = []
    if plan.scratch:
        s = ctx.empty((plan.scratch,), "f32")
        keep.append(s)
        base["s"] = s.addr
    if plan.partial:
        p = ctx.empty((plan.partial,), "f32")
        keep.append(p)
        base["p"] = p.addr
    if plan.bt_copy:
        bt = _copy_k_contiguous(ctx, b)
        keep.append(bt)
        base["b"] = bt.addr
    launch = ctx.launch
    for addr, n, cost, ptrs, tail in plan.steps:
        launch(addr, n, cost, *[base[r] + o for r, o in ptrs], *tail)
    del keep


def _copy_k_contiguous(ctx, b):
    """b[*batch, K, N] copied to a contiguous [*batch, N, K] (the dot path wants k unit-stride)."""
    from . import elementwise as ew

    r = b.rank
    src = b.permute(tuple(range(r - 2)) + (r - 1, r - 2))
    return ew.run(ctx, "copy", b.dtype, src.shape, [src])


# ---------------------------------------------------------------------------------------------
# planning

def _coalesce_batch(shape, strides_list):
    """Merge batch axes that every operand (and the contiguous output) walks in step."""
    from .elementwise import coalesce

    if not shape or numel(shape) == 1:
        return (), [() for _ in strides_list]
    cs, cst = coalesce(shape, strides_list)
    return cs, cst


def _make_plan(a, b, shape, accumulate) -> _Plan:
    plan = _Plan(shape)
    M, K = a.shape[-2:]
    N = b.shape[-1]
    bshape = a.shape[:-2]
    cstr = tuple(st * M * N for st in _contig(bshape))
    bs, (ast, bst, _) = _coalesce_batch(bshape, [a.strides[:-2], b.strides[:-2], cstr])
    if len(bs) > 3:
        plan.outer = (bs[:-3], ast[:-3], bst[:-3])
        bs, ast, bst = bs[-3:], ast[-3:], bst[-3:]
    nbatch = numel(bs)
    while len(bs) < 3:
        bs, ast, bst = (1,) + bs, (0,) + ast, (0,) + bst
    s_am, s_ak = a.strides[-2:]
    s_bk, s_bn = b.strides[-2:]
    unit_n = s_bn == 1 or N == 1
    unit_ka = s_ak == 1 or K == 1
    unit_kb = s_bk == 1 or K == 1
    args = (b.dtype, M, N, K, bs, ast, nbatch, accumulate)
    if M <= SMALL_M and unit_n:
        _plan_small(plan, "rowvec", (s_am, s_ak, s_bk, 1), bst, *args)
    elif M <= SMALL_M and unit_ka and unit_kb:
        _plan_small(plan, "dot", (s_am, 1, 1, s_bn), bst, *args)
    elif N <= DOT_N and K >= DOT_MIN_K and unit_ka and (unit_kb or plan.outer is None):
        if unit_kb:
            _plan_small(plan, "dot", (s_am, 1, 1, s_bn), bst, *args)
        else:
            # b has only N <= DOT_N columns: copy it k-contiguous, [*batch, N, K], first
            plan.bt_copy = True
            _plan_small(plan, "dot", (s_am, 1, 1, K), tuple(st * N * K for st in _contig(bs)),
                        *args)
    elif M * N * K <= TINY and unit_n:
        _plan_small(plan, "rowvec", (s_am, s_ak, s_bk, 1), bst, *args)
    else:
        _plan_packed(plan, (s_am, s_ak), (s_bk, s_bn), bst, *args)
    return plan


def _contig(shape):
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _plan_small(plan, mode, strides, bst, bdt, M, N, K, bs, ast, nbatch, acc):
    W = g.lanes()
    if mode == "rowvec":
        rm = min(M, SMALL_M)
        rn = 8 if rm <= 2 else 4
        ncb = -(-N // (rn * W))
        rn = min(rn, -(-N // W))
        work = rm * min(N, rn * W) * K
    else:
        rm = min(M, 2)
        rn = 8 if rm == 1 else 4
        rn = min(rn, N)
        ncb = -(-N // rn)
        work = rm * rn * K
    nrg = -(-M // rm)
    items = nbatch * nrg * ncb
    per = max(1, SMALL_CHUNK // max(work, 1))
    addr = kernels.get(g.GemmSmallKey(bdt, mode, rm, rn))
    plan.steps.append((addr, -(-items // per), 2 * nbatch * M * N * K,
                       (("a", 0), ("b", 0), ("c", 0)),
                       (M, N, K, *strides, bs[1], bs[2], *ast, *bst, int(acc), per, nrg, ncb,
                        nbatch)))


def _pack_step(src, dtype, width, rows, K, s_w, s_k, bs, bst, nbatch, dst_off):
    """One gemm_pack launch; returns (step, packed batches, floats written)."""
    npb = nbatch if any(bst) else 1
    if s_w == 1 or rows == 1:
        mode = "wvec"
    elif s_k == 1 or K == 1:
        mode = "kvec"
    else:
        mode = "any"
    npan = -(-rows // width)
    pad = npan * width
    per = max(1, min(npan, PACK_CHUNK // (width * K)))
    groups = -(-npan // per)
    addr = kernels.get(g.GemmPackKey(dtype, width, mode))
    step = (addr, npb * groups, npb * pad * K * 8, ((src, 0), ("s", dst_off)),
            (rows, K, s_w, s_k, KC, npan, per, groups, bs[1], bs[2], *bst, pad * K))
    return step, npb, npb * pad * K


def _blocks(n_panels, max_per):
    """Split n_panels into equal-ish blocks of at most max_per panels: panels per block."""
    nblk = -(-n_panels // max_per)
    return -(-n_panels // nblk)


def _plan_packed(plan, sa, sb, bst, bdt, M, N, K, bs, ast, nbatch, acc):
    MR, NR = g.MR, g.nr()
    Mp = -(-M // MR) * MR
    Np = -(-N // NR) * NR
    a_step, npa, asz = _pack_step("a", "f32", MR, M, K, sa[0], sa[1], bs, ast, nbatch, 0)
    asz = -(-asz // 16) * 16
    b_step, npb, bsz = _pack_step("b", bdt, NR, N, K, sb[1], sb[0], bs, bst, nbatch, asz * 4)
    plan.steps += [a_step, b_step]
    plan.scratch = asz + bsz
    MC = _blocks(Mp // MR, MC_PANELS) * MR
    NC = _blocks(Np // NR, NC_PANELS) * NR
    nmb, nnb = -(-M // MC), -(-N // NC)
    if acc and K > KC:
        plan.partial = nbatch * M * N
    addr = kernels.get(g.GemmTileKey(MR, g.NR_VECS, g.UNROLL))
    plan.steps.append((addr, nbatch * nmb * nnb, 2 * nbatch * M * N * K,
                       (("s", 0), ("s", asz * 4), ("c", 0), ("p" if plan.partial else "c", 0)),
                       (M, N, K, KC, MC, NC, nmb, nnb, 0 if npa == 1 else Mp * K,
                        0 if npb == 1 else Np * K, int(acc))))
