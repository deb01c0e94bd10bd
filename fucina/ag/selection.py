"""Selection (SPEC §3.15): argmax, top_k, sort/argsort, router_top_k."""

__all__: list[str] = []


class SelectionMethods:
    __slots__ = ()
