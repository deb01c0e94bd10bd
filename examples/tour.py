"""A short real tour of Fucina: named-axis ops, what was compiled versus loaded from the disk
cache, and how long things took. `make demo` runs it; run it twice to see the warm cache."""
from __future__ import annotations

import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402

import fucina as fu  # noqa: E402
from fucina.codegen import cache, kernels  # noqa: E402


def timed(label, fn, repeat=5):
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    print(f"  {label.strip():<44} {best * 1e3:9.3f} ms")
    return out


def main():
    t_import = time.perf_counter() - T0
    print(f"fucina {fu.__version__}: kernel cache at {cache.cache_dir()}")
    with fu.ExecContext() as ctx:
        print(f"context with {ctx.threads} thread(s)\n")
        x = ctx.tensor([[1, 2], [3, 4]], tags=("row", "col"))
        b = ctx.tensor([10, 20], tags=("col",))
        y = x + b
        print("x[row, col] + b[col]          =", y.numpy().tolist(), "tags", y.tags)
        print("b[col] + x[row, col]          =", (b + x).numpy().tolist(), "tags", (b + x).tags)
        print("x.sum('col')                  =", x.sum("col").numpy().tolist())
        print("x.mean('row')                 =", x.mean("row").numpy().tolist())
        print("(x * 0.5).exp().sum_all()     =", round((x * 0.5).exp().sum_all().item(), 6))
        print("x.pow(b) / 1e6                =", (x.pow(b) / 1e6).numpy().round(3).tolist())
        print("x.to('bf16').to('f32')        =", x.to("bf16").to("f32").numpy().tolist())
        t_first = time.perf_counter() - T0

        print("\nautograd:")
        v = ctx.variable([3.0, 5.0], tags=("n",))
        (v * v + v.scale(4.0)).sum_all().backward()
        print("  d/dv sum(v*v + 4v) at v=[3,5]   =", v.grad().numpy().tolist())
        rng = np.random.default_rng(0)
        feats = ctx.tensor(rng.standard_normal((256, 512)).astype(np.float32), ("b", "i"))
        w1 = ctx.variable((rng.standard_normal((512, 1024)) / 512 ** 0.5).astype(np.float32), ("i", "h"))
        w2 = ctx.variable((rng.standard_normal((1024, 10)) / 32).astype(np.float32), ("h", "k"))
        labels = rng.integers(0, 10, 256)

        def step():
            with ctx.exec_scope():
                loss = feats.dot(w1, "i").tanh().dot(w2, "h").cross_entropy("k", labels)
                loss.backward()
                value = loss.item()
            w1.zero_grad()
            w2.zero_grad()
            return value

        print(f"  MLP 256x512 -> 1024 -> 10 (tanh, cross-entropy): loss {step():.4f}")
        timed("  forward + backward of that MLP", step)
        head = ctx.tensor(rng.standard_normal((64, 10)).astype(np.float32), ("h", "k"))
        check = fu.gradcheck(lambda p: p.tanh().dot(head, "h").cross_entropy("k", labels[:4]),
                             [ctx.variable(rng.standard_normal((4, 64)).astype(np.float32), ("b", "h"))])
        print(f"  gradcheck of a tanh + linear + CE head: {check.checked} elements, "
              f"max abs error {check.max_abs_error:.2e}")
        print(f"\nimport + first ops: {t_first:.3f} s (import alone {t_import:.3f} s)")
        print(f"kernels: {kernels.stats}\n")

        n = 1 << 24
        print(f"timings on {n:,} float32 elements (64 MiB), best of 5:")
        rng = np.random.default_rng(0)
        big = ctx.tensor(rng.standard_normal(n).astype(np.float32), ("n",))
        other = ctx.tensor(rng.standard_normal(n).astype(np.float32), ("n",))
        timed("a + b", lambda: big + other)
        timed("a * 2.0", lambda: big * 2.0)
        timed("exp(a)", lambda: big.exp())
        timed("tanh(a)", lambda: big.tanh())
        s = timed("sum_all(a)", lambda: big.sum_all())
        print(f"  sum_all = {s.item():.4f} (float64 numpy: {big.numpy().astype(np.float64).sum():.4f})")
        m = ctx.tensor(rng.standard_normal((4096, 4096)).astype(np.float32), ("r", "c"))
        timed("m[4096, 4096].sum('c')", lambda: m.sum("c"))
        timed("m[4096, 4096].max('r')", lambda: m.max("r"))
        tiny_a, tiny_b = ctx.tensor([1.0], ("n",)), ctx.tensor([2.0], ("n",))
        tiny_a + tiny_b
        reps = 100_000
        t = time.perf_counter()
        for _ in range(reps):
            tiny_a + tiny_b
        print(f"  {'a + b on 1 element (per op)':<44} {(time.perf_counter() - t) / reps * 1e6:9.3f} us")
        del big, other, m, s, x, b, y, tiny_a, tiny_b, v, feats, w1, w2, head
    print(f"\nkernels: {kernels.stats}")
    print("run it again: everything then loads from the cache and nothing compiles.")


if __name__ == "__main__":
    main()
