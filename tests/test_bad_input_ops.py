"""Bad-input battery for tensor ops (issue 20 item 6, the ops part): wrong tags, shapes and
dtypes, out-of-range indices and sizes, wrong Python types, non-finite scalars where refused,
closed contexts, released tensors and mixed contexts, across the op families. Each case asserts
the exact FucinaError subclass (argument-type and option errors are InvalidArgumentType /
InvalidArgument, which are also TypeError / ValueError) and that the one-line message starts
with the op's name and names the operand or option at fault."""
import re

import numpy as np
import pytest

import fucina as fu
from fucina.ag.loss import InvalidHuberDelta

F = np.float32


@pytest.fixture(scope="module")
def mctx():
    c = fu.ExecContext(threads=1)
    yield c
    c.close()


class T:
    """The operands every case draws from, made fresh in the case's context."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.x = ctx.tensor(np.arange(6, dtype=F).reshape(2, 3), ("r", "c"))
        self.w = ctx.tensor(np.ones((3, 4), F), ("c", "o"))
        self.v = ctx.variable(np.ones((2, 3), F), ("r", "c"))
        self.i = ctx.tensor(np.array([0, 1]), ("s",), "i64")
        self.b = ctx.tensor(np.array([True, False, True]), ("c",), "bool")
        self.h = ctx.tensor(np.ones((2, 3), F), ("r", "c"), "f16")
        self.e = ctx.zeros((0, 2), ("a", "b"))

    def t(self, data, tags, dtype="f32"):
        return self.ctx.tensor(data, tags, dtype)


def _released(o):
    y = o.x.relu()
    y.release()
    y.relu()


def _closed(f):
    def run(o):
        c = fu.ExecContext(threads=1)
        x = c.tensor(np.ones((2, 3), F), ("r", "c"))
        c.close()
        f(c, x)
    return run


def _mixed(f):
    def run(o):
        with fu.ExecContext(threads=1) as c2:
            f(o.x, c2.tensor(np.ones((2, 3), F), ("r", "c")))
    return run


def _scope_borrow(o):
    with o.ctx.exec_scope():
        y = o.x.relu()
    y.numpy()


def _backward_twice(o):
    loss = o.v.sum_all()
    loss.backward()
    loss.backward()


# (id, case(o), error class, op the message starts with, what else the message must name)
CASES = [
    # ---- construction
    ("tensor rank vs tags", lambda o: o.ctx.tensor([[1, 2]], ("a",)),
     fu.TagError, "tensor", "tags"),
    ("tensor duplicate tags", lambda o: o.ctx.tensor([[1, 2]], ("a", "a")),
     fu.TagError, "tensor", "duplicate"),
    ("tensor tag not str", lambda o: o.ctx.tensor([1, 2], (3,)), fu.TagError, "tensor", "strings"),
    ("tensor dtype f64", lambda o: o.ctx.tensor([1.0], ("a",), "f64"),
     fu.DTypeError, "tensor", "f64"),
    ("tensor dtype block", lambda o: o.ctx.tensor([1.0], ("a",), "q8_0"),
     fu.DTypeError, "tensor", "q8_0"),
    ("tensor strings", lambda o: o.ctx.tensor(["a"], ("a",)),
     fu.InvalidArgumentType, "tensor", "numeric"),
    ("tensor ragged", lambda o: o.ctx.tensor([[1, 2], [3]], ("a", "b")),
     fu.InvalidArgumentType, "tensor", "numeric"),
    ("tensor object", lambda o: o.ctx.tensor(np.array([object()]), ("a",)),
     fu.InvalidArgumentType, "tensor", "dtype object"),
    ("tensor nan into i64", lambda o: o.ctx.tensor([np.nan], ("a",), "i64"),
     fu.InvalidArgument, "tensor", "i64"),
    ("tensor inf into i64", lambda o: o.ctx.tensor([np.inf, 1.0], ("a",), "i64"),
     fu.InvalidArgument, "tensor", "i64"),
    ("tensor int overflow", lambda o: o.ctx.tensor([1 << 70], ("a",), "i64"),
     fu.InvalidArgumentType, "tensor", "numeric"),
    ("from_slice length", lambda o: o.ctx.from_slice(("a",), (3,), [1, 2]),
     fu.InvalidDataLength, "from_slice", "3 values"),
    ("from_slice tags", lambda o: o.ctx.from_slice(("a", "b"), (3,), [1, 2, 3]),
     fu.TagError, "from_slice", "tags"),
    ("from_slice float size", lambda o: o.ctx.from_slice(("a",), (2.0,), [1, 2]),
     fu.InvalidArgumentType, "from_slice", "integer axis sizes"),
    ("from_slice strings", lambda o: o.ctx.from_slice(("a",), (1,), ["x"]),
     fu.InvalidArgumentType, "from_slice", "numeric"),
    ("zeros negative", lambda o: o.ctx.zeros((2, -1), ("a", "b")),
     fu.InvalidShape, "full", "(2, -1)"),
    ("zeros float size", lambda o: o.ctx.zeros((2.5,), ("a",)),
     fu.InvalidArgumentType, "full", "integer axis sizes"),
    ("zeros str size", lambda o: o.ctx.zeros(("a",), ("a",)),
     fu.InvalidArgumentType, "full", "integer axis sizes"),
    ("zeros bool size", lambda o: o.ctx.zeros((True,), ("a",)),
     fu.InvalidArgumentType, "full", "integer axis sizes"),
    ("zeros shape not sequence", lambda o: o.ctx.zeros(3, ("a",)),
     fu.InvalidArgumentType, "full", "shape"),
    ("zeros rank 9", lambda o: o.ctx.zeros((1,) * 9, tuple("abcdefghi")),
     fu.InvalidShape, "full", "rank <= 8"),
    ("full str value", lambda o: o.ctx.full((2,), "x", ("a",)),
     fu.InvalidArgumentType, "full", "value"),
    ("full nan into i64", lambda o: o.ctx.full((2,), float("nan"), ("a",), "i64"),
     fu.InvalidArgument, "full", "i64"),
    ("full dtype", lambda o: o.ctx.full((2,), 1.0, ("a",), "f64"), fu.DTypeError, "full", "f64"),
    ("variable i64", lambda o: o.ctx.variable(np.array([1, 2]), ("a",), "i64"),
     fu.DTypeError, "variable", "float dtype"),
    ("variable bool", lambda o: o.ctx.variable(np.array([True]), ("a",), "bool"),
     fu.DTypeError, "variable", "float dtype"),
    ("variable_from_slice i64", lambda o: o.ctx.variable_from_slice(("a",), (1,), [1], "i64"),
     fu.DTypeError, "variable_from_slice", "float dtype"),
    ("context threads 0", lambda o: fu.ExecContext(threads=0),
     fu.InvalidArgument, "ExecContext", "threads"),
    ("item of many", lambda o: o.x.item(), fu.InvalidShape, "item", "1 element"),
    ("item of empty", lambda o: o.e.item(), fu.InvalidShape, "item", "1 element"),
    ("data of variable", lambda o: o.v.data(),
     fu.MutableDataRequiresNoGrad, "data", "requires grad"),
    # ---- elementwise
    ("add axis size", lambda o: o.x + o.t(np.ones(4, F), ("c",)), fu.ShapeMismatch, "add", "'c'"),
    ("add f32 + f16", lambda o: o.x + o.h, fu.DTypeError, "add", "dtype"),
    ("add f32 + i64", lambda o: o.x + o.t([1, 2, 3], ("c",), "i64"), fu.DTypeError, "add", "dtype"),
    ("mul bool", lambda o: o.b * o.b, fu.DTypeError, "mul", "bool"),
    ("div i64", lambda o: o.t([1, 2], ("a",), "i64") / o.t([1, 2], ("a",), "i64"),
     fu.DTypeError, "div", "div_trunc"),
    ("add str", lambda o: o.x.add("x"), fu.InvalidArgumentType, "add", "other operand"),
    ("add ndarray", lambda o: o.x.add(np.ones((2, 3))),
     fu.InvalidArgumentType, "add", "other operand"),
    ("sub rank overflow", lambda o: o.t(np.ones((1,) * 8, F), tuple("abcdefgh")) - o.t([1.0], ("z",)),
     fu.TagError, "sub", "rank"),
    ("scale str", lambda o: o.x.scale("2"), fu.InvalidArgumentType, "scale", "real number"),
    ("scale bool", lambda o: o.x.scale(True), fu.InvalidArgumentType, "scale", "real number"),
    ("add_scalar None", lambda o: o.x.add_scalar(None),
     fu.InvalidArgumentType, "add_scalar", "real number"),
    ("clamp str", lambda o: o.x.clamp("a", 1.0), fu.InvalidArgumentType, "clamp", "real number"),
    ("leaky_relu str", lambda o: o.x.leaky_relu("a"),
     fu.InvalidArgumentType, "leaky_relu", "real number"),
    ("unary unknown", lambda o: o.x.unary("nope"), fu.InvalidArgument, "unary", "'nope'"),
    ("unary on i64", lambda o: o.t([1], ("a",), "i64").unary("gelu_erf"),
     fu.DTypeError, "gelu_erf", "float tensor"),
    ("dropout p 1.5", lambda o: o.x.dropout(1.5, seed=1), fu.InvalidShape, "dropout", "p=1.5"),
    ("dropout p nan", lambda o: o.x.dropout(float("nan"), seed=1),
     fu.InvalidShape, "dropout", "p=nan"),
    ("dropout p negative", lambda o: o.x.dropout(-0.1, seed=1),
     fu.InvalidShape, "dropout", "p=-0.1"),
    ("dropout seed str", lambda o: o.x.dropout(0.5, seed="a"),
     fu.InvalidArgumentType, "dropout", "seed"),
    ("compare unknown", lambda o: o.x.compare("zz", 0.0), fu.InvalidArgument, "compare", "'zz'"),
    ("where cond tags", lambda o: o.x.where(o.t([True] * 4, ("c",), "bool"), o.x),
     fu.TagError, "where", "cond"),
    ("where other dtype", lambda o: o.x.where(o.t(np.ones((2, 3), bool), ("r", "c"), "bool"), o.h),
     fu.DTypeError, "where", "other"),
    ("masked_fill str", lambda o: o.x.masked_fill(o.t([True, False], ("r",), "bool"), "a"),
     fu.InvalidArgumentType, "masked_fill", "value"),
    ("to f64", lambda o: o.x.to("f64"), fu.DTypeError, "to", "f64"),
    ("to i64 under grad", lambda o: o.v.to("i64"), fu.GradientCastUnsupported, "to", "f32 -> i64"),
    # ---- reductions
    ("sum unknown tag", lambda o: o.x.sum("zz"), fu.TagError, "sum", "'zz'"),
    ("sum int tag", lambda o: o.x.sum(0), fu.TagError, "sum", "tag 0"),
    ("mean bool", lambda o: o.b.mean("c"), fu.DTypeError, "mean", "bool"),
    ("mean mask tags", lambda o: o.x.mean("c", mask=o.b), fu.ShapeMismatch, "mean", "mask"),
    ("max empty axis", lambda o: o.e.max("a"), fu.InvalidShape, "max", "non-empty axis"),
    ("min empty axis", lambda o: o.e.min("a"), fu.InvalidShape, "min", "non-empty axis"),
    ("argmax empty axis", lambda o: o.e.argmax("a"), fu.InvalidShape, "argmax", "non-empty axis"),
    ("variance ddof -1", lambda o: o.x.variance("c", ddof=-1),
     fu.InvalidArgument, "variance", "ddof"),
    ("variance ddof 1.5", lambda o: o.x.variance("c", ddof=1.5),
     fu.InvalidArgument, "variance", "ddof"),
    ("variance ddof 2", lambda o: o.x.variance("c", ddof=2),
     fu.InvalidArgument, "variance", "ddof"),
    ("variance i64", lambda o: o.t([1, 2], ("a",), "i64").variance("a", ddof=0),
     fu.DTypeError, "variance", "i64"),
    ("top_k k 0", lambda o: o.x.top_k("c", 0, "k"), fu.InvalidShape, "top_k", "k=0"),
    ("top_k k > n", lambda o: o.x.top_k("c", 4, "k"), fu.IndexOutOfBounds, "top_k", "'c'"),
    ("top_k k float", lambda o: o.x.top_k("c", 1.5, "k"),
     fu.InvalidArgumentType, "top_k", "integer k"),
    ("sort unknown tag", lambda o: o.x.sort("zz"), fu.TagError, "sort", "'zz'"),
    ("cumsum i64", lambda o: o.t([1, 2], ("a",), "i64").cumsum("a"),
     fu.DTypeError, "cumsum", "i64"),
    # ---- softmax family
    ("softmax unknown tag", lambda o: o.x.softmax("zz"), fu.TagError, "softmax", "'zz'"),
    ("softmax scale str", lambda o: o.x.softmax("c", scale="1"),
     fu.InvalidArgumentType, "softmax", "real number"),
    ("softmax i64", lambda o: o.t([1, 2], ("a",), "i64").softmax("a"),
     fu.DTypeError, "softmax", "i64"),
    ("softmax mask size", lambda o: o.x.softmax("c", mask=o.t(np.zeros(4, F), ("c",))),
     fu.ShapeMismatch, "softmax", "'c'"),
    ("softmax mask requires grad", lambda o: o.x.softmax("c", mask=o.v),
     fu.UnsupportedGradient, "softmax", "mask"),
    ("softmax max_bias negative", lambda o: o.x.softmax("c", max_bias=-1.0),
     fu.InvalidShape, "softmax", "max_bias"),
    ("softmax max_bias nan", lambda o: o.x.softmax("c", max_bias=float("nan")),
     fu.InvalidShape, "softmax", "max_bias"),
    ("softmax alibi without head", lambda o: o.x.softmax("c", max_bias=1.0),
     fu.InvalidShape, "softmax", "head_tag"),
    ("softmax causal unknown key", lambda o: o.x.softmax("c", causal={"bogus": 1}),
     fu.InvalidArgumentType, "softmax", "causal"),
    ("softmax causal tag", lambda o: o.x.softmax("c", causal={"query_tag": "zz"}),
     fu.TagError, "softmax", "'zz'"),
    ("softmax causal offset", lambda o: o.x.softmax("c", causal={"query_tag": "r", "source_offset": -1}),
     fu.InvalidShape, "softmax", "source_offset"),
    ("softmax sinks count", lambda o: o.x.softmax("c", sinks=[1.0, 2.0]),
     fu.InvalidShape, "softmax", "sinks"),
    ("log_softmax f16", lambda o: o.h.log_softmax("c"), fu.DTypeError, "log_softmax", "f16"),
    ("logsumexp unknown tag", lambda o: o.x.logsumexp("zz"), fu.TagError, "logsumexp", "'zz'"),
    # ---- dot / matmul / einsum
    ("dot tag not in left", lambda o: o.x.dot(o.w, "o"), fu.TagError, "dot", "left operand"),
    ("dot tag not in right", lambda o: o.x.dot(o.w, "r"), fu.TagError, "dot", "right operand"),
    ("dot contraction size", lambda o: o.x.dot(o.t(np.ones((4, 2), F), ("c", "o")), "c"),
     fu.ShapeMismatch, "dot", "contraction axis 'c'"),
    ("dot batch size", lambda o: o.t(np.ones((2, 3, 4), F), ("b", "m", "k")).dot(o.t(np.ones((3, 4, 5), F), ("b", "k", "n")), "k"),
     fu.ShapeMismatch, "dot", "batch axis 'b'"),
    ("dot i64", lambda o: o.t([[1, 2]], ("a", "c"), "i64").dot(o.t([[1], [2]], ("c", "o"), "i64"), "c"),
     fu.DTypeError, "dot", "left operand"),
    ("dot ndarray", lambda o: o.x.dot(np.ones((3, 4)), "c"),
     fu.InvalidArgumentType, "dot", "Tensor operand"),
    ("matmul kind", lambda o: o.x.matmul(o.w, "none", ("r", "o")),
     fu.InvalidArgument, "matmul", "kind"),
    ("matmul out tags", lambda o: o.x.matmul(o.w, "plain", ("r",)), fu.TagError, "matmul", "tags"),
    ("matmul inner size", lambda o: o.x.matmul(o.t(np.ones((4, 4), F), ("k", "o")), "plain", ("r", "o")),
     fu.ShapeMismatch, "matmul", "operand b"),
    ("matmul rank 1", lambda o: o.t(np.ones(3, F), ("c",)).matmul(o.w, "plain", ("o",)),
     fu.TagError, "matmul", "rank"),
    ("einsum unknown out tag", lambda o: o.x.einsum(o.w, ("r", "zz")),
     fu.TagError, "einsum", "'zz'"),
    ("einsum duplicate out tags", lambda o: o.x.einsum(o.w, ("r", "r")),
     fu.TagError, "einsum", "output tags"),
    # ---- shape ops
    ("reshape element count", lambda o: o.x.reshape(("a",), (5,)),
     fu.InvalidShape, "reshape", "(5,)"),
    ("reshape negative", lambda o: o.x.reshape(("a", "b"), (-2, -3)),
     fu.InvalidShape, "reshape", "dims"),
    ("reshape float dim", lambda o: o.x.reshape(("a",), (6.0,)),
     fu.InvalidShape, "reshape", "dims"),
    ("reshape tags vs rank", lambda o: o.x.reshape(("a", "b"), (6,)),
     fu.TagError, "reshape", "tags"),
    ("permute duplicate", lambda o: o.x.permute(("r", "r")), fu.TagError, "permute", "duplicate"),
    ("permute unknown", lambda o: o.x.permute(("r", "zz")), fu.TagError, "permute", "'zz'"),
    ("split_axis sizes", lambda o: o.x.split_axis("c", ("p", "q"), (2, 2)),
     fu.InvalidShape, "split_axis", "sizes"),
    ("merge_axes not adjacent", lambda o: o.t(np.ones((2, 3, 4), F), ("a", "b", "c")).merge_axes(("a", "c"), "ac"),
     fu.TagError, "merge_axes", "adjacent"),
    # ---- selection and assembly
    ("narrow past end", lambda o: o.x.narrow("c", 2, 2), fu.InvalidShape, "narrow", "axis 'c'"),
    ("narrow negative start", lambda o: o.x.narrow("c", -1, 1),
     fu.InvalidShape, "narrow", "axis 'c'"),
    ("narrow negative length", lambda o: o.x.narrow("c", 0, -1),
     fu.InvalidShape, "narrow", "length"),
    ("narrow huge length", lambda o: o.x.narrow("c", 0, 10 ** 20),
     fu.InvalidShape, "narrow", "axis 'c'"),
    ("narrow float start", lambda o: o.x.narrow("c", 0.5, 1),
     fu.InvalidArgumentType, "narrow", "start"),
    ("narrow unknown tag", lambda o: o.x.narrow("zz", 0, 1), fu.TagError, "narrow", "'zz'"),
    ("select out of range", lambda o: o.x.select("r", 2), fu.IndexOutOfBounds, "select", "index 2"),
    ("select negative out of range", lambda o: o.x.select("r", -3),
     fu.IndexOutOfBounds, "select", "index -3"),
    ("slice step 0", lambda o: o.x.slice(c=slice(0, 2, 0)), fu.InvalidShape, "slice", "step"),
    ("slice negative step", lambda o: o.x.slice(c=slice(None, None, -1)),
     fu.InvalidShape, "slice", "step"),
    ("slice no range", lambda o: o.x.slice(), fu.InvalidArgumentType, "slice", "SliceRange"),
    ("slice unknown tag", lambda o: o.x.slice(zz=slice(0, 1)), fu.TagError, "slice", "'zz'"),
    ("gather index past end", lambda o: o.x.gather("r", o.t([0, 2], ("s",), "i64"), "s"),
     fu.IndexOutOfBounds, "gather", "index 2"),
    ("gather negative index", lambda o: o.x.gather("r", o.t([-1], ("s",), "i64"), "s"),
     fu.IndexOutOfBounds, "gather", "index -1"),
    ("gather f32 indices", lambda o: o.x.gather("r", o.t([0.0], ("s",)), "s"),
     fu.DTypeError, "gather", "indices"),
    ("gather rank-2 indices", lambda o: o.x.gather("r", o.t([[0]], ("s", "t"), "i64"), "s"),
     fu.InvalidShape, "gather", "indices"),
    ("gather out tag clash", lambda o: o.x.gather("r", o.i, "c"), fu.TagError, "gather", "'c'"),
    ("index_select out of range", lambda o: o.x.index_select("c", o.t([3], ("s",), "i64"), "s"),
     fu.IndexOutOfBounds, "index_select", "index 3"),
    ("concat unknown tag", lambda o: fu.concat("zz", o.x, o.x), fu.TagError, "concat", "'zz'"),
    ("concat other axis size", lambda o: fu.concat("r", o.x, o.t(np.ones((2, 4), F), ("r", "c"))),
     fu.ShapeMismatch, "concat", "'c'"),
    ("concat dtypes", lambda o: fu.concat("r", o.x, o.h), fu.DTypeError, "concat", "f16"),
    ("concat tags", lambda o: fu.concat("r", o.x, o.t(np.ones((2, 3), F), ("r", "d"))),
     fu.TagError, "concat", "tags"),
    ("concat nothing", lambda o: fu.concat("r"), fu.InvalidArgumentType, "concat", "tensor"),
    ("concat float operand", lambda o: fu.concat("r", o.x, 3.0),
     fu.InvalidArgumentType, "concat", "Tensor operands"),
    ("stack index", lambda o: fu.stack("n", 5, o.x, o.x),
     fu.IndexOutOfBounds, "stack", "axis_index"),
    ("stack tag exists", lambda o: fu.stack("r", 0, o.x, o.x), fu.TagError, "stack", "'r'"),
    ("pad negative", lambda o: o.x.pad("c", -1, 0, 0.0), fu.InvalidShape, "pad", "before"),
    ("pad float fill of i64", lambda o: o.t([1], ("a",), "i64").pad("a", 1, 0, 0.5),
     fu.InvalidArgumentType, "pad", "fill"),
    ("repeat_axis 0", lambda o: o.x.repeat_axis("r", 0), fu.InvalidShape, "repeat_axis", "copies"),
    # ---- norms
    ("layer_norm weight without bias", lambda o: o.x.layer_norm("c", 1e-5, weight=o.t(np.ones(3, F), ("c",))),
     fu.InvalidArgumentType, "layer_norm", "weight and bias"),
    ("layer_norm weight length", lambda o: o.x.layer_norm("c", 1e-5, weight=o.t(np.ones(4, F), ("c",)), bias=o.t(np.ones(4, F), ("c",))),
     fu.ShapeMismatch, "layer_norm", "weight"),
    ("rms_norm_mul weight length", lambda o: o.x.rms_norm_mul("c", o.t(np.ones(4, F), ("c",)), 1e-6),
     fu.ShapeMismatch, "rms_norm_mul", "weight"),
    ("rms_norm eps str", lambda o: o.x.rms_norm("c", "a"),
     fu.InvalidArgumentType, "rms_norm", "real number"),
    ("rms_norm f16", lambda o: o.h.rms_norm("c", 1e-6), fu.DTypeError, "rms_norm", "f16"),
    ("rms_norm unknown tag", lambda o: o.x.rms_norm("zz", 1e-6), fu.TagError, "rms_norm", "'zz'"),
    ("group_norm uneven groups", lambda o: o.x.group_norm("c", 2, 1e-5),
     fu.InvalidShape, "group_norm", "groups"),
    ("group_norm 0 groups", lambda o: o.x.group_norm("c", 0, 1e-5),
     fu.InvalidShape, "group_norm", "groups"),
    # ---- losses
    ("cross_entropy label past end", lambda o: o.x.cross_entropy("c", [0, 3]),
     fu.IndexOutOfBounds, "cross_entropy", "label 3"),
    ("cross_entropy negative label", lambda o: o.x.cross_entropy("c", [0, -1]),
     fu.IndexOutOfBounds, "cross_entropy", "label -1"),
    ("cross_entropy label count", lambda o: o.x.cross_entropy("c", [0]),
     fu.InvalidDataLength, "cross_entropy", "labels"),
    ("cross_entropy float labels", lambda o: o.x.cross_entropy("c", [0.5, 1.0]),
     fu.InvalidArgumentType, "cross_entropy", "labels"),
    ("cross_entropy reduction", lambda o: o.x.cross_entropy_ext("c", [0, 1], reduction="avg"),
     fu.InvalidArgument, "cross_entropy", "reduction"),
    ("cross_entropy smoothing 1.5", lambda o: o.x.cross_entropy_ext("c", [0, 1], label_smoothing=1.5),
     fu.InvalidShape, "cross_entropy", "label_smoothing"),
    ("cross_entropy smoothing nan", lambda o: o.x.cross_entropy_ext("c", [0, 1], label_smoothing=float("nan")),
     fu.InvalidShape, "cross_entropy", "label_smoothing"),
    ("cross_entropy ignore_index float", lambda o: o.x.cross_entropy_ext("c", [0, 1], ignore_index=1.5),
     fu.InvalidArgumentType, "cross_entropy", "ignore_index"),
    ("cross_entropy unknown tag", lambda o: o.x.cross_entropy("zz", [0, 1]),
     fu.TagError, "cross_entropy", "'zz'"),
    ("mse_loss shape", lambda o: o.x.mse_loss(o.t(np.ones((2, 4), F), ("r", "c"))),
     fu.ShapeMismatch, "mse_loss", "'c'"),
    ("mse_loss reduction", lambda o: o.x.mse_loss(o.x, reduction="x"),
     fu.InvalidArgument, "mse_loss", "reduction"),
    ("huber_loss delta 0", lambda o: o.x.huber_loss(o.x, delta=0.0),
     InvalidHuberDelta, "huber_loss", "delta"),
    ("huber_loss delta inf", lambda o: o.x.huber_loss(o.x, delta=float("inf")),
     InvalidHuberDelta, "huber_loss", "delta"),
    ("nll_loss label", lambda o: o.x.nll_loss("c", [5, 0]),
     fu.IndexOutOfBounds, "nll_loss", "label 5"),
    # ---- autograd, lifetime, contexts
    ("backward of non-scalar", lambda o: o.v.scale(2.0).backward(),
     fu.MissingOutputGradient, "backward", "scalar"),
    ("backward without graph", lambda o: o.x.sum_all().backward(),
     fu.NoGradientGraph, "backward", "gradient graph"),
    ("backward grad tags", lambda o: o.v.scale(2.0).backward(grad=o.t(np.ones(3, F), ("c",))),
     fu.ShapeMismatch, "backward", "grad"),
    ("backward twice", _backward_twice, fu.BackwardAlreadyRun, "backward", "sum_all"),
    ("use after release", _released, fu.UseAfterRelease, "relu", "released"),
    ("scope borrow after exit", _scope_borrow, fu.UseAfterRelease, "numpy", "exec scope"),
    ("closed: op", _closed(lambda c, x: x.relu()), fu.ContextClosed, "relu", "ExecContext"),
    ("closed: constructor", _closed(lambda c, x: c.zeros((2,), ("a",))),
     fu.ContextClosed, "full", "ExecContext"),
    ("closed: tensor", _closed(lambda c, x: c.tensor([1.0], ("a",))),
     fu.ContextClosed, "tensor", "ExecContext"),
    ("closed: numpy", _closed(lambda c, x: x.numpy()), fu.ContextClosed, "numpy", "ExecContext"),
    ("closed: dot", _closed(lambda c, x: x.dot(x, "c")), fu.ContextClosed, "dot", "ExecContext"),
    ("closed: sum", _closed(lambda c, x: x.sum("c")), fu.ContextClosed, "sum", "ExecContext"),
    ("mixed: add", _mixed(lambda a, b: a + b), fu.ContextMismatch, "add", "ExecContexts"),
    ("mixed: dot", _mixed(lambda a, b: a.dot(b, "c")), fu.ContextMismatch, "dot", "ExecContexts"),
    ("mixed: concat", _mixed(lambda a, b: fu.concat("r", a, b)),
     fu.ContextMismatch, "concat", "ExecContexts"),
    ("mixed: where", _mixed(lambda a, b: a.where(b.compare("lt", 0.0), a)),
     fu.ContextMismatch, "where", "ExecContexts"),
    ("mixed: softmax mask", _mixed(lambda a, b: a.softmax("c", mask=b)),
     fu.ContextMismatch, "softmax", "ExecContexts"),
    ("mixed: mse_loss", _mixed(lambda a, b: a.mse_loss(b)),
     fu.ContextMismatch, "mse_loss", "ExecContexts"),
    ("checkpoint block returns float", lambda o: fu.checkpoint(lambda x: 3.0, o.v),
     fu.InvalidArgumentType, "checkpoint", "Tensor"),
    ("gradcheck eps negative", lambda o: fu.gradcheck(lambda v: v.sum_all(), [o.v], eps=-1.0),
     fu.InvalidGradcheckOptions, "gradcheck", "eps"),
    ("gradcheck no variable", lambda o: fu.gradcheck(lambda v: v.sum_all(), [o.x]),
     fu.NoVariableInputs, "gradcheck", "variable"),
]


@pytest.mark.parametrize("case,err,op,names", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(mctx, case, err, op, names):
    with pytest.raises(fu.FucinaError) as e:
        case(T(mctx))
    assert e.type is err, (e.type, e.value)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{op}: "), msg
    assert names in msg, (names, msg)


def test_argument_errors_stay_python_errors():
    """Callers catching TypeError / ValueError keep working."""
    assert issubclass(fu.InvalidArgumentType, TypeError) and issubclass(fu.InvalidArgument, ValueError)


def test_case_count():
    assert len(CASES) >= 150 and len({c[0] for c in CASES}) == len(CASES)
    assert all(re.fullmatch(r"[\w .:>+-]+", c[0]) for c in CASES)
