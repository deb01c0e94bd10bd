"""Shape ops with their backward rules: the permute view and materialization (contiguous).
narrow, select and slice live with the indexing family (ag/gather_scatter.py)."""
from __future__ import annotations

from .. import axes
from ..exec import elementwise as ew
from .elementwise import view


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
