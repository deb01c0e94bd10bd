"""Evolution-strategies benchmarks (SPEC T-25, D-2).

    python -m benchmarks.bench_es [--quick]

* Noise regeneration, in values per second (the comparator column holds numpy):
  - materialize: one member of a 4 Mi-element f32 slot written into a replica (RNG-7 noise,
    scaled, added to θ, stored) against numpy's normal generator filling a preallocated 4 Mi
    float32 buffer (`Generator.standard_normal(out=..., dtype=float32)`, PCG64 + ziggurat, one
    thread at any thread count: it only generates, it does not add);
  - update: the ES update of a 256 Ki-element slot from 16 streams (4 Mi noise values
    regenerated and accumulated) against numpy generating the same 4 Mi values.
* One es-spirals iteration at population 128 (antithetic, 4482 parameters, 194 points):
  evaluate every member on replicas — 4 blocks of 32 stacked MLP copies, each filled by
  `materialize_members` and scored by one batched forward — then `update`. PyTorch runs the
  same loop: per block, each member's noise drawn per parameter from a `torch.Generator`
  seeded with that (member, parameter)'s stream seed (the reference ES library's reseeding
  scheme) and added into the stacked replicas, the same batched forward (baddbmm — twice as
  fast as einsum here —, tanh, cross_entropy), then the update regenerating each stream's
  noise the same way.
  At 2 threads Fucina runs both member-parallel setups of the demo: "team" (one worker whose
  kernels split on the 2-thread C team) and "threads" (2 Python-thread workers on 1-thread
  contexts, overlapping where kernels release the GIL); PyTorch uses 2 intra-op threads.
* Ternary genomes (T-27), a 4 Mi-trit tq2_0 genome: the vote-and-threshold update (32 folded
  streams, flip rate and update fraction 0.001) and one member's perturb + restore, against
  the same steps written with torch on unpacked int8 codes.
"""
from __future__ import annotations

import numpy as np

from . import common as c
from .common import row

GROUP = "es"
MiB = 1 << 20
SLOT = 4 * MiB          # materialize: elements of the slot
UPD_SLOT, UPD_STREAMS = 256 * 1024, 16


def _noise(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    from fucina import es

    ctx = fu.ExecContext(threads=threads)
    gen = np.random.default_rng(3)
    try:
        theta = ctx.tensor(gen.standard_normal(SLOT).astype(np.float32), ("n",))
        replica = ctx.zeros((SLOT,), ("n",))
        tr = es.Trainer(sigma=0.01, population=2, seed=1)
        tr.add_param(theta)
        slot = ctx.tensor(np.zeros(UPD_SLOT, np.float32), ("n",))
        tr_up = es.Trainer(sigma=0.01, population=UPD_STREAMS, seed=2)
        tr_up.add_param(slot)
        rewards = list(gen.standard_normal(UPD_STREAMS))
        buf = np.empty(SLOT, np.float32)
        env = {"tr": tr, "replica": [replica], "tr_up": tr_up, "rewards": rewards, "gen": gen,
               "buf": buf, "np": np}
        stmts = {"materialize": "tr.materialize_member(1, replica)",
                 "update": "tr_up.update(rewards)",
                 "numpy": "gen.standard_normal(out=buf, dtype=np.float32)"}
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=3 if quick else 7, block_s=0.05 if quick else 0.15)
        env.clear()
        del theta, replica, slot, tr, tr_up
    finally:
        ctx.close()
    values = SLOT  # numpy generates SLOT values per call; the update regenerates the same count
    np_rate = values / t["numpy"].median
    out = []
    for key, what in (("materialize", "noise regeneration: materialize_member, 4 Mi f32 slot "
                                      "(RNG-7 + scale + add, replica written) vs numpy "
                                      "standard_normal 4 Mi f32"),
                      ("update", f"noise regeneration: update, {UPD_SLOT // 1024} Ki f32 slot x "
                                 f"{UPD_STREAMS} streams (4 Mi values regenerated + accumulated) "
                                 f"vs numpy standard_normal 4 Mi f32")):
        med = t[key].median
        rate = values / med
        out.append(row(GROUP, what, threads, round(rate / 1e9, 3), round(np_rate / 1e9, 3),
                       unit="Gvalues/s", ratio=rate / np_rate, target="≥ numpy",
                       met=rate >= np_rate,
                       note=f"median {c.fmt_time(med)} per call vs numpy {c.fmt_time(t['numpy'].median)} "
                            f"(numpy: one thread, PCG64 + ziggurat, generation only); "
                            f"comparator column = numpy; {load}"))
    return out


# ---------------------------------------------------------------------------------------------
# one es-spirals iteration

POP, BLOCK = 128, 32


class _TorchLoop:
    """The es-spirals iteration written with torch: same blocks, same seeds per (member,
    parameter), torch's own generator for the noise."""

    def __init__(self, xs, labels, params, trainer):
        import torch

        self.torch = torch
        self.tr = trainer  # only for the seed derivations (pure functions of seed/iteration)
        self.xg = torch.from_numpy(xs).expand(BLOCK, -1, -1)
        self.labels = torch.from_numpy(labels).repeat(BLOCK)
        self.theta = [torch.from_numpy(p.copy()) for p in params]
        self.stack = [torch.zeros((BLOCK,) + p.shape) for p in params]
        self.sigma, self.alpha = 0.1, 0.1
        self.iteration = 0
        self.gen = torch.Generator()

    def _eps(self, member_seed: int, k: int, shape):
        self.gen.manual_seed(self.tr.slot_stream_seed(member_seed, k) & ((1 << 63) - 1))
        return self.torch.randn(shape, generator=self.gen)

    def _member_seed(self, m: int) -> int:
        self.tr.iteration = self.iteration
        return self.tr.member_seed(m & ~1)

    def step(self):
        torch = self.torch
        F = torch.nn.functional
        rewards = torch.empty(POP)
        with torch.no_grad():
            for b0 in range(0, POP, BLOCK):
                for g in range(BLOCK):
                    m = b0 + g
                    ms, sign = self._member_seed(m), -1.0 if m & 1 else 1.0
                    for k, (th, st) in enumerate(zip(self.theta, self.stack)):
                        st[g] = th + (sign * self.sigma) * self._eps(ms, k, th.shape)
                w1, b1, w2, b2, w3, b3 = self.stack
                h = torch.tanh(torch.baddbmm(b1[:, None, :], self.xg, w1.transpose(1, 2)))
                h = torch.tanh(torch.baddbmm(b2[:, None, :], h, w2.transpose(1, 2)))
                z = torch.baddbmm(b3[:, None, :], h, w3.transpose(1, 2))
                ce = F.cross_entropy(z.reshape(-1, 2), self.labels, reduction="none")
                rewards[b0:b0 + BLOCK] = -ce.view(BLOCK, -1).mean(1)
            c = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-8)
            c = c[0::2] - c[1::2]
            scale = self.alpha / POP
            for k, th in enumerate(self.theta):
                acc = torch.zeros_like(th)
                for s in range(POP // 2):
                    acc += c[s] * self._eps(self._member_seed(2 * s), k, th.shape)
                th += scale * acc
        self.iteration += 1


def _spirals(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    from fucina import es
    from examples import es_spirals as demo

    torch = c.torch()
    xs, labels = demo.make_spirals(42)
    ctx = fu.ExecContext(threads=threads)
    pools, stmts = [], {}
    tr = es.Trainer(sigma=0.1, alpha=0.1, population=POP, antithetic=True, seed=42)
    try:
        model = demo.Model(ctx, xs, labels, 42)
        demo.register(model, tr)
        rewards = [0.0] * POP
        setups = {"team": (1, threads)}
        if threads > 1:
            setups["threads"] = (threads, 1)
        for name, (count, each) in setups.items():
            pool = demo.Workers(tr, xs, labels, count, each, BLOCK)
            pools.append(pool)
            stmts[name] = (lambda p=pool: (p.evaluate(rewards), tr.update(rewards)))
        if torch is not None:
            loop = _TorchLoop(xs, labels, [p.numpy() for p in model.params()], es.Trainer(
                sigma=0.1, alpha=0.1, population=POP, antithetic=True, seed=42))
            stmts["torch"] = loop.step
        t, load = c.measured(stmts, env={}, threads=threads, quick=quick,
                             repeats=3 if quick else 7, block_s=0.2 if quick else 0.6)
        del model
    finally:
        stmts.clear()
        for p in pools:
            p.close()
        tr.close()
        ctx.close()
    out = []
    for name in setups:
        how = ("one worker, kernels on the C team" if name == "team" else
               f"{threads} Python-thread workers on 1-thread contexts")
        rate = f"{1 / t[name].median:.0f} it/s" + (
            f" (torch {1 / t['torch'].median:.0f} it/s)" if "torch" in t else "")
        out.append(c.vs_torch(GROUP, f"es-spirals iteration, population 128: evaluate on replicas "
                                     f"({name}: {how}) + update", threads, t[name], t.get("torch"),
                              load, target="≤ PyTorch",
                              note=f"{rate}; blocks of {BLOCK} members, one batched forward each"))
    return out


# ---------------------------------------------------------------------------------------------
# ternary genomes (SPEC T-27)

TERN_LEN, TERN_POP = 4 * MiB, 64     # a 4 Mi-trit genome (16384 tq2_0 blocks), 32 folded streams
TERN_FLIP, TERN_FRACTION = 0.001, 0.001


class _TorchTernary:
    """T-27 written with torch on unpacked int8 codes (one byte per trit, no crumb packing):
    each stream's flips drawn by a torch.Generator seeded with its stream seed, dense f32 votes
    by index_add_, nonzero, a stable sort by |vote| (index ascending among ties), clamped moves
    of the top K; perturb/restore as gather, clamped add, scatter and the reverse scatter."""

    def __init__(self, torch, n: int, flips: int, streams: int, cap: int):
        self.torch, self.n, self.flips, self.streams, self.cap = torch, n, flips, streams, cap
        self.codes = torch.from_numpy(np.random.default_rng(4).integers(0, 3, n).astype(np.int8))
        self.gen = torch.Generator()
        self.coeffs = torch.randn(streams, generator=self.gen)

    def _flips(self, s: int):
        torch = self.torch
        self.gen.manual_seed(1000 + s)
        idx = torch.randint(self.n, (self.flips,), generator=self.gen)
        delta = torch.randint(2, (self.flips,), generator=self.gen, dtype=torch.int8) * 2 - 1
        return idx, delta

    def update(self):
        torch = self.torch
        parts = [self._flips(s) for s in range(self.streams)]
        idx = torch.cat([i for i, _ in parts])
        val = torch.cat([self.coeffs[s] * d.float() for s, (_, d) in enumerate(parts)])
        votes = torch.zeros(self.n).index_add_(0, idx, val)
        nz = votes.nonzero().squeeze(1)
        v = votes[nz]
        top = torch.sort(v.abs(), descending=True, stable=True).indices[:self.cap]
        sel = nz[top]
        step = torch.where(v[top] > 0, 1, -1).to(torch.int8)
        self.codes[sel] = (self.codes[sel] + step).clamp_(0, 2)

    def perturb_restore(self):
        idx, delta = self._flips(0)
        old = self.codes[idx]
        self.codes[idx] = (old + delta).clamp_(0, 2)
        self.codes[idx.flip(0)] = old.flip(0)


def _ternary(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    from fucina import es

    torch = c.torch()
    ctx = fu.ExecContext(threads=threads)
    gen = np.random.default_rng(5)
    try:
        genome = ctx.tensor(gen.standard_normal((TERN_LEN // 4096, 4096)).astype(np.float32),
                            ("o", "i")).to("tq2_0")
        tr = es.Trainer(sigma=0.1, population=TERN_POP, antithetic=True, seed=3,
                        ternary_flip_rate=TERN_FLIP, ternary_update_fraction=TERN_FRACTION)
        tr.add_ternary_param(genome)
        flips, cap = tr.ternary_flip_count(TERN_LEN), tr.ternary_update_count(TERN_LEN)
        rewards = list(gen.standard_normal(TERN_POP))

        def perturb_restore():
            tr.perturb(1)
            tr.restore(1)

        stmts = {"update": lambda: tr.update(rewards), "perturb": perturb_restore}
        if torch is not None:
            ref = _TorchTernary(torch, TERN_LEN, flips, TERN_POP // 2, cap)
            stmts["torch_update"] = ref.update
            stmts["torch_perturb"] = ref.perturb_restore
        t, load = c.measured(stmts, env={}, threads=threads, quick=quick,
                             repeats=3 if quick else 7, block_s=0.05 if quick else 0.15)
        stmts.clear()
        tr.close()
        del genome
    finally:
        ctx.close()
    votes = TERN_POP // 2 * flips
    out = []
    for key, what, count in (
            ("update", f"ternary update (T-27): 4 Mi-trit tq2_0 genome, {TERN_POP // 2} streams x "
                       f"{flips} flips, top {cap} of the votes moved", votes),
            ("perturb", f"ternary perturb + restore (T-27): 4 Mi-trit tq2_0 genome, {flips} flips "
                        f"with undo log", 2 * flips)):
        out.append(c.vs_torch(GROUP, what, threads, t[key], t.get("torch_" + key), load,
                              target="≤ PyTorch",
                              note=f"{count / t[key].median / 1e6:.0f} M flips/s; torch on unpacked "
                                   f"int8 codes (dense votes, stable sort)"))
    return out


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "noise regeneration", _noise),
                               (GROUP, "es-spirals iteration", _spirals),
                               (GROUP, "ternary genomes", _ternary))


if __name__ == "__main__":
    c.main(rows)
