"""SGD, Adam and AdamW (SPEC T-2…T-5, T-24): the fused update kernels against

* a numpy float32 transcription of the SPEC formulas, bitwise, for every SGD momentum /
  nesterov / dampening / decay combination, Adam and AdamW, f32 and bf16 state, f32 / f16 /
  bf16 params (f32 masters);
* PyTorch (`foreach=False`, single-tensor) one step at a time along the trajectory (torch
  re-synced to our state before each step): every param and state element within 3 ulp of its
  operands' scale, S = max(|old|, |new|, |g|) (|g|² for the second moment; measured on the
  development machine: at most 2 ulp, at most 1.5 for SGD) — torch fuses
  multiply-adds (`add(alpha=)`, `addcmul`, `lerp`) and rounds `addcdiv` as (v·m)/d, we round
  every product as SPEC T-4/T-5 write it;
* the committed goldens (tests/goldens/optim_*.npz, tools/make_optim_goldens.py) and the same
  trajectories recomputed live with torch: 30 free-running steps within rtol 1e-5, atol 1e-6
  (SPEC §0.5; the per-step differences above accumulate to at most ~20 ulp of |p|);

plus thread invariance (1 vs 2 threads, several chunks), skipping params without gradients,
and the registration / step errors.
"""
import dataclasses

import numpy as np
import pytest
import torch

import fucina as fu
from conftest import assert_bitwise, feed_grad as feed
from fucina.exec.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from tools import make_optim_goldens as G

F = np.float32
TAGS = ("a", "b")
KEYS = {"SGD": {"momentum_buffer": "momentum_buffer"}, "Adam": {"exp_avg": "m", "exp_avg_sq": "v"},
        "AdamW": {"exp_avg": "m", "exp_avg_sq": "v"}}


# ---------------------------------------------------------------------------------------------
# numpy transcription of SPEC T-3…T-5 (float32 numpy arithmetic: one rounding per operation)

def narrow(x, dtype):
    """The stored value of x (f32) in `dtype`, read back as f32."""
    if dtype == "bf16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    if dtype == "f16":
        return x.astype(np.float16).astype(F)
    return x.astype(F)


def ref_sgd(p0, grads, hp, state="f32"):
    """[(master, momentum buffer as stored)] after each step."""
    lr, mom, omd, wd = F(hp["lr"]), F(hp["momentum"]), F(1.0 - hp["dampening"]), F(hp["weight_decay"])
    p, buf, out = p0.astype(F), None, []
    for t, g in enumerate(grads, 1):
        g = g.astype(F)
        if hp["weight_decay"] != 0:
            g = g + wd * p
        if hp["momentum"] != 0:
            b = g if t == 1 else mom * buf + omd * g
            buf = narrow(b, state)
            g = g + mom * b if hp.get("nesterov") else b
        p = p - lr * g
        out.append((p, np.zeros_like(p) if buf is None else buf))
    return out


def ref_adam(p0, grads, hp, decoupled, m_dtype="f32", v_dtype="f32"):
    """[(master, m, v as stored)] after each step; scalar prep in f64, rounded once."""
    wd = hp["weight_decay"]
    keep = F(1.0 - hp["lr"] * wd if wd != 0 else 1.0)
    omb1, beta2, omb2, eps = F(1.0 - hp["beta1"]), F(hp["beta2"]), F(1.0 - hp["beta2"]), F(hp["eps"])
    p = p0.astype(F)
    m, v = np.zeros_like(p), np.zeros_like(p)
    out = []
    for t, g in enumerate(grads, 1):
        g = g.astype(F)
        bc2s = F(np.sqrt(1.0 - hp["beta2"] ** t))
        step_size = F(hp["lr"] / (1.0 - hp["beta1"] ** t))
        d = p
        if wd != 0:
            if decoupled:
                d = p * keep
            else:
                g = g + F(wd) * p
        m1 = m + omb1 * (g - m)
        v1 = beta2 * v + (omb2 * g) * g
        m, v = narrow(m1, m_dtype), narrow(v1, v_dtype)
        p = d - step_size * (m1 / (np.sqrt(v1) / bc2s + eps))
        out.append((p, m, v))
    return out


def reference(kind, p0, grads, hp, state="f32", second="f32"):
    if kind == "SGD":
        return ref_sgd(p0, grads, hp, state)
    return ref_adam(p0, grads, hp, kind == "AdamW", state, second)


def make(kind, hp, **extra):
    return getattr(fu.optim, kind)(**hp, **extra)


def run(ctx, kind, hp, p0, grads, dtype="f32", **extra):
    """Our trajectory: [(param as stored, state dict)] after each step."""
    src = p0 if dtype == "f32" else narrow(p0, dtype)
    w = ctx.variable(src, TAGS[:p0.ndim], dtype=dtype)
    opt = make(kind, hp, **extra)
    opt.add_param(w)
    out = []
    for g in grads:
        feed(ctx, w, g)
        opt.step()
        out.append((w.numpy().astype(F), opt.state_of(w)))
    return out


def _state_names(kind):
    return ("momentum_buffer",) if kind == "SGD" else ("m", "v")


def check_state(kind, st, want_state, shape):
    """Our state buffers equal the transcription's, bitwise (no buffer: SGD without momentum)."""
    for field, ws in zip(_state_names(kind), want_state):
        if st[field].size == 0:
            assert kind == "SGD" and not ws.any()
            continue
        assert_bitwise(st[field].reshape(shape), ws)


# ---------------------------------------------------------------------------------------------
# bitwise against the SPEC transcription

@pytest.mark.parametrize("case", G.CASES, ids=[c[0] for c in G.CASES])
def test_spec_transcription_bitwise(ctx, case):
    name, kind, hp = case
    p0, grads = G.inputs(name)
    ours = run(ctx, kind, hp, p0, grads)
    want = reference(kind, p0, grads, hp)
    for (p, st), (wp, *wst) in zip(ours, want):
        assert_bitwise(p, wp)
        check_state(kind, st, wst, wp.shape)


BF16_CASES = [c for c in G.CASES if c[0] in ("sgd_m0.9_d0.0_n1_wd0.01", "sgd_m0.9_d0.1_n0_wd0.0",
                                             "adam_wd", "adamw", "adamw_big_lr")]


BF16_RUNS = [(c, s) for c in BF16_CASES for s in (("f32",) if c[1] == "SGD" else ("f32", "bf16"))]


@pytest.mark.parametrize("case,second", BF16_RUNS, ids=[f"{c[0]}-v{s}" for c, s in BF16_RUNS])
def test_bf16_state_bitwise(ctx, case, second):
    """T-3: reads widen, writes narrow (R-9 RNE), the element's own update uses the pre-narrow
    value; only the next step reads the narrowed one."""
    name, kind, hp = case
    p0, grads = G.inputs(name)
    extra = {"state_dtype": "bf16"} | ({} if kind == "SGD" else {"second_moment_dtype": second})
    ours = run(ctx, kind, hp, p0, grads, **extra)
    want = reference(kind, p0, grads, hp, "bf16", second)
    for (p, st), (wp, *wst) in zip(ours, want):
        assert_bitwise(p, wp)
        check_state(kind, st, wst, wp.shape)


MASTER_CASES = [c for c in G.CASES if c[0] in ("sgd_m0.9_d0.1_n0_wd0.01", "sgd_m0.0_d0.0_n0_wd0.0",
                                               "adam_wd", "adamw")]


@pytest.mark.parametrize("case", MASTER_CASES, ids=[c[0] for c in MASTER_CASES])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("state", ["f32", "bf16"])
def test_16bit_params_step_an_f32_master(ctx, case, dtype, state):
    """T-2/T-24: the master starts as widen(param), every update steps it, and the param is
    narrow(master) after each step."""
    name, kind, hp = case
    p0, grads = G.inputs(name)
    start = narrow(p0, dtype)
    extra = {"state_dtype": state}
    ours = run(ctx, kind, hp, p0, grads, dtype, **extra)
    want = reference(kind, start, grads, hp, state, "f32")
    for (p, st), (wp, *wst) in zip(ours, want):
        assert_bitwise(st["master"], wp)
        assert_bitwise(p, narrow(wp, dtype))
        check_state(kind, st, wst, wp.shape)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mixed_precision_training_through_to_f32(ctx, dtype):
    """T-24: a 16-bit leaf enters the graph through the differentiable to("f32"); its gradient
    is f32; AdamW steps the master and narrows it into the param. The loss is linear in w, so
    the gradient does not depend on the (rounded) forward weights and torch's f32 trajectory
    from the same start is a reference for the master."""
    rng = np.random.default_rng(8)
    w0 = narrow(rng.standard_normal((3, 4)).astype(F), dtype)
    xs = rng.standard_normal((6, 5, 3)).astype(F)
    cs = rng.standard_normal((6, 5, 4)).astype(F)
    w = ctx.variable(w0, ("in", "out"), dtype=dtype)
    opt = fu.optim.AdamW(lr=0.05)
    opt.add_param(w)
    tw = torch.tensor(w0.copy(), requires_grad=True)
    topt = torch.optim.AdamW([tw], lr=0.05, foreach=False)
    for x, c in zip(xs, cs):
        with ctx.exec_scope():
            y = ctx.tensor(x, ("b", "in")).dot(w.to("f32"), "in")
            (y * ctx.tensor(c, ("b", "out"))).sum_all().backward()
        assert w.grad().dtype == "f32"
        opt.step()
        opt.zero_grad()
        ((torch.from_numpy(x) @ tw) * torch.from_numpy(c)).sum().backward()
        topt.step()
        topt.zero_grad()
        master = opt.state_of(w)["master"]
        np.testing.assert_allclose(master, tw.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert_bitwise(w.numpy().astype(F), narrow(master, dtype))
        assert w.dtype == dtype


def test_master_is_stale_if_values_change_after_registration(ctx):
    """Values loaded AFTER registration do not reach the master (T-2's warning), until a
    checkpoint load re-widens it (see test_optim_frames)."""
    w = ctx.variable(np.ones((4,), F), ("i",), dtype="bf16")
    opt = fu.optim.SGD(lr=0.5)
    opt.add_param(w)
    w._raw.storage_view()[:] = f32_to_bf16_bits(np.full(4, 3.0, F))
    feed(ctx, w, np.ones(4, F))
    opt.step()
    assert w.numpy().tolist() == [0.5] * 4  # 1 - 0.5 * 1 from the master, not 3 - 0.5


# ---------------------------------------------------------------------------------------------
# PyTorch: one step at a time, and free-running against the goldens

def _torch_from(kind, hp, p, state, t):
    """A torch optimizer whose param and state are `p` and our state after t steps."""
    tp = torch.tensor(p.copy(), requires_grad=True)
    topt = G.torch_optimizer(kind, [tp], hp)
    if t:
        st = topt.state[tp]
        if kind == "SGD":
            if hp["momentum"] != 0:
                st["momentum_buffer"] = torch.tensor(state["momentum_buffer"].reshape(p.shape))
        else:
            st["step"] = torch.tensor(float(t))
            st["exp_avg"] = torch.tensor(state["m"].reshape(p.shape))
            st["exp_avg_sq"] = torch.tensor(state["v"].reshape(p.shape))
    return tp, topt


ULPS = 3.0  # the one-step bound against torch


def _ulps(got, want, scale):
    s = np.spacing(np.maximum(np.abs(want), scale).astype(F)).astype(np.float64)
    return float((np.abs(got.astype(np.float64) - want) / s).max())


@pytest.mark.parametrize("case", G.CASES, ids=[c[0] for c in G.CASES])
def test_one_step_against_torch(ctx1, case):
    name, kind, hp = case
    p0, grads = G.inputs(name)
    ours = run(ctx1, kind, hp, p0, grads)
    prev_p, prev_state = p0, None
    for t, (g, (p, st)) in enumerate(zip(grads, ours)):
        tp, topt = _torch_from(kind, hp, prev_p, prev_state, t)
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
        assert _ulps(p, tp.detach().numpy(), np.maximum(np.abs(prev_p), np.abs(g))) <= ULPS, (t, "param")
        for tk, field in KEYS[kind].items():
            if tk not in topt.state[tp]:
                continue
            old = np.zeros_like(p) if prev_state is None else prev_state[field].reshape(p.shape)
            scale = np.maximum(np.abs(old), g * g if field == "v" else np.abs(g))
            assert _ulps(st[field].reshape(p.shape), topt.state[tp][tk].numpy(), scale) <= ULPS, (t, field)
        prev_p, prev_state = p, st


@pytest.mark.parametrize("case", G.CASES, ids=[c[0] for c in G.CASES])
def test_trajectory_against_goldens_and_live_torch(ctx, case):
    name, kind, hp = case
    golden = G.load(name)
    p0, grads = G.inputs(name)
    assert_bitwise(golden["p0"], p0)
    assert_bitwise(golden["grads"], grads)
    live = G.trajectory(case)
    for k, v in live.items():  # torch here agrees with the committed torch numbers
        np.testing.assert_allclose(v, golden[k], rtol=1e-6, atol=1e-7, err_msg=k)
    ours = run(ctx, kind, hp, p0, grads)
    assert len(ours) == G.STEPS >= 25
    for t, (p, st) in enumerate(ours):
        for ref in (golden, live):
            np.testing.assert_allclose(p, ref["param"][t], rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
            for tk, field in KEYS[kind].items():
                if kind == "SGD" and hp["momentum"] == 0:
                    continue
                np.testing.assert_allclose(st[field].reshape(p.shape), ref[tk][t], rtol=1e-5,
                                           atol=1e-6, err_msg=f"{field} step {t}")


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_16bit_master_against_torch_f32(ctx, kind):
    """A bf16 param's master follows torch's f32 trajectory from the widened start."""
    case = next(c for c in G.CASES if c[1] == kind and c[2].get("momentum", 0.9) != 0)
    name, _, hp = case
    p0, grads = G.inputs(name)
    start = narrow(p0, "bf16")
    ours = run(ctx, kind, hp, p0, grads, "bf16")
    tp = torch.tensor(start.copy(), requires_grad=True)
    topt = G.torch_optimizer(kind, [tp], hp)
    for g, (p, st) in zip(grads, ours):
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
        np.testing.assert_allclose(st["master"], tp.detach().numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# threads, chunks, several params, skipping

@pytest.mark.parametrize("kind,extra,dtype", [
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True), "f32"),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.2, state_dtype="bf16"), "bf16"),
    ("Adam", dict(lr=0.01, weight_decay=0.1), "f32"),
    ("AdamW", dict(lr=0.01, state_dtype="bf16", second_moment_dtype="bf16"), "f16"),
    ("AdamW", dict(lr=0.01), "bf16"),
])
def test_thread_invariance_over_several_chunks(ctx1, ctx2, kind, extra, dtype):
    rng = np.random.default_rng(3)
    n = 3 * (1 << 15) + 21
    p0 = rng.standard_normal(n).astype(F)
    grads = rng.standard_normal((4, n)).astype(F)
    results = []
    for c in (ctx1, ctx2):
        w = c.variable(narrow(p0, dtype), ("i",), dtype=dtype)
        opt = make(kind, extra)
        opt.add_param(w)
        for g in grads:
            feed(c, w, g)
            opt.step()
        results.append((w.numpy(), opt.state_of(w)))
    (p1, s1), (p2, s2) = results
    assert_bitwise(p1, p2)
    for k in s1:
        if k != "step":
            assert_bitwise(s1[k], s2[k])
    # and the big run still follows the SPEC transcription
    want = reference(kind, narrow(p0, dtype), grads, dataclasses.asdict(make(kind, extra).config),
                     extra.get("state_dtype", "f32"), extra.get("second_moment_dtype", "f32"))
    master = s1.get("master", p1)
    assert_bitwise(master, want[-1][0])


@pytest.mark.parametrize("kind,extra,dtype", [
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True), "f32"),
    ("SGD", dict(lr=0.1), "f32"),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.2, state_dtype="bf16"), "bf16"),
    ("Adam", dict(lr=0.01, weight_decay=0.1), "f32"),
    ("AdamW", dict(lr=0.01, state_dtype="bf16", second_moment_dtype="bf16"), "f16"),
    ("AdamW", dict(lr=0.01, weight_decay=0.0), "f32"),
])
def test_many_slots_in_one_launch_step_as_each_alone(ctx1, ctx2, kind, extra, dtype):
    """An optimizer steps all its slots of one key and step count by one launch of the update's
    table form (a LoRA trainer's 420 adapter matrices: 420 launches -> 1). Params of several
    chunks and tails, stepped together at 1 and 2 threads, end bitwise where each param stepped
    alone by the one-tensor kernel ends, state included."""
    from fucina.codegen import kernels

    rng = np.random.default_rng(5)
    sizes = [7, 4608, (1 << 15) + 3, 1, 2 * (1 << 15), 100]
    p0 = [rng.standard_normal(n).astype(F) for n in sizes]
    grads = [rng.standard_normal((3, n)).astype(F) for n in sizes]
    runs = []
    for c, together in ((ctx1, True), (ctx2, True), (ctx1, False)):
        ws = [c.variable(narrow(p, dtype), ("i",), dtype=dtype) for p in p0]
        opts = [make(kind, extra)] if together else [make(kind, extra) for _ in ws]
        for i, w in enumerate(ws):
            opts[0 if together else i].add_param(w)
        seen = []
        real = c.launch
        c.launch = lambda addr, *a: (seen.append(kernels.keys_by_address().get(addr)),
                                     real(addr, *a))[1]
        try:
            for t in range(3):
                for w, g in zip(ws, grads):
                    feed(c, w, g[t])
                seen.clear()
                for o in opts:
                    o.step()
                updates = [k for k in seen if k is not None and k.family in ("sgd", "adam")]
                assert len(updates) == (1 if together else len(ws))
                assert all(k.table == together for k in updates)
        finally:
            del c.launch
        runs.append([(w.numpy(), opts[0 if together else i].state_of(w))
                     for i, w in enumerate(ws)])
    for other in runs[1:]:
        for (p1, s1), (p2, s2) in zip(runs[0], other):
            assert_bitwise(p1, p2)
            for k in s1:
                if k != "step":
                    assert_bitwise(s1[k], s2[k])


def test_params_without_grad_are_skipped(ctx):
    a = ctx.variable(np.ones(3, F), ("i",))
    b = ctx.variable(np.ones(2, F), ("j",))
    opt = fu.optim.Adam(lr=0.1)
    opt.add_param(a)
    opt.add_param(b, name="b")
    feed(ctx, a, np.ones(3, F))
    opt.step()
    assert opt.state_of(a)["step"] == 1 and opt.state_of(b)["step"] == 0
    assert b.numpy().tolist() == [1.0, 1.0]
    assert not np.array_equal(a.numpy(), np.ones(3, F))
    feed(ctx, b, np.ones(2, F))
    opt.step()  # a still holds its gradient: both step
    assert opt.state_of(a)["step"] == 2 and opt.state_of(b)["step"] == 1
    opt.zero_grad()
    assert a.grad() is None and b.grad() is None
    opt.step()
    assert opt.state_of(a)["step"] == 2


def test_gradient_from_autograd_and_0d_params(ctx):
    """Gradients come from backward() (the leaf's accumulator): a full loss, a 0-d param."""
    x = ctx.tensor(np.array([[1.0, 2.0], [3.0, 4.0]], F), ("n", "i"))
    w = ctx.variable(np.array([0.5, -0.5], F), ("i",))
    s = ctx.variable(2.0, ())
    opt = fu.optim.SGD(lr=0.1)
    opt.add_param(w)
    opt.add_param(s)
    (x.dot(w, "i").sum_all() * s).backward()
    opt.step()
    assert w.numpy().tolist() == pytest.approx([0.5 - 0.1 * 8.0, -0.5 - 0.1 * 12.0])
    assert s.item() == pytest.approx(2.0 - 0.1 * (-1.0))  # d/ds = sum(x·w) = -1
    assert opt.slots[1].rows == 1 and opt.slots[1].cols == 1 and opt.slots[1].raw_rank == 0


def test_slot_geometry(ctx):
    opt = fu.optim.SGD()
    for shape in [(7,), (3, 4), (2, 3, 5, 7)]:
        opt.add_param(ctx.variable(np.zeros(shape, F), tuple("abcd"[:len(shape)])))
    assert [(s.rows, s.cols, s.raw_rank) for s in opt.slots] == [(7, 1, 1), (3, 4, 2), (2, 105, 4)]


def test_config_is_mutable_and_read_each_step(ctx):
    w = ctx.variable(np.zeros(2, F), ("i",))
    opt = fu.optim.SGD(lr=1.0)
    opt.add_param(w)
    feed(ctx, w, np.ones(2, F))
    opt.step()
    opt.config.lr = 0.25
    opt.step()
    assert w.numpy().tolist() == [-1.25, -1.25]
    assert isinstance(opt.config, fu.optim.SgdConfig)
    cfg = fu.optim.AdamWConfig(lr=0.5)
    assert fu.optim.AdamW(cfg).config is cfg and cfg.weight_decay == 0.01
    assert fu.optim.AdamConfig().weight_decay == 0.0
    assert fu.optim.AdamW(state_dtype=fu.optim.StateDType.bf16).config.state_dtype == 1


# ---------------------------------------------------------------------------------------------
# errors

def test_registration_errors(ctx):
    opt = fu.optim.AdamW()
    const = ctx.tensor(np.ones(3, F), ("i",))
    with pytest.raises(fu.optim.NotAVariable, match="add_param.*expected a variable"):
        opt.add_param(const)
    w = ctx.variable(np.ones(3, F), ("i",))
    with pytest.raises(fu.optim.NotAVariable, match="result of"):
        opt.add_param(w.scale(2.0))
    opt.add_param(w)
    with pytest.raises(fu.optim.DuplicateParam, match="already registered"):
        opt.add_param(w)
    with pytest.raises(fu.optim.DuplicateParam):
        opt.add_param_named(w, "again")
    assert len(opt.slots) == 1
    m = ctx.variable(np.ones((3, 4), F), ("r", "c"))
    view = fu.Tensor(m._raw.permute((1, 0)), ("c", "r"), fu.ag.engine.Leaf((4, 3)))
    with pytest.raises(fu.optim.NonContiguousParam, match="contiguous"):
        opt.add_param(view)
    with pytest.raises(TypeError, match="Tensor"):
        opt.add_param(np.ones(3, F))
    with pytest.raises(TypeError, match="name"):
        opt.add_param(ctx.variable(np.ones(3, F), ("i",)), name=3)
    assert issubclass(fu.optim.NotAVariable, fu.OptimError)
    assert issubclass(fu.optim.DuplicateParam, fu.FucinaError)


def test_grad_shape_mismatch(ctx):
    w = ctx.variable(np.ones(3, F), ("i",))
    opt = fu.optim.SGD()
    opt.add_param(w)
    w._node.grad = ctx.tensor(np.ones(4, F), ("i",))._raw  # an accumulator of the wrong size
    with pytest.raises(fu.optim.GradShapeMismatch, match="expected a gradient of 3 elements"):
        opt.step()
    with pytest.raises(fu.optim.GradShapeMismatch):
        opt.clip_grad_norm(1.0)


def test_non_contiguous_grad_is_materialized(ctx):
    w = ctx.variable(np.zeros((2, 3), F), ("r", "c"))
    opt = fu.optim.SGD(lr=1.0)
    opt.add_param(w)
    g = np.arange(6, dtype=F).reshape(3, 2)
    w._node.grad = ctx.tensor(g, ("c", "r"))._raw.permute((1, 0))
    opt.step()
    assert_bitwise(w.numpy(), F(0.0) - g.T)  # p - lr·g with p = 0, lr = 1


def test_config_errors():
    with pytest.raises(ValueError, match="nesterov requires momentum"):
        fu.optim.SGD(nesterov=True)
    with pytest.raises(ValueError, match="nesterov requires momentum"):
        fu.optim.SGD(nesterov=True, momentum=0.9, dampening=0.1)
    fu.optim.SGD(nesterov=True, momentum=0.9)
    with pytest.raises(TypeError):
        fu.optim.AdamW(learning_rate=0.1)
    with pytest.raises(TypeError):
        fu.optim.SGD(fu.optim.SgdConfig(), lr=0.1)
    with pytest.raises(TypeError):
        fu.optim.SGD(fu.optim.AdamConfig())
    with pytest.raises(ValueError, match="state dtype"):
        fu.optim.Adam(state_dtype="f16")


def test_momentum_turned_on_after_registration(ctx):
    w = ctx.variable(np.ones(2, F), ("i",))
    opt = fu.optim.SGD(lr=0.1)
    opt.add_param(w)
    opt.config.momentum = 0.9
    feed(ctx, w, np.ones(2, F))
    with pytest.raises(ValueError, match="no momentum buffer"):
        opt.step()


def test_closed_optimizer_and_context():
    c = fu.ExecContext(threads=1)
    w = c.variable(np.ones(2, F), ("i",))
    opt = fu.optim.SGD()
    opt.add_param(w)
    feed(c, w, np.ones(2, F))
    with pytest.warns(ResourceWarning, match="still referenced"):
        c.close()
    with pytest.raises(fu.ContextClosed, match="SGD.step"):
        opt.step()
    with pytest.raises(fu.ContextClosed):
        fu.optim.SGD().add_param(w)
    opt.close()
    with pytest.raises(fu.UseAfterRelease, match="closed"):
        opt.step()
    with fu.optim.AdamW() as o2:
        assert o2.slots == []
    with pytest.raises(fu.UseAfterRelease):
        o2.clip_grad_norm(1.0)
