"""Methods of block-quantized tensors (SPEC R-9, §3.16 get_rows)."""

__all__: list[str] = []


class QuantMethods:
    __slots__ = ()
