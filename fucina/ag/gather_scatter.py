"""Indexing, assembly and functional updates (SPEC §3.16)."""

__all__: list[str] = []


class GatherScatterMethods:
    __slots__ = ()
