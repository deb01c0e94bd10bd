"""Past one process (fucina.dist on a local Ray cluster, issue 19).

    python -m benchmarks.bench_dist [--quick]

* es-spirals iteration (evaluate every member + the driver's update + the broadcast update) at
  population 32 and 128 on 1 and 2 Ray actors (1-thread contexts, one batched forward per task
  of population/(2·actors) members). The comparator column holds the same iteration in one
  process (the demo's "team" evaluation on a context with as many threads as actors): the
  price of the process boundary, which pays off only when members cost more than a task's
  round trip (LLM members do; a 4482-parameter MLP does not).
* Overhead per member task: a replica whose score returns at once, one member per task, a
  population of 128 — the Ray round trip (submit, schedule, run, fetch) per task. Target < 5 ms.
"""
from __future__ import annotations

import time

from . import common as c
from .common import row

GROUP = "dist"
POPULATIONS = (32, 128)


class _Instant:
    """A replica that answers every member at once: the task round trip alone."""

    def __init__(self, seed, population):
        self.seed, self.population = seed, population

    def __call__(self):
        import fucina as fu
        from examples import es_spirals as sp
        from fucina import dist, es
        xs, labels = sp.make_spirals(self.seed)
        model = sp.Model(fu.ExecContext(threads=1), xs, labels, self.seed)
        tr = es.Trainer(sigma=0.1, alpha=0.3, population=self.population, antithetic=True,
                        seed=self.seed)
        reg = sp.register(model, tr)
        replica = dist.Replica(tr, reg, lambda members: [0.0] * len(members))
        replica.model = model
        return replica


def _driver(seed, population, threads):
    import fucina as fu
    from examples import es_spirals as sp
    from fucina import es
    xs, labels = sp.make_spirals(seed)
    ctx = fu.ExecContext(threads=threads)
    model = sp.Model(ctx, xs, labels, seed)
    tr = es.Trainer(sigma=0.1, alpha=0.3, population=population, antithetic=True, seed=seed)
    return xs, labels, ctx, model, tr, sp.register(model, tr)


def _iteration_rows(actors: int, quick: bool) -> list[dict]:
    from examples import es_spirals as sp
    from fucina import dist
    out = []
    for pop in POPULATIONS:
        xs, labels, ctx, model, tr, reg = _driver(7, pop, actors)
        block = -(-pop // (2 * actors))
        builder = sp.RayReplica(xs, labels, 7, 0.1, 0.3, pop, "z_score", block)
        local = sp.Workers(tr, xs, labels, 1, actors, block)
        with dist.EsCluster(builder, tr, reg, actors=actors, ray="local", block=block) as cl:
            rewards = [0.0] * pop

            def remote():
                cl.evaluate(tr, rewards)
                tr.update(rewards)
                cl.update(tr, rewards)

            def inproc():
                local.evaluate(rewards)
                tr.update(rewards)
                cl.update(tr, rewards)      # keeps the actors in step; timed on both sides

            t = c.interleaved({"ray": remote, "local": inproc}, repeats=5 if quick else 9,
                              block_s=0.2)
            cl.verify(tr)
        local.close()
        fu_s, loc_s = t["ray"].median, t["local"].median
        out.append(row(GROUP, f"es-spirals iteration, population {pop}, {actors} Ray "
                       f"actor{'s' * (actors > 1)} (evaluate + update + broadcast)", actors,
                       fu_s, loc_s, note=f"comparator = the same iteration in one process "
                       f"({fmt(loc_s)}, team evaluation); blocks of {block} members per task"))
    return out


def fmt(s: float) -> str:
    return c.fmt_time(s)


def _overhead_rows(actors: int, quick: bool) -> list[dict]:
    from fucina import dist
    pop = 128
    xs, labels, ctx, model, tr, reg = _driver(11, pop, 1)
    with dist.EsCluster(_Instant(11, pop), tr, reg, actors=actors, ray="local", block=1) as cl:
        cl.evaluate(tr)                     # warm: workers started, functions shipped
        runs = []
        for _ in range(3 if quick else 7):
            t0 = time.perf_counter()
            cl.evaluate(tr)
            runs.append((time.perf_counter() - t0) / pop)
    runs.sort()
    per_task = runs[len(runs) // 2]
    return [row(GROUP, f"overhead per member task (Ray round trip, {actors} actor"
                f"{'s' * (actors > 1)}, population {pop}, one member per task)", actors,
                per_task, target="< 5 ms", met=per_task < 5e-3,
                note="median of whole-population evaluations / 128; the replica answers at once")]


def rows(quick: bool = False) -> list[dict]:
    from fucina import dist
    dist.connect("local", num_cpus=2)
    out = []
    for actors in (1, 2):
        out += c.guarded(GROUP, "es iteration", lambda: _iteration_rows(actors, quick),
                         threads=actors)
        out += c.guarded(GROUP, "task overhead", lambda: _overhead_rows(actors, quick),
                         threads=actors)
    return out


if __name__ == "__main__":
    import sys
    for r in rows("--quick" in sys.argv):
        print(r)
