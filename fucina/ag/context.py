"""The public ExecContext: the exec-layer context plus constructors that return Tensors."""
from __future__ import annotations

import numpy as np

from .. import axes
from ..exec import Context
from ..exec.dtypes import check as check_dtype
from .tensor import Tensor


class ExecContext(Context):
    """`fu.ExecContext(threads=None)`: owns a buffer pool and a lazily started thread team.

    Tensors use the context that created them; after close() every use raises ContextClosed.
    """

    def tensor(self, data, tags, dtype: str = "f32") -> Tensor:
        """A constant from array-like data; len(tags) must equal the data's rank."""
        self.check_open("tensor")
        check_dtype(dtype, "tensor")
        arr = np.asarray(data)
        tags = axes.check_tags(tags, arr.ndim, "tensor")
        return Tensor(self.from_numpy(arr, None, dtype, "tensor"), tags)

    def from_slice(self, tags, shape, values, dtype: str = "f32") -> Tensor:
        self.check_open("from_slice")
        shape = tuple(shape)
        tags = axes.check_tags(tags, len(shape), "from_slice")
        return Tensor(self.from_numpy(np.asarray(values).reshape(-1), shape, dtype, "from_slice"), tags)

    def full(self, shape, value, tags, dtype: str = "f32") -> Tensor:
        self.check_open("full")
        shape = tuple(shape)
        tags = axes.check_tags(tags, len(shape), "full")
        check_dtype(dtype, "full")
        raw = self.empty(shape, dtype)
        from ..exec import elementwise as ew

        # fill through the generated copy kernel from a broadcast scalar
        one = self.from_numpy(np.asarray([value]), (1,) * len(shape) if shape else (), dtype, "full")
        ew.run(self, "copy", dtype, shape, (one.view(shape, (0,) * len(shape)),), out=raw)
        return Tensor(raw, tags)

    def zeros(self, shape, tags, dtype: str = "f32") -> Tensor:
        return self.full(shape, 0, tags, dtype)

    def ones(self, shape, tags, dtype: str = "f32") -> Tensor:
        return self.full(shape, 1, tags, dtype)

    def scalar(self, value, dtype: str = "f32") -> Tensor:
        return self.tensor(value, (), dtype)

    def classify(self, t):
        """SPEC R-4 layout class of a tensor (or RawTensor)."""
        raw = t._live("classify") if isinstance(t, Tensor) else t
        return raw.layout_class()
