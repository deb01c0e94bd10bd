"""Kernel templates: the declarative layer of the codegen (DESIGN §2–3).

Each op's scalar (lane) formula is written once here, as a `Template` — its inputs' names and
a body in a small expression language over them, named constants and the vector-math
primitives — and codegen/lowering.py lowers it to the IR the generators emit, vector lanes and
scalar tail alike. The generators (codegen/elementwise.py, codegen/optim.py, ...) own the
loops, loads, stores and layouts; a template owns only the arithmetic of one element.

  arithmetic.py    float arithmetic and the binary ops' backward rules
  activations.py   the activations and their backward rules (forward, _grad, gated pairs)
  losses.py        the elementwise losses (L-4) and their derivatives
  optim.py         the optimizer update rules (SGD, Adam/AdamW, Muon, APOLLO, HF AdamW)
  typed.py         the i64 arithmetic (wrapping; the guarded divisions and remainders)
  masks.py         where, the logical ops, the compares (truthiness per lane type)

These files are part of the kernel-cache fingerprint (codegen/kernels.py), like every
codegen/*.py: editing a formula re-keys the disk cache, so no stale object is ever loaded.
"""
