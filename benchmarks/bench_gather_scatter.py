"""Indexing benchmarks vs PyTorch (same process, interleaved medians).

    python -m benchmarks.bench_gather_scatter [--quick]

Targets (at least as fast as PyTorch, 1 and 2 threads):
* the embedding lookup (forward only, no graph on either side): 256 rows of a [151936, 1024]
  f32 table, as `index_select` (an i64 tensor of ids) and as `gather` (a host list of ids
  converted on every call; PyTorch converts the same list with torch.tensor first); the same
  ids every call (rows in cache), and new ids each call (cold rows, as in training);
* its backward: forward + backward with a given upstream gradient, the table's gradient being
  zeros + the 256 rows scatter-added (PyTorch: index_select's backward, new_zeros + index_add_);
* concat of two [1024, 1024] along either axis;
* index_select (4096 rows along axis 0, 1024 columns along axis 1) and take_along_axis (indices
  [4096, 1024] along either axis) on a [4096, 1024] table.
scatter_add with [4096, 1024] indices is shown for information.
"""
from __future__ import annotations

import itertools

import numpy as np

from . import common as c

GROUP = "indexing"
V, D, J = 151936, 1024, 256
COLD_SETS = 64  # id sets cycled through by the cold-rows row (64 x 1 MiB of rows)
R, C = 4096, 1024


def _one(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    rng = np.random.default_rng(0)
    table = rng.standard_normal((V, D), dtype=np.float32)
    ids = rng.integers(0, V, J)
    sets = [rng.integers(0, V, J) for _ in range(COLD_SETS)]
    g = rng.standard_normal((J, D), dtype=np.float32)
    a, b = rng.standard_normal((2, 1024, 1024), dtype=np.float32)
    m = rng.standard_normal((R, C), dtype=np.float32)
    rows, cols = rng.integers(0, R, R), rng.integers(0, C, C)
    along1, along0 = rng.integers(0, C, (R, C)), rng.integers(0, R, (R, C))
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        emb = ctx.variable(table, ("v", "d"))
        env = {"fu": fu, "emb": emb, "embc": emb.detach(), "ids_list": ids.tolist(),
               "ids": ctx.tensor(ids, ("s",), "i64"),
               "g": ctx.tensor(g, ("s", "d")), "a": ctx.tensor(a, ("r", "c")), "b": ctx.tensor(b, ("r", "c")),
               "m": ctx.tensor(m, ("r", "c")), "rows": ctx.tensor(rows, ("k",), "i64"),
               "cols": ctx.tensor(cols, ("k",), "i64"), "al1": ctx.tensor(along1, ("r", "c"), "i64"),
               "al0": ctx.tensor(along0, ("r", "c"), "i64")}
        cases = [
            (f"embedding index_select, {J} rows of [{V}, {D}]", 'embc.index_select("v", ids, "s")',
             "T.index_select(0, tids)", True),
            (f"embedding gather (host id list), {J} rows of [{V}, {D}]", 'embc.gather("v", ids_list, "s")',
             "T.index_select(0, torch.tensor(ids_list))", True),
            (f"embedding index_select, cold rows (new ids each call), {J} rows of [{V}, {D}]",
             _cycling(lambda i: env["embc"].index_select("v", i, "s"),
                      [ctx.tensor(s, ("s",), "i64") for s in sets]), None, True),
            (f"embedding forward + scatter-add backward, {J} rows of [{V}, {D}]",
             'emb.zero_grad(); emb.index_select("v", ids, "s").backward(grad=g)',
             "TV.grad = None; TV.index_select(0, tids).backward(tg)", True),
            ("concat two [1024, 1024] along axis 0", 'fu.concat("r", a, b)', "torch.cat([ta, tb], 0)", True),
            ("concat two [1024, 1024] along axis 1", 'fu.concat("c", a, b)', "torch.cat([ta, tb], 1)", True),
            (f"index_select {R} rows of [{R}, {C}] (axis 0)", 'm.index_select("r", rows, "r")',
             "tm.index_select(0, trows)", True),
            (f"index_select {C} columns of [{R}, {C}] (axis 1)", 'm.index_select("c", cols, "c")',
             "tm.index_select(1, tcols)", True),
            (f"take_along_axis [{R}, {C}] along axis 1", 'm.take_along_axis("c", al1)',
             "torch.gather(tm, 1, tal1)", True),
            (f"take_along_axis [{R}, {C}] along axis 0", 'm.take_along_axis("r", al0)',
             "torch.gather(tm, 0, tal0)", True),
            (f"scatter_add [{R}, {C}] indices along axis 1", 'm.scatter_add("c", al1, m)',
             "tm.scatter_add(1, tal1, tm)", False),
        ]
        if torch is not None:
            T = torch.from_numpy(table)
            cold = _cycling(lambda i: T.index_select(0, i), [torch.from_numpy(s) for s in sets])
            cases = [(w, f, cold if t is None else t, tg) for w, f, t, tg in cases]
            env.update(torch=torch, T=T, TV=T.clone().requires_grad_(True), tids=torch.from_numpy(ids),
                       tg=torch.from_numpy(g), ta=torch.from_numpy(a), tb=torch.from_numpy(b),
                       tm=torch.from_numpy(m), trows=torch.from_numpy(rows), tcols=torch.from_numpy(cols),
                       tal1=torch.from_numpy(along1), tal0=torch.from_numpy(along0))
            _agree(env)
        for what, fu_stmt, to_stmt, target in cases:
            stmts = {"fucina": fu_stmt}
            if torch is not None:
                stmts["torch"] = to_stmt
            heavy = "backward" in what
            t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                                 repeats=(3 if heavy else 5) if quick else (7 if heavy else 15),
                                 block_s=(0.3 if heavy else 0.03) if quick else (0.6 if heavy else 0.1))
            out.append(c.vs_torch(GROUP, what, threads, t["fucina"], t.get("torch"), load,
                                  target="≥ PyTorch" if target else ""))
        env.clear()
        del emb
    finally:
        ctx.close()
    return out


def _cycling(fn, items):
    """A zero-argument statement calling fn on the next of `items` each time (cold rows: the
    table is far larger than the caches, so each call's rows come from memory)."""
    it = itertools.cycle(items)
    return lambda: fn(next(it))


def _agree(env) -> None:
    """Both sides compute the same thing before anyone is timed."""
    torch = env["torch"]
    checks = [
        (env["emb"].index_select("v", env["ids"], "s"), env["T"].index_select(0, env["tids"])),
        (env["fu"].concat("c", env["a"], env["b"]), torch.cat([env["ta"], env["tb"]], 1)),
        (env["m"].take_along_axis("r", env["al0"]), torch.gather(env["tm"], 0, env["tal0"])),
        (env["m"].index_select("c", env["cols"], "c"), env["tm"].index_select(1, env["tcols"])),
    ]
    for got, want in checks:
        if not np.array_equal(got.numpy(), want.numpy()):
            raise AssertionError("indexing: Fucina and PyTorch disagree")
    emb, g = env["emb"], env["g"]
    emb.index_select("v", env["ids"], "s").backward(grad=g)
    TV = env["TV"]
    TV.index_select(0, env["tids"]).backward(env["tg"])
    if not np.allclose(emb.grad_view().numpy()[env["tids"].numpy()], TV.grad.numpy()[env["tids"].numpy()], atol=1e-5):
        raise AssertionError("embedding backward: Fucina and PyTorch disagree")
    emb.zero_grad()
    TV.grad = None


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "indexing", _one))


if __name__ == "__main__":
    c.main(rows)
