"""Convolution, pooling and vision ops (SPEC §3.13)."""

__all__: list[str] = []


class ConvMethods:
    __slots__ = ()
