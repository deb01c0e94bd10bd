"""Ternary-genome ES launches at the exec layer (SPEC T-27).

Callers (fucina.es_ternary) validated everything: genomes are TQ2_0 BlockRaws, flip buffers
hold the right number of entries. The flip generator runs on a chunk grid fixed by the flip
count; the order-dependent kernels (apply, restore, vote) are one chunk each. Either way the
result does not depend on the thread count.
"""
from __future__ import annotations

import numpy as np

from ..codegen.es_ternary import (BLOCK_ELEMS, DIGIT, EsTernaryApplyKey, EsTernaryCheckKey,
                                  EsTernaryFlipsKey, EsTernaryVoteKey)
from ..codegen.es import EsCopyKey
from .es import COPY_CHUNK, NOISE_COST, kernel

FLIP_CHUNK = 1 << 12    # flips per chunk of the flip generator
CHECK_CHUNK = 1 << 12   # blocks per chunk of the code check
MIN_TABLE = 16          # smallest vote hash table


def _chunks(n: int, per: int) -> int:
    return -(-n // per)


def flips(ctx, coeffs: int, idx, val, streams: int, count: int, length: int, root: int,
          base: int, stride: int, domain: int, slot: int) -> None:
    """The flip lists of `streams` streams of slot `slot` (count flips each) into idx (i64) and
    val (f32): stream s has member seed at(root, base + stride·s) and stream seed
    at(member_seed ^ domain, slot); val = coeffs[s]·(±1). coeffs: the address of `streams` f32."""
    per = _chunks(count, FLIP_CHUNK)
    ctx.launch(kernel(EsTernaryFlipsKey()), streams * per, streams * count * NOISE_COST, coeffs,
               idx.addr, val.addr, root, base, stride, domain, slot, count, length, FLIP_CHUNK, per)


def apply(ctx, op: str, blocks: int, idx, val, undo, count: int) -> None:
    """perturb | flip | restore over the first `count` flips (blocks: the genome's address)."""
    ctx.launch(kernel(EsTernaryApplyKey(op)), 1, count, blocks, idx.addr,
               0 if val is None else val.addr, 0 if undo is None else undo.addr, count)


def vote_scratch(ctx, count: int) -> tuple:
    """The vote kernel's buffers for `count` flips: hash keys and sums (a power of two at
    least twice the flips), the digit histogram."""
    cap = max(MIN_TABLE, 1 << (2 * count - 1).bit_length())
    return ctx.empty((cap,), "i64"), ctx.empty((cap,), "f32"), ctx.empty((1 << DIGIT,), "i64")


def vote(ctx, blocks: int, idx, val, count: int, kcap: int, length: int, scratch) -> tuple:
    """The vote-and-threshold update of one genome (at address `blocks`, `length` elements)
    from `count` flips, at most kcap moves; idx/val are overwritten by the compacted votes.
    scratch: vote_scratch(ctx, count). Returns (nonzero votes, moves applied)."""
    keys, vals, hist = scratch
    cap = keys.numel
    out = np.zeros(2, np.int64)
    ctx.launch(kernel(EsTernaryVoteKey()), 1, count, blocks, idx.addr, val.addr, keys.addr,
               vals.addr, hist.addr, out.ctypes.data, count, cap, 64 - (cap.bit_length() - 1),
               kcap, max(1, (length - 1).bit_length()))
    return int(out[0]), int(out[1])


def copy(ctx, src: int, dst: int, nbytes: int) -> None:
    """nbytes from address src to address dst (a genome into a replica)."""
    ctx.launch(kernel(EsCopyKey()), _chunks(nbytes, COPY_CHUNK), 2 * nbytes, src, dst, nbytes,
               COPY_CHUNK)


def invalid_element(ctx, genome) -> int | None:
    """The first logical element of `genome` (a TQ2_0 BlockRaw) holding crumb code 3, or None."""
    n = genome.numel // BLOCK_ELEMS
    chunks = _chunks(n, CHECK_CHUNK)
    flags = np.zeros(chunks, np.uint8)
    ctx.launch(kernel(EsTernaryCheckKey()), chunks, genome.lay.nbytes, genome.addr,
               flags.ctypes.data, n, CHECK_CHUNK)
    if not flags.any():
        return None
    first = int(np.nonzero(flags)[0][0]) * CHECK_CHUNK
    qs = genome.storage_view().reshape(-1, 66)[first:first + CHECK_CHUNK, :64]
    lanes = np.stack([(qs >> (2 * lane)) & 3 for lane in range(4)], axis=-1)   # [block, byte, lane]
    blk, byte, lane = np.nonzero(lanes == 3)
    return int(((first + blk) * BLOCK_ELEMS + (byte >> 5) * 128 + lane * 32 + (byte & 31)).min())
