"""The public ExecContext: the exec-layer context plus constructors that return Tensors."""
from __future__ import annotations

import numbers

import numpy as np

from .. import axes
from ..errors import DTypeError, InvalidArgumentType
from ..exec import Context, validate_shape
from . import moe, rope
from .engine import Leaf
from ..exec.dtypes import check as check_dtype
from ..exec.dtypes import host_array
from .tensor import Tensor


class ExecContext(Context):
    """`fu.ExecContext(threads=None, *, cache_bytes=1 << 30)`: owns a buffer pool and a lazily
    started thread team. cache_bytes caps the released buffers the pool keeps for reuse (SPEC
    R-2); a training step whose working set is bigger (a long sequence) drops buffers past the
    cap and faults fresh memory in every step: give such a loop a bigger cap.

    Tensors use the context that created them; after close() every use raises ContextClosed.
    """

    def tensor(self, data, tags, dtype: str = "f32") -> Tensor:
        """A constant from array-like data; len(tags) must equal the data's rank."""
        self.check_open("tensor")
        check_dtype(dtype, "tensor")
        arr = host_array(data, "tensor")
        tags = axes.check_tags(tags, arr.ndim, "tensor")
        return Tensor(self.from_numpy(arr, None, dtype, "tensor"), tags)

    def variable(self, data, tags, dtype: str = "f32") -> Tensor:
        """A leaf that requires grad (f32, or f16/bf16 with f32 gradients)."""
        return _as_variable(self.tensor(data, tags, dtype), "variable")

    def variable_from_slice(self, tags, shape, values, dtype: str = "f32") -> Tensor:
        return _as_variable(self.from_slice(tags, shape, values, dtype), "variable_from_slice")

    def replace(self, old: Tensor, new):
        """`x = ctx.replace(x, lambda: x.scale(2.0))`: the new value first; only if that succeeds
        is the old one released (a no-op for scope borrows)."""
        value = new() if callable(new) else new
        if value is not old:
            old.release()
        return value

    def from_slice(self, tags, shape, values, dtype: str = "f32") -> Tensor:
        self.check_open("from_slice")
        shape = validate_shape(shape, "from_slice")
        tags = axes.check_tags(tags, len(shape), "from_slice")
        values = host_array(values, "from_slice").reshape(-1)
        return Tensor(self.from_numpy(values, shape, dtype, "from_slice"), tags)

    def full(self, shape, value, tags, dtype: str = "f32") -> Tensor:
        self.check_open("full")
        if not isinstance(value, (numbers.Real, np.bool_)):
            raise InvalidArgumentType(f"full: expected a real number or bool as value, got "
                                      f"{type(value).__name__}")
        shape = validate_shape(shape, "full")
        tags = axes.check_tags(tags, len(shape), "full")
        return Tensor(self.full_raw(shape, value, check_dtype(dtype, "full")), tags)

    def zeros(self, shape, tags, dtype: str = "f32") -> Tensor:
        return self.full(shape, 0, tags, dtype)

    def ones(self, shape, tags, dtype: str = "f32") -> Tensor:
        return self.full(shape, 1, tags, dtype)

    def scalar(self, value, dtype: str = "f32") -> Tensor:
        return self.tensor(value, (), dtype)

    def prepare_rope_table(self, positions, feature_dim, theta_base, inverse=False, freq_factors=None):
        """SPEC §3.11: the cos/sin table for `positions`, built once and reused by x.rope(...)."""
        return rope.prepare_rope_table(self, positions, feature_dim, theta_base, inverse, freq_factors)

    def prepare_rope_table_range(self, axis_range, feature_dim, theta_base, inverse=False,
                                 freq_factors=None):
        """The table for positions axis_range.origin .. origin + len (SPEC §3.11)."""
        return rope.prepare_rope_table_range(self, axis_range, feature_dim, theta_base, inverse, freq_factors)

    def prepare_rope_table_inv_freqs_f64(self, pos0, count, inv_freq, inverse=False):
        """A table for positions pos0 .. pos0 + count - 1 from f64 per-pair inverse frequencies
        (angles and sin/cos in f64, rounded once to f32); see fu.yarn_blend_inv_freqs_f64."""
        return rope.prepare_rope_table_inv_freqs_f64(self, pos0, count, inv_freq, inverse)

    def moe_expert_ffn(self, x, gate, up, down, selected, weights, out_pe, act, profile=None):
        """SPEC §3.17: the routed expert FFN of one token (fu.moe_expert_ffn)."""
        return moe.moe_expert_ffn(x, gate, up, down, selected, weights, out_pe, act, profile)

    def moe_expert_ffn_batch(self, x, gate, up, down, selected, weights, top_k, out_pe, act,
                             profile=None):
        """SPEC §3.17: the routed expert FFN of a batch of tokens (fu.moe_expert_ffn_batch)."""
        return moe.moe_expert_ffn_batch(x, gate, up, down, selected, weights, top_k, out_pe, act,
                                    profile)

    def classify(self, t):
        """SPEC R-4 layout class of a tensor (or RawTensor)."""
        raw = t._live("classify") if isinstance(t, Tensor) else t
        return raw.layout_class()


def _as_variable(t: Tensor, op: str) -> Tensor:
    if t._raw.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"{op}: expected a float dtype (f32, f16, bf16) for a variable, got {t._raw.dtype}")
    t._node = Leaf(t._raw.shape)
    return t
