"""Shape ops with their backward rules: views that share storage (narrow, permute) and
materialization (contiguous)."""
from __future__ import annotations

from .. import axes
from ..exec import elementwise as ew
from .elementwise import view


class ShapeMethods:
    """Tensor methods of the shape family."""

    __slots__ = ()

    def narrow(self, tag: str, start: int, length: int):
        """A view of `length` entries of axis `tag` from `start` (shares storage)."""
        a = self._live("narrow")
        ax = axes.axis_of(self.tags, tag, "narrow")
        v = a.narrow(ax, start, length)

        def grad_of(g):  # zeros with g written into the narrowed window
            full = a.ctx.full_raw(a.shape, 0.0, "f32")
            ew.run(a.ctx, "copy", "f32", v.shape, (g,), out=full.narrow(ax, start, length))
            return full
        return self._result(*view("narrow", self, v, self.tags, grad_of))

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
