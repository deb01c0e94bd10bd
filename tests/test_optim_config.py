"""Optimizer and schedule configs validated as torch.optim validates them (issue 20 item 3):
every refused value raises InvalidOptimizerConfig (a ValueError) naming the optimizer, the field
and the value; torch's betas=(b1, b2) spelling; values assigned later are checked at step()."""
import math

import numpy as np
import pytest
import torch

import fucina as fu
from conftest import feed_grad as feed

NAN, INF = float("nan"), float("inf")
BAD_REAL = [NAN, INF, -INF, "0.1", None, True]

# (optimizer, field, refused values) — torch refuses the negative ones too (checked below)
CASES = [(kind, field, v)
         for kind in ("Adam", "AdamW")
         for field, vals in (("lr", [-1.0, -1e-12] + BAD_REAL),
                             ("beta1", [-0.1, 1.0, 1.5] + BAD_REAL),
                             ("beta2", [-0.1, 1.0] + BAD_REAL),
                             ("eps", [-1e-8] + BAD_REAL),
                             ("weight_decay", [-0.01] + BAD_REAL))
         for v in vals]
CASES += [("SGD", field, v)
          for field, vals in (("lr", [-1.0] + BAD_REAL), ("momentum", [-0.5] + BAD_REAL),
                              ("dampening", BAD_REAL), ("weight_decay", [-1.0] + BAD_REAL),
                              ("nesterov", [1, "yes", None]))
          for v in vals]
CASES += [("Muon", field, v)
          for field, vals in (("lr", [-0.02] + BAD_REAL), ("momentum", [-0.95] + BAD_REAL),
                              ("weight_decay", [-1.0] + BAD_REAL), ("nesterov", [0, "no"]),
                              ("ns_steps", [-1, 2 ** 32, 2.0, True]),
                              ("scale", ["rms", None]))
          for v in vals]
CASES += [("Apollo", field, v)
          for field, vals in (("lr", [-1.0] + BAD_REAL), ("beta1", [1.0, -0.5, NAN]),
                              ("beta2", [1.0, NAN]), ("eps", [-1e-6, NAN, INF]),
                              ("weight_decay", [-0.1, NAN]), ("scale", [0.0, -1.0, NAN, INF, "1"]),
                              ("rank", [0, -1, 1.5, True]), ("update_proj_gap", [0, 2 ** 64]),
                              ("scale_type", ["row", None]), ("seed", [-1, 2 ** 64, 0.5]),
                              ("correct_bias", [1, None]), ("scale_front", ["x"]),
                              ("disable_norm_growth_limiter", [0]))
          for v in vals]


@pytest.mark.parametrize("kind,field,value", CASES, ids=[f"{k}-{f}-{v!r}" for k, f, v in CASES])
def test_refused_at_construction(kind, field, value):
    with pytest.raises(fu.InvalidOptimizerConfig, match=rf"{kind}: .*{field}") as e:
        getattr(fu.optim, kind)(**{field: value})
    assert isinstance(e.value, ValueError) and isinstance(e.value, fu.OptimError)


TORCH_REFUSES = [("Adam", "lr", -1.0), ("Adam", "eps", -1e-8), ("Adam", "beta1", 1.0),
                 ("Adam", "beta2", -0.1), ("Adam", "weight_decay", -0.01), ("AdamW", "lr", NAN),
                 ("SGD", "lr", -1.0), ("SGD", "momentum", -0.5), ("SGD", "weight_decay", -1.0)]


@pytest.mark.parametrize("kind,field,value", TORCH_REFUSES)
def test_torch_refuses_the_same(kind, field, value):
    """The torch oracle refuses each of these too (we are stricter only on non-finite values,
    non-numbers and Apollo's scale <= 0)."""
    p = [torch.nn.Parameter(torch.zeros(2))]
    if field in ("beta1", "beta2"):
        betas = (value, 0.999) if field == "beta1" else (0.9, value)
        kw = {"betas": betas}
    else:
        kw = {field: value}
    with pytest.raises(ValueError):
        getattr(torch.optim, kind)(p, **kw)
    with pytest.raises(fu.InvalidOptimizerConfig):
        getattr(fu.optim, kind)(**{field: value})


@pytest.mark.parametrize("kind,kw", [("Adam", {"eps": 0.0}), ("AdamW", {"lr": 0.0}),
                                     ("SGD", {"momentum": 0.0, "dampening": -0.5}),
                                     ("Adam", {"beta1": 0.0, "beta2": 0.0}),
                                     ("Muon", {"momentum": 0.0, "nesterov": False}),
                                     ("Apollo", {"eps": 0.0, "seed": 2 ** 64 - 1})])
def test_edges_torch_accepts_are_accepted(kind, kw):
    getattr(fu.optim, kind)(**kw)


def test_nesterov_rules():
    with pytest.raises(fu.InvalidOptimizerConfig, match="nesterov requires momentum"):
        fu.optim.SGD(nesterov=True)
    with pytest.raises(fu.InvalidOptimizerConfig, match="nesterov requires momentum"):
        fu.optim.SGD(nesterov=True, momentum=0.9, dampening=0.1)
    fu.optim.SGD(nesterov=True, momentum=0.9)


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "Apollo"])
def test_betas_alias(kind):
    opt = getattr(fu.optim, kind)(betas=(0.8, 0.95))
    assert (opt.config.beta1, opt.config.beta2) == (0.8, 0.95)
    assert type(opt.config.beta1) is float and type(opt.config.beta2) is float
    cfg = getattr(fu.optim, f"{kind}Config")(betas=[0.5, 0.75])
    assert (cfg.beta1, cfg.beta2) == (0.5, 0.75)
    default = getattr(fu.optim, kind)()
    assert type(default.config.beta1) is float and default.config.beta1 == 0.9
    for clash in ({"beta1": 0.9}, {"beta2": 0.999}, {"beta1": 0.8, "beta2": 0.9}):
        with pytest.raises(fu.InvalidOptimizerConfig, match="not both"):
            getattr(fu.optim, kind)(betas=(0.8, 0.95), **clash)
    for bad in ((0.9,), (0.9, 0.99, 0.999), 0.9, "abc"):
        with pytest.raises(fu.InvalidOptimizerConfig, match="betas: expected a pair"):
            getattr(fu.optim, kind)(betas=bad)
    with pytest.raises(fu.InvalidOptimizerConfig, match="beta1: expected a real number"):
        getattr(fu.optim, kind)(betas="ab")
    with pytest.raises(fu.InvalidOptimizerConfig, match="beta2"):
        getattr(fu.optim, kind)(betas=(0.9, 1.0))


def test_betas_alias_matches_torch(ctx):
    """AdamW(betas=(0.9, 0.95)) steps as torch.optim.AdamW(betas=(0.9, 0.95)) does."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((4, 3)).astype(np.float32)
    w = ctx.variable(w0, ("o", "i"))
    opt = fu.optim.AdamW(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    opt.add_param(w)
    tw = torch.nn.Parameter(torch.tensor(w0))
    topt = torch.optim.AdamW([tw], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(3):
        g = rng.standard_normal((4, 3)).astype(np.float32)
        feed(ctx, w, g)
        opt.step()
        opt.zero_grad()
        tw.grad = torch.tensor(g)
        topt.step()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=0, atol=2e-6)


@pytest.mark.parametrize("kind", ["SGD", "AdamW", "Muon", "Apollo"])
@pytest.mark.parametrize("value", [-0.5, NAN, INF])
def test_assigned_values_are_checked_at_step(ctx1, kind, value):
    """config is mutable (schedules write lr): a bad value is refused at the next step, before
    any parameter changes."""
    w = ctx1.variable(np.ones((3, 4), np.float32), ("o", "i"))
    opt = getattr(fu.optim, kind)()
    opt.add_param(w)
    feed(ctx1, w, np.ones((3, 4)))
    opt.config.lr = value
    with pytest.raises(fu.InvalidOptimizerConfig, match=f"{kind}: lr"):
        opt.step()
    np.testing.assert_array_equal(w.numpy(), np.ones((3, 4), np.float32))
    opt.config.lr = 0.01
    opt.step()
    assert not np.array_equal(w.numpy(), np.ones((3, 4), np.float32))


def test_muon_fallback_checked():
    with pytest.raises(fu.InvalidOptimizerConfig, match="AdamW: eps"):
        fu.optim.Muon(fallback=fu.optim.AdamWConfig(eps=-1.0))
    opt = fu.optim.Muon()
    opt.config.fallback.lr = NAN
    with pytest.raises(fu.InvalidOptimizerConfig, match="AdamW: lr"):
        opt.step()


WCF_BAD = [(dict(step=-1), "step"), (dict(step=1.5), "step"), (dict(step=True), "step"),
           (dict(total=-10), "total"), (dict(total=None), "total"), (dict(warmup=-1), "warmup"),
           (dict(warmup=2.0), "warmup"), (dict(min_factor=-0.1), "min_factor"),
           (dict(min_factor=1.5), "min_factor"), (dict(min_factor=NAN), "min_factor"),
           (dict(min_factor="0.1"), "min_factor")]


@pytest.mark.parametrize("bad,field", WCF_BAD)
def test_warmup_cosine_factor_arguments(bad, field):
    args = dict(step=3, total=100, warmup=10, min_factor=0.1, **{})
    args.update(bad)
    with pytest.raises(fu.InvalidOptimizerConfig, match=f"warmup_cosine_factor: .*{field}"):
        fu.optim.warmup_cosine_factor(**args)


def test_warmup_cosine_factor_edges():
    wcf = fu.optim.warmup_cosine_factor
    assert wcf(0, 0, 0, 0.0) == 0.0 and wcf(5, 0, 0, 1.0) == 1.0
    assert math.isclose(wcf(3, 100, 10, 0.1), 0.4)


@pytest.mark.parametrize("factor", [-1.0, NAN, INF, "1"])
def test_lr_schedule_refuses(factor):
    opt = fu.optim.AdamW(lr=1e-3)
    sched = fu.optim.LrSchedule()
    sched.attach(opt.config)
    with pytest.raises(fu.InvalidOptimizerConfig, match="LrSchedule.apply: factor"):
        sched.apply(factor)
    assert opt.config.lr == 1e-3
    opt.config.lr = -1.0
    with pytest.raises(fu.InvalidOptimizerConfig, match="LrSchedule.attach: AdamWConfig.lr"):
        sched.attach(opt.config)
