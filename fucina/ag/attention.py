"""grouped_attention (SPEC §3.12)."""

__all__: list[str] = []


class AttentionMethods:
    __slots__ = ()
