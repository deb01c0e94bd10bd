"""Shape ops with their backward rules: the permute view, materialization (contiguous) and
reshape with its named forms split_axis / merge_axes. narrow, select and slice live with the
indexing family (ag/gather_scatter.py)."""
from __future__ import annotations

import numbers

from .. import axes
from ..errors import InvalidShape
from ..exec import elementwise as ew
from ..exec.raw import contiguous_strides, numel
from .elementwise import view


def _reshaped(a, shape):
    """a's elements in row-major order at `shape`: a view when a is contiguous, else a copy."""
    src = a if a.is_contiguous() else ew.materialize(a.ctx, a)
    return src.view(shape, contiguous_strides(shape), src.offset)


class ShapeMethods:
    """Tensor methods of the shape family."""

    __slots__ = ()

    def permute(self, tags):
        """A view with the axes reordered to `tags` (shares storage)."""
        a = self._live("permute")
        tags = axes.check_tags(tags, a.rank, "permute")
        if set(tags) != set(self.tags):
            raise axes.TagError(f"permute: expected a reordering of {self.tags}, got {tags}")
        perm = [self.tags.index(t) for t in tags]
        inv = [tags.index(t) for t in self.tags]
        return self._result(*view("permute", self, a.permute(perm), tags,
                                         lambda g: g.permute(inv)))

    def contiguous(self):
        a = self._live("contiguous")
        return self._result(*view("contiguous", self, ew.materialize(a.ctx, a), self.tags,
                                         lambda g: g))

    def reshape(self, tags, shape):
        """The same elements in row-major order under new `tags` and `shape` (a view of a
        contiguous tensor, else a copy); the gradient is reshaped back."""
        op = "reshape"
        a = self._live(op)
        tags = axes.check_tags(tags, len(tuple(shape)), op)
        shape = tuple(shape)
        if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in shape):
            raise InvalidShape(f"{op}: expected non-negative integer dims, got {shape}")
        shape = tuple(int(d) for d in shape)
        if numel(shape) != a.numel:
            raise InvalidShape(f"{op}: shape {shape} holds {numel(shape)} elements; expected "
                               f"{a.numel} (shape {a.shape})")
        back = a.shape
        return self._result(*view(op, self, _reshaped(a, shape), tags,
                                  lambda g: _reshaped(g, back)))

    def split_axis(self, tag: str, new_tags, sizes):
        """Split axis `tag` into consecutive axes `new_tags` of `sizes` (row-major), e.g.
        ("seq", "hd") -> ("seq", "head", "d")."""
        op = "split_axis"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        new_tags, sizes = tuple(new_tags), tuple(sizes)
        if len(new_tags) != len(sizes) or not sizes:
            raise InvalidShape(f"{op}: expected one size per new tag, got {new_tags} and {sizes}")
        if numel(sizes) != a.shape[ax]:
            raise InvalidShape(f"{op}: sizes {sizes} hold {numel(sizes)} elements; expected "
                               f"{a.shape[ax]} (dim of {tag!r})")
        tags = self.tags[:ax] + new_tags + self.tags[ax + 1:]
        return self.reshape(tags, a.shape[:ax] + sizes + a.shape[ax + 1:])

    def merge_axes(self, tags, new_tag: str):
        """Merge the adjacent axes `tags` (in this tensor's order) into one axis `new_tag`."""
        op = "merge_axes"
        a = self._live(op)
        tags = tuple(tags)
        first = axes.axis_of(self.tags, tags[0], op) if tags else 0
        if not tags or self.tags[first:first + len(tags)] != tags:
            raise axes.TagError(f"{op}: expected adjacent axes of {self.tags} in order, got {tags}")
        merged = numel(a.shape[first:first + len(tags)])
        out_tags = self.tags[:first] + (new_tag,) + self.tags[first + len(tags):]
        return self.reshape(out_tags, a.shape[:first] + (merged,) + a.shape[first + len(tags):])
