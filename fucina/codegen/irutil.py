"""Small IR-building helpers shared by every kernel family: the kernel signature, argument
access, counted loops, and typed loads/stores that widen 16-bit floats to f32 and narrow back.

Every kernel has one C signature, `void k(const int64_t *args, int64_t c0, int64_t c1)`: it
processes the chunks [c0, c1) of a grid fixed by the problem size, so which thread runs which
chunk never changes a bit of the result.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir

from .target import host

F32 = ir.FloatType()
F16 = ir.HalfType()
I1 = ir.IntType(1)
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
PTR = ir.PointerType()
VOID = ir.VoidType()

# storage type of each dtype, and the type arithmetic happens in
STORAGE = {"f32": F32, "f16": F16, "bf16": I16, "i64": I64, "bool": I8}
COMPUTE = {"f32": F32, "f16": F32, "bf16": F32, "i64": I64, "bool": I8}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "i64": 8, "bool": 1}


def i64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def f32_const(ty, value: float) -> ir.Constant:
    """A float32 constant (rounded to f32 first) of scalar or vector type `ty`."""
    v = float(np.float32(value))
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, v)] * ty.count)
    return ir.Constant(ty, v)


def const(ty, value) -> ir.Constant:
    """A constant of scalar or vector type, float values rounded to float32."""
    elem = ty.element if isinstance(ty, ir.VectorType) else ty
    if isinstance(elem, (ir.FloatType, ir.HalfType)):
        return f32_const(ty, value)
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(elem, int(value))] * ty.count)
    return ir.Constant(ty, int(value))


def vec(elem, lanes: int | None):
    return elem if lanes is None else ir.VectorType(elem, lanes)


def kernel(symbol: str):
    """A new module holding the kernel function; returns (module, builder, args, c0, c1)."""
    mod = ir.Module(name=symbol)
    fn = ir.Function(mod, ir.FunctionType(VOID, [PTR, I64, I64]), name=symbol)
    fn.args[0].add_attribute("noalias")
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    return mod, b, fn.args[0], fn.args[1], fn.args[2]


def module(symbol: str, body, *first) -> str:
    """The IR text of a one-function kernel module: body(*first, b, args, c0, c1) emits the
    body, this adds the return."""
    mod, b, args, c0, c1 = kernel(symbol)
    body(*first, b, args, c0, c1)
    b.ret_void()
    return str(mod)


def arg(b: ir.IRBuilder, args, i: int) -> ir.Value:
    """args[i] as i64."""
    p = b.gep(args, [i64(i)], source_etype=I64)
    return b.load(p, typ=I64)


def arg_ptr(b, args, i):
    return b.inttoptr(arg(b, args, i), PTR)


def arg_f32(b, args, i):
    """A float32 passed as its bit pattern in the low half of an int64 argument."""
    return b.bitcast(b.trunc(arg(b, args, i), I32), F32)


def smin(b, x, y):
    return b.select(b.icmp_signed("<", x, y), x, y)


def intrinsic(b: ir.IRBuilder, name: str, ret, operands, types=None):
    """Call an LLVM intrinsic overloaded on `types` (default: the return type)."""
    types = [ret] if types is None else types
    full = ".".join([name] + [_mangle(t) for t in types])
    fn = b.module.globals.get(full)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(ret, [o.type for o in operands]), name=full)
    return b.call(fn, operands)


def prefetch(b, base, index, dtype, write=False, locality=3):
    """Prefetch the cache line holding base[index] into all cache levels (for a read, or with
    write intent: the line comes owned, so the stores that follow need no second request);
    locality < 3 asks for the outer levels only (prefetcht1/t2: L2 on AMD)."""
    p = b.gep(base, [index], source_etype=STORAGE[dtype])
    i32 = lambda v: ir.Constant(I32, v)  # noqa: E731
    intrinsic(b, "llvm.prefetch", VOID, [p, i32(int(write)), i32(locality), i32(1)], types=[PTR])


def _mangle(t) -> str:
    """The overload suffix LLVM expects: f32, v16f32, v8i64, p0 ..."""
    if isinstance(t, ir.VectorType):
        return f"v{t.count}{_mangle(t.element)}"
    if isinstance(t, ir.PointerType):
        return "p0"
    if isinstance(t, ir.IntType):
        return f"i{t.width}"
    return {ir.FloatType: "f32", ir.DoubleType: "f64", ir.HalfType: "f16"}[type(t)]


class Loop:
    """`for i in range(start, stop, step)` with the index as a phi; use as a context manager.

    with Loop(b, start, stop, step) as i: ... body ...
    After the block the builder sits in the exit block.
    """

    def __init__(self, b, start, stop, step=1, name="i"):
        self.b, self.start, self.stop, self.name = b, start, stop, name
        self.step = i64(step) if isinstance(step, int) else step

    def __enter__(self):
        b = self.b
        self.pre = b.block
        fn = b.function
        self.head = fn.append_basic_block(self.name + ".head")
        self.body = fn.append_basic_block(self.name + ".body")
        self.exit = fn.append_basic_block(self.name + ".exit")
        b.branch(self.head)
        b.position_at_end(self.head)
        self.i = b.phi(I64, name=self.name)
        self.i.add_incoming(self.start, self.pre)
        b.cbranch(b.icmp_signed("<", self.i, self.stop), self.body, self.exit)
        b.position_at_end(self.body)
        return self.i

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        b = self.b
        nxt = b.add(self.i, self.step)
        self.i.add_incoming(nxt, b.block)
        b.branch(self.head)
        b.position_at_end(self.exit)
        return False


def unrolled(b, start, stop, U: int, step, name="k"):
    """step(i) for i in start .. stop-1 in increasing order: U calls per iteration of a loop,
    then one at a time for the rest (the micro-kernels' k loops)."""
    n = b.sub(stop, start)
    main = b.add(start, b.sub(n, b.srem(n, i64(U))))
    with Loop(b, start, main, U, name) as i:
        for s in range(U):
            step(b.add(i, i64(s)))
    with Loop(b, main, stop, 1, name + "r") as i:
        step(i)


def iota(lanes: int):
    return ir.Constant(ir.VectorType(I64, lanes), [ir.Constant(I64, k) for k in range(lanes)])


def tail_mask(b, remaining, lanes: int):
    """<lanes x i1>: lane k is on iff k < remaining (0 <= remaining <= lanes)."""
    splat = b.insert_element(ir.Constant(ir.VectorType(I64, lanes), ir.Undefined), remaining, i64(0))
    splat = b.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))
    return b.icmp_signed("<", iota(lanes), splat)


def splat(b, scalar, lanes: int):
    v = b.insert_element(ir.Constant(ir.VectorType(scalar.type, lanes), ir.Undefined), scalar, i64(0))
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))


def widen(b, v, dtype: str):
    """A storage value (scalar or vector) to its compute type: f16/bf16 become f32 exactly."""
    lanes = v.type.count if isinstance(v.type, ir.VectorType) else None
    if dtype == "f16":
        return b.fpext(v, vec(F32, lanes))
    if dtype == "bf16":
        w = b.shl(b.zext(v, vec(I32, lanes)), const(vec(I32, lanes), 16))
        return b.bitcast(w, vec(F32, lanes))
    return v


def narrow(b, v, dtype: str):
    """A compute value to storage: f32->f16 round-to-nearest-even (fptrunc is IEEE RNE);
    f32->bf16 the NaN-guarded RNE of SPEC R-9, in integer ops (the bf16 convert instruction
    flushes denormals, which the spec does not)."""
    lanes = v.type.count if isinstance(v.type, ir.VectorType) else None
    if dtype == "bool" and (v.type == I1 or getattr(v.type, "element", None) == I1):
        return b.zext(v, vec(I8, lanes))  # a comparison result stored as a 0/1 byte
    if dtype == "f16":
        return b.fptrunc(v, vec(F16, lanes))
    if dtype == "bf16":
        t = vec(I32, lanes)
        bits = b.bitcast(v, t)
        hi = b.lshr(bits, const(t, 16))
        is_nan = b.icmp_unsigned(">", b.and_(bits, const(t, 0x7FFFFFFF)), const(t, 0x7F800000))
        quiet = b.or_(hi, const(t, 0x40))
        lsb = b.and_(hi, const(t, 1))
        rne = b.lshr(b.add(b.add(bits, const(t, 0x7FFF)), lsb), const(t, 16))
        return b.trunc(b.select(is_nan, quiet, rne), vec(I16, lanes))
    return v


def load(b, base, index, dtype: str, lanes: int | None = None, mask=None, fill=0.0):
    """Load element(s) `index..` of a `dtype` array at `base` and widen to the compute type.
    With `mask`, a masked vector load (masked-off lanes read nothing and take `fill`)."""
    st = vec(STORAGE[dtype], lanes)
    p = b.gep(base, [index], source_etype=STORAGE[dtype])
    if mask is None:
        v = b.load(p, typ=st)
        v.align = ITEMSIZE[dtype]
    else:
        passthru = narrow_const(st, dtype, fill)
        v = intrinsic(b, "llvm.masked.load", st, [p, ir.Constant(I32, ITEMSIZE[dtype]), mask, passthru],
                      types=[st, PTR])
    return widen(b, v, dtype)


def narrow_const(st, dtype, value):
    """A storage-typed constant of `value` (for masked-load fill values)."""
    if dtype == "bf16":
        bits = int(np.array([value], np.float32).view(np.uint32)[0] >> 16)
        return const(st, bits)
    return const(st, value)


def store(b, v, base, index, dtype: str, mask=None, stream=False):
    """Narrow a compute value to `dtype` and store it at base[index..] (masked if given).
    stream: a non-temporal store of a whole aligned vector (the caller guarantees base[index]
    sits on a 64-byte line, or on a multiple of a smaller vector's size) — it skips reading the
    line into the cache first, so a result larger than the last-level cache costs its bytes
    once instead of twice."""
    v = narrow(b, v, dtype)
    p = b.gep(base, [index], source_etype=STORAGE[dtype])
    if mask is None and stream:
        nbytes = ITEMSIZE[dtype] * v.type.count
        # stored as 64-bit words (f16 then gets vmovntdq; LLVM still folds bf16's integer
        # narrowing into a truncating vpmovdw, which has no non-temporal form)
        s = b.store(b.bitcast(v, ir.VectorType(I64, nbytes // 8)), p)
        s.align = min(nbytes, 64)
        s.set_metadata("nontemporal", b.module.add_metadata([ir.Constant(I32, 1)]))
    elif mask is None:
        s = b.store(v, p)
        s.align = ITEMSIZE[dtype]
    elif isinstance(mask, ir.Constant) or host().mask_registers:
        intrinsic(b, "llvm.masked.store", VOID, [v, p, ir.Constant(I32, ITEMSIZE[dtype]), mask],
                  types=[v.type, PTR])
    else:
        # no mask registers (AVX2): a mask with every lane on — every full tile of a GEMM —
        # takes a plain store instead of a vmaskmovps one (~12 times its cost on Zen 3)
        n = mask.type.count
        full = b.icmp_unsigned("==", b.bitcast(mask, ir.IntType(n)),
                               ir.Constant(ir.IntType(n), (1 << n) - 1))
        with b.if_else(full, likely=True) as (then, other):
            with then:
                b.store(v, p).align = ITEMSIZE[dtype]
            with other:
                intrinsic(b, "llvm.masked.store", VOID,
                          [v, p, ir.Constant(I32, ITEMSIZE[dtype]), mask], types=[v.type, PTR])


def while_loop(b, cond, body, name="w"):
    """while cond(): body() — cond and body build IR at the loop head and in the body; state
    lives in entry-block slots (mem2reg lifts it)."""
    fn = b.function
    head = fn.append_basic_block(name + ".head")
    blk = fn.append_basic_block(name + ".body")
    done = fn.append_basic_block(name + ".exit")
    b.branch(head)
    b.position_at_end(head)
    b.cbranch(cond(), blk, done)
    b.position_at_end(blk)
    body()
    b.branch(head)
    b.position_at_end(done)


def entry_alloca(b, ty, name=""):
    """A stack slot in the entry block, where mem2reg promotes it to registers."""
    entry = b.function.entry_basic_block
    with b.goto_block(entry):
        if entry.instructions:
            b.position_before(entry.instructions[0])
        return b.alloca(ty, name=name)
