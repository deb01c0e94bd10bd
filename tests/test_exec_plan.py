"""Recorded launch plans (fucina/exec/plan.py, runtime run_plan): a region recorded at three
consecutive positions replays from C with the eager bits; regions that are not affine in the
position have no plan; a malformed plan is refused before anything runs."""
import numpy as np
import pytest

import fucina as fu
from fucina.exec import elementwise as ew
from fucina.exec import plan
from fucina.runtime import _rt

from conftest import assert_bitwise

N, D = 12, 16


def put(dst, src):
    """src's values into the raw view dst (outside autograd, as the KV cache writes rows)."""
    ew.run(dst.ctx, "copy", "f32", dst.shape, (src._raw,), out=dst)


def region(ctx, cache, w, pos):
    """Write row `pos` of the key and value caches from the input row, then attend over rows
    0..pos with one query (the decode kernel) and project: the cache row's address, the number
    of keys and the costs move with pos, linearly by construction."""
    x = ctx.state["x"]
    k, v = cache
    put(k._raw.narrow(0, pos, 1), (x * 2.0).tanh().reshape(("seq", "kv_head", "d"), (1, 2, D // 2)))
    put(v._raw.narrow(0, pos, 1), x.sigmoid().reshape(("seq", "kv_head", "d"), (1, 2, D // 2)))
    q = x.reshape(("seq", "head", "d"), (1, 2, D // 2))
    att = q.grouped_attention(k.narrow("seq", 0, pos + 1), v.narrow("seq", 0, pos + 1), [0, 1],
                              "d", 0.25)
    return att.dot(w, "d").sum("seq")


def new_cache(ctx):
    return tuple(ctx.zeros((N, 2, D // 2), tags=("seq", "kv_head", "d")) for _ in range(2))


def set_input(ctx, xin):
    put(ctx.state["x"]._raw, ctx.tensor(xin, ("n", "d")))


@pytest.fixture(params=[1, 2])
def setup(request):
    ctx = fu.ExecContext(threads=request.param)
    rng = np.random.default_rng(3)
    ctx.state = {"x": ctx.tensor(rng.standard_normal((1, D)).astype(np.float32), ("n", "d"))}
    w = ctx.tensor(rng.standard_normal((D, 5)).astype(np.float32), ("d", "o"))
    yield ctx, w, rng
    ctx.close()


def run_eager(ctx, w, inputs):
    cache = new_cache(ctx)
    outs = []
    for pos, xin in enumerate(inputs):
        set_input(ctx, xin)
        with fu.no_grad(), ctx.exec_scope():
            outs.append(region(ctx, cache, w, pos).numpy())
    return outs


def test_replay_gives_the_eager_bits(setup):
    ctx, w, rng = setup
    inputs = [rng.standard_normal((1, D)).astype(np.float32) for _ in range(N)]
    want = run_eager(ctx, w, inputs)
    cache = new_cache(ctx)
    recs, outs, keep = [], [], []
    for pos in range(3):
        set_input(ctx, inputs[pos])
        with fu.no_grad(), ctx.exec_scope():
            with plan.record(ctx) as rec:
                out = region(ctx, cache, w, pos)
            recs.append(rec)
            keep.append(out._raw)
            outs.append(out.numpy())
    p = plan.Plan.fit(recs, 0)
    assert p is not None and p.launches == len(recs[0].launches) > 3
    result = fu.Tensor(keep[0], ("o",))
    for pos in range(3, N):
        set_input(ctx, inputs[pos])
        p.run(ctx, pos)
        outs.append(result.numpy())
    for a, b in zip(outs, want):
        assert_bitwise(a, b)


def test_a_region_whose_launches_change_has_no_plan(setup):
    ctx, w, _ = setup
    cache = new_cache(ctx)
    recs = []
    for pos in range(3):
        with fu.no_grad(), ctx.exec_scope():
            with plan.record(ctx) as rec:
                region(ctx, cache, w, pos)
                if pos == 2:            # one launch more on the third position
                    ctx.state["x"].exp()
            recs.append(rec)
    assert plan.Plan.fit(recs, 0) is None
    recs = []
    for pos in (0, 1, 3):               # not consecutive: the slopes disagree
        with fu.no_grad(), ctx.exec_scope():
            with plan.record(ctx) as rec:
                region(ctx, cache, w, pos)
            recs.append(rec)
    assert plan.Plan.fit(recs, 0) is None


def test_recording_restores_the_context(setup):
    ctx, w, _ = setup
    pool = ctx.pool
    with pytest.raises(ZeroDivisionError):
        with plan.record(ctx):
            1 / 0
    assert ctx.pool is pool and "launch" not in vars(ctx)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_context_binds_the_runtime_launch(threads):
    """After its first launch a context's launch is the runtime's own with the team bound (no
    Python frame per launch); a wrapper set meanwhile is never replaced by that binding, its
    del brings the method back, and close() drops the binding with the team."""
    ctx = fu.ExecContext(threads=threads)
    x = ctx.tensor(np.arange(8, dtype=np.float32), ("i",))
    (x * 2.0).numpy()
    bound = vars(ctx)["launch"]
    assert bound.func is _rt.launch and bound.args == (ctx._team,)
    assert (ctx._team is None) == (threads == 1)
    with plan.record(ctx) as rec:
        assert vars(ctx)["launch"] is not bound
        np.testing.assert_array_equal((x + 1.0).numpy(), np.arange(8) + 1.0)
    assert len(rec.launches) == 1 and "launch" not in vars(ctx)
    (x * 3.0).numpy()
    assert vars(ctx)["launch"].func is _rt.launch
    del x, rec   # a recording keeps its buffers alive
    ctx.close()
    assert "launch" not in vars(ctx)


def test_run_plan_refuses_malformed_plans():
    out = np.zeros(4, np.int64)
    fill = _rt.test_kernel_addr("fill_index")
    good = [fill, 3, 4, 0, 0, 0, out.ctypes.data, 1, 4, 0, 0, 0]   # 4 chunks of 1 index
    _rt.run_plan(None, np.array(good, np.int64), 0)
    assert out.tolist() == [0, 1, 2, 3]
    bad = {"a multiple of 8": np.array(good, np.int64).tobytes()[:-3],
           "header": np.array(good[:4], np.int64),
           "address 0": np.array([0] + good[1:], np.int64),
           "argument count": np.array(good[:1] + [99] + good[2:], np.int64),
           "inside an entry's arguments": np.array(good[:-2], np.int64),
           "chunks": np.array(good[:2] + [-1] + good[3:], np.int64)}
    for what, p in bad.items():
        out[:] = 7
        with pytest.raises(ValueError, match=what):
            _rt.run_plan(None, p, 0)
        assert (out == 7).all()          # checked before anything ran
    with pytest.raises(TypeError):
        _rt.run_plan("team", np.array(good, np.int64), 0)
    # slopes: chunks 0 + 1*x and n 0 + 1*x fill the first x entries
    out[:] = -1
    _rt.run_plan(None, np.array([fill, 3, 0, 1, 0, 0, out.ctypes.data, 1, 0, 0, 0, 1], np.int64), 2)
    assert out.tolist() == [0, 1, -1, -1]


# ---- fixed replays (plan.capture / plan.Fixed) ----------------------------------------------

def fixed_region(ctx, w, xin, idx):
    """Uploads (x, the row indices), a gather, temporaries freed on the way (their memory
    reused inside the region) and a result the caller keeps."""
    with ctx.graph_scope():     # each intermediate freed once nothing holds it
        x = ctx.tensor(xin, ("n", "d"))
        rows = w.index_select("n", ctx.tensor(idx, ("n",), dtype="i64"), "n")   # + a zeroed flag
        t = (x * 2.0).tanh()
        u = (t + rows).sigmoid()
        del t
        y = (u * x).exp().sum("n")
        return y._raw


def test_a_captured_region_replays_fed_with_new_uploads(setup):
    ctx, _, rng = setup
    w = ctx.tensor(rng.standard_normal((40, D)).astype(np.float32), ("n", "d"))
    x0 = rng.standard_normal((6, D)).astype(np.float32)
    i0 = np.array([3, 1, 4, 1, 5, 9], dtype=np.int64)
    with fu.no_grad(), ctx.exec_scope():
        with plan.capture(ctx) as cap:
            y = fixed_region(ctx, w, x0, i0)
    assert cap.pool.stats()["reuses"] > 0        # memory reused inside the region
    fixed = plan.Fixed(cap)
    ix, ii = fixed.upload_index(x0), fixed.upload_index(i0)
    assert None not in (ix, ii) and ix != ii
    for s in range(3):
        x1 = rng.standard_normal((6, D)).astype(np.float32)
        i1 = rng.integers(0, 40, 6)
        fixed.feed(ix, x1)
        fixed.feed(ii, i1)
        for buf in cap.zeroed:
            np.frombuffer(buf, np.uint8)[:] = 7      # a run zeroes them again
        fixed.run(ctx)
        assert all(not np.frombuffer(b, np.uint8).any() for b in cap.zeroed)
        with fu.no_grad(), ctx.exec_scope():
            want = fixed_region(ctx, w, x1, i1).to_numpy()
        assert_bitwise(y.to_numpy(), want)


def test_capture_restores_the_context_and_checks_feeds(setup):
    ctx, _, _ = setup
    pool, launch = ctx.pool, ctx.launch
    with pytest.raises(RuntimeError, match="inside"):
        with plan.capture(ctx):
            ctx.tensor(np.ones(4, np.float32), ("n",))
            raise RuntimeError("inside")
    assert ctx.pool is pool and "from_numpy" not in ctx.__dict__
    assert ctx.launch == launch or "launch" not in ctx.__dict__
    with fu.no_grad(), ctx.exec_scope():
        with plan.capture(ctx) as cap:
            a = ctx.tensor(np.ones(4, np.float32), ("n",))
            b = ctx.tensor(np.ones(4, np.float32), ("n",))
            _ = (a + b)._raw
    fixed = plan.Fixed(cap)
    assert fixed.upload_index(np.ones(4, np.float32)) is None     # two alike: ambiguous
    assert fixed.upload_index(np.zeros(4, np.float32)) is None    # none
    with pytest.raises(fu.errors.InvalidArgument, match="expected 16 bytes for upload 0, got 12"):
        fixed.feed(0, np.ones(3, np.float32))
    ctx.close()
    with pytest.raises(fu.errors.ContextClosed):
        fixed.run(ctx)
