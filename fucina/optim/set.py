"""OptimizerSet (SPEC T-10): several optimizers (param groups, mixed types allowed) behind one
step / zero_grad / clip_grad_norm / save_state / load_state, with the cross-member duplicate
check the members cannot do alone (O-3). Frame: FZO3 | u32 member count | member frames."""
from __future__ import annotations

import struct

from ..errors import CheckpointMagicMismatch, CheckpointShapeMismatch
from .clip import clip, scale_grads
from .frames import Reader, read_checked, write_checked

MAGIC = b"FZO3"


class OptimizerSet:
    """`fu.optim.OptimizerSet([decay, no_decay])`; members are borrowed (the caller closes
    them). Clipping is global over every member, like clip_grad_norm_(model.parameters())."""

    def __init__(self, members=()):
        self.members: list = []
        self._leaves: set = set()
        for opt in members:
            self.add(opt)

    def add(self, opt) -> None:
        """Add a member; DuplicateParam (the set unchanged) if it holds a param a previous
        member already holds."""
        seen = set(self._leaves)
        opt.collect_grad_states(seen)
        self._leaves = seen
        self.members.append(opt)

    def step(self) -> None:
        for opt in self.members:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.members:
            opt.zero_grad()

    def _grads(self, op: str) -> list:
        out = []
        for opt in self.members:
            opt._live(op)
            out += opt.grads(op)
        return out

    def grad_squared_norm(self) -> float:
        """The sum of the members' grad_squared_norm, in member order (f64)."""
        total = 0.0
        for opt in self.members:
            total += opt.grad_squared_norm()
        return total

    def scale_gradients(self, factor: float) -> None:
        scale_grads(self._grads("scale_gradients"), factor)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global-norm clip over all members (T-11); returns the pre-clip norm."""
        return clip(self._grads("clip_grad_norm"), self.grad_squared_norm(), max_norm)

    def save_state(self, f, checksum: bool = True) -> None:
        """FZO3 and the member frames, inside one CRC32 envelope unless checksum=False."""
        for opt in self.members:
            opt._live("save_state")
        if checksum:
            write_checked(f, self._write_body)
        else:
            self._write_body(f)

    def _write_body(self, f) -> None:
        f.write(MAGIC)
        f.write(struct.pack("<I", len(self.members)))
        for opt in self.members:
            opt.write_frame(f)

    def load_state(self, f) -> None:
        """Every member's frame (and the envelope's CRC32) is read and validated before any
        member changes."""
        for opt in self.members:
            opt._live("load_state")
        staged = read_checked(f, "OptimizerSet.load_state", self._stage_body)
        for opt, s in zip(self.members, staged):
            opt.commit_frame(s)

    def _stage_body(self, r: Reader) -> list:
        got = r.take(4, "the magic")
        if got != MAGIC:
            raise CheckpointMagicMismatch(f"{r.op}: expected magic FZO3, got {got!r}")
        n = r.scalar("u32", "the member count")
        if n != len(self.members):
            raise CheckpointShapeMismatch(f"{r.op}: expected {len(self.members)} member frames, "
                                          f"the file has {n}")
        return [opt.stage_frame(Reader(r.f, f"OptimizerSet.load_state (member {i}, "
                                            f"{type(opt).__name__})"))
                for i, opt in enumerate(self.members)]
