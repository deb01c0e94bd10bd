"""Benchmarks (DESIGN.md §7): one module per op family, each with `rows(quick) -> list[dict]`,
and `python -m benchmarks.run` to collect them into BENCHMARKS.md. Never timed tests."""
