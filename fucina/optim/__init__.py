"""Optimizers, schedules and clipping (SPEC §5 T-1…T-13, T-17, T-24)."""
