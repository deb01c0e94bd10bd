"""Replayed training steps: a LoRA step on samples of one length launches the same kernels with
the same arguments every time (only the tokens and the labels differ), so its Python (the
graph, the plans, the dispatch: 40-80 ms of a SmolLM2 step, while a second thread waits) need
not run again.

`Trainer.loss_backward` (one sample: the loss, then backward) keeps one replay at a time:

1. A step whose key (length, which labels are ignored, reduction, loss scale, checkpointing,
   the parameters' and weights' addresses) equals the previous two steps' is captured: it runs
   eagerly from a pool of its own with its launches and uploads noted (exec.plan.capture).
   The tokens and labels are two of those uploads, found by their bytes.
2. The next step of that key runs eagerly once more, in the capture's memory, and then as a
   replay fed its tokens and labels; the replay is kept only if its loss and every gradient are
   bitwise the eager run's (and the eager run left nothing behind in that memory).
3. From then on each step of that key is the replay: the uploads fed, the launches run from C,
   each adapter's gradient the replay's buffer.

Not replayed (eager, same results): dropout (a seed per step), grad mode off, gradients already
present (micro-batch accumulation), a gradient someone else holds a view of (a replay would
write into it), or a key not yet seen three times in a row. A new key drops the old replay and
its memory.
"""
from __future__ import annotations

import struct
import sys

import numpy as np

from ...ag import engine
from ...ag.loss import check_loss_scale, encode_labels
from ...exec import plan

OP = "decoder.Trainer.loss_backward"
CAPTURE_AFTER = 2   # a key is captured on its third step in a row: samples whose lengths only
                    # pair up now and then never pay for a capture they would not use


class _Step:
    """A captured step: the replay, the leaves it writes the gradients of (in backward's
    order, with their gradient buffers), the loss buffer and the indexes of the two uploads
    fed per step."""

    def __init__(self, key, fixed, leaves, grads, loss, feeds):
        self.key, self.fixed, self.leaves, self.grads, self.loss = key, fixed, leaves, grads, loss
        self.feeds = feeds
        self.trusted = False
        self.refs = None     # _refs as captured (then as trusted)


class Replays:
    """A Trainer's replay state (see the module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.enabled = True
        self.last_key = None
        self.repeats = 0         # steps in a row with last_key before this one
        self.step: _Step | None = None
        self.rejected = None     # a key whose capture or check failed: not tried again
        self.runs = 0            # steps run as replays (the check's included)

    def drop(self) -> None:
        if self.step is not None:
            self.step.fixed.release()
            self.step = None

    # ---- the step ----
    def loss_backward(self, tokens, labels, reduction: str, loss_scale: float) -> float:
        tr = self.trainer
        check_loss_scale(OP, loss_scale)                  # bad input raises here, the replay kept
        s = tr._sample(OP, tokens, labels, reduction)
        key = self._key(s, reduction, loss_scale) if self.enabled else None
        if key is None:
            self.last_key = None
            return self._eager(s, reduction, loss_scale)
        st = self.step
        if st is not None and st.key != key:
            self.drop()
            st = None
        if st is None:
            self.repeats = self.repeats + 1 if key == self.last_key else 0
            self.last_key = key
            if self.repeats < CAPTURE_AFTER or key == self.rejected or _accumulating(tr):
                return self._eager(s, reduction, loss_scale)
            return self._capture(key, s, reduction, loss_scale)
        if not self._free(st):
            return self._eager(s, reduction, loss_scale)
        if not st.trusted:
            return self._check(st, s, reduction, loss_scale)
        value = self._replay(st, s)
        tr.step_counter += 1
        return value

    def _key(self, s, reduction, loss_scale):
        """What a replay of the sample's step must match; None when not replayable."""
        tr = self.trainer
        if tr.lora_config.dropout_p != 0 or not engine.is_grad_enabled():
            return None
        return (len(s.ids), s.mask, reduction, struct.pack("<d", float(loss_scale)),
                tr.checkpoint_layers, _addresses(tr))

    def _eager(self, s, reduction, loss_scale) -> float:
        ctx = self.trainer.model.ctx
        with ctx.exec_scope():
            loss = self.trainer._sample_loss(s, reduction, loss_scale)
            loss.backward()
            return loss.item()

    def _capture(self, key, s, reduction, loss_scale) -> float:
        ctx = self.trainer.model.ctx
        ctx.pool.trim()          # the capture's pool holds the step's memory from now on
        with plan.capture(ctx) as cap:
            with ctx.exec_scope():
                loss = self.trainer._sample_loss(s, reduction, loss_scale)
                leaves = engine.leaves(loss._node)
                fresh = all(n.grad is None for n in leaves)
                loss.backward()
                value = loss.item()
                loss_raw = loss._live(OP)
        fixed = plan.Fixed(cap)
        feeds = (fixed.upload_index(s.ids), fixed.upload_index(self._encoded(s)))
        if fresh and None not in feeds and feeds[0] != feeds[1]:
            st = self.step = _Step(key, fixed, leaves, [n.grad for n in leaves], loss_raw, feeds)
            st.refs = _refs(st)
        else:
            fixed.release()
            self.rejected = key
        return value

    def _check(self, st, s, reduction, loss_scale) -> float:
        """The step run eagerly in the capture's memory, then replayed: kept when the two agree
        bit for bit and the eager run left no buffer behind in that memory."""
        tr = self.trainer
        ctx = tr.model.ctx
        pool = st.fixed.cap.pool
        before = pool.stats()
        main, ctx.pool = ctx.pool, pool
        try:
            value = self._eager(s, reduction, loss_scale)
            want = [None if n.grad is None else n.grad.to_numpy() for n in st.leaves]
        finally:
            ctx.pool = main
        for n in st.leaves:
            n.grad = None
        after = pool.stats()
        kept = (after["outstanding"] == before["outstanding"]
                and after["cached_bytes"] >= before["cached_bytes"])
        if kept:
            got = self._replay(st, s)
            kept = (struct.pack("<d", got) == struct.pack("<d", value)
                    and all((w is None) == (n.grad is None)
                            and (w is None or np.array_equal(w.view(np.uint32),
                                                             n.grad.to_numpy().view(np.uint32)))
                            for w, n in zip(want, st.leaves)))
        if kept:
            st.trusted = True
            st.refs = _refs(st)
            return value
        for n in st.leaves:
            n.grad = None
        self.drop()
        self.rejected = st.key
        tr.step_counter -= 1     # the eager run counted; this one counts again
        return self._eager(s, reduction, loss_scale)

    def _free(self, st) -> bool:
        """Every gradient of the step is absent and no one holds its replay buffer but the
        step (as many references as when it was captured, the leaves' not counted)."""
        if any(n.grad is not None for n in st.leaves):
            return False
        return _refs(st) == st.refs

    def _encoded(self, s):
        """The sample's labels as the loss uploads them (the replay's second feed)."""
        return encode_labels(s.labels, s.ignored, self.trainer.model.config.vocab)

    def _replay(self, st, s) -> float:
        ctx = self.trainer.model.ctx
        st.fixed.feed(st.feeds[0], s.ids)
        st.fixed.feed(st.feeds[1], self._encoded(s))
        st.fixed.run(ctx)
        self.runs += 1
        for n, g in zip(st.leaves, st.grads):
            n.grad = g
        return st.loss.to_numpy().reshape(()).item()


def _accumulating(tr) -> bool:
    """An adapter has a gradient already: this step adds to it (not what a capture records)."""
    return any(t._node.grad is not None for layer in tr.adapters for ad in layer.values()
               for t in ad._weights(OP))


def _refs(st) -> list:
    """The reference counts of each gradient buffer and its tensor, the leaves' own (when
    attached) not counted."""
    out = []
    for i in range(len(st.grads)):
        g = st.grads[i]
        if g is not None:
            own = st.leaves[i].grad is g
            out.append((sys.getrefcount(g) - own, sys.getrefcount(g.buf)))
    return out


def _addresses(tr) -> tuple:
    """Where every adapter matrix and every frozen weight lives: a replay's launches use them
    there."""
    out = []
    for layer in tr.adapters:
        for ad in layer.values():
            out += [t._raw.addr for t in ad._weights(OP)]
    m = tr.model
    for t in (m.token_embd, m.output_norm, m.output):
        out.append(_addr(t))
    for w in m.layers:
        for v in vars(w).values():
            if isinstance(v, dict):
                out += [_addr(t) for t in v.values()]
            else:
                out.append(_addr(v))
    return tuple(out)


def _addr(t):
    raw = getattr(t, "_raw", None)
    return None if raw is None else raw.addr
