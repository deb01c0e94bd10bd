"""Activation checkpointing (SPEC T-14)."""

__all__: list[str] = []
