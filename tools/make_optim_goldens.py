"""Optimizer goldens: PyTorch's own SGD / Adam / AdamW (single-tensor, foreach=False) run step
by step on fixed inputs, saved as small .npz files in tests/goldens/ (DESIGN.md §6).

    python -m tools.make_optim_goldens            # (re)write tests/goldens/optim_*.npz

Each case is one parameter of shape SHAPE with a seeded initial value and a seeded sequence of
STEPS gradients (independent of the parameter, so both sides see the very same inputs); the file
holds the inputs, the hyperparameters and torch's parameter and state after every step. The
tests compare Fucina against these files and against the same trajectories recomputed live
(`trajectory(case)`), so a torch upgrade that changes its numbers shows up as a golden mismatch.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SHAPE = (5, 7)   # 35 elements: two full 16-lane vectors and a masked tail of 3
STEPS = 30
ROOT = Path(__file__).resolve().parent.parent / "tests" / "goldens"


def _sgd_cases():
    out = []
    for wd in (0.0, 0.01):
        for momentum, dampening, nesterov in ((0.0, 0.0, False), (0.0, 0.1, False),
                                              (0.9, 0.0, False), (0.9, 0.0, True),
                                              (0.9, 0.1, False)):
            name = f"sgd_m{momentum}_d{dampening}_n{int(nesterov)}_wd{wd}"
            out.append((name, "SGD", dict(lr=0.05, momentum=momentum, dampening=dampening,
                                          weight_decay=wd, nesterov=nesterov)))
    return out


CASES = _sgd_cases() + [
    ("adam", "Adam", dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)),
    ("adam_wd", "Adam", dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)),
    ("adam_betas", "Adam", dict(lr=0.003, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0)),
    ("adamw", "AdamW", dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)),
    ("adamw_nowd", "AdamW", dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)),
    ("adamw_big_lr", "AdamW", dict(lr=0.2, beta1=0.5, beta2=0.9, eps=1e-3, weight_decay=0.1)),
]
STATE = {"SGD": ("momentum_buffer",), "Adam": ("exp_avg", "exp_avg_sq"),
         "AdamW": ("exp_avg", "exp_avg_sq")}


def inputs(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(initial param [SHAPE], gradients [STEPS, *SHAPE]) of a case, from its name's seed.
    A few gradient entries are exactly 0 and one step has a gradient 100x larger."""
    seed = sum(name.encode()) * 7919 + len(name)
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(SHAPE).astype(np.float32)
    grads = rng.standard_normal((STEPS,) + SHAPE).astype(np.float32)
    grads[rng.random(grads.shape) < 0.05] = 0.0
    grads[STEPS // 2] *= 100.0
    return p0, grads


def torch_optimizer(kind: str, params, hp: dict):
    import torch

    if kind == "SGD":
        return torch.optim.SGD(params, foreach=False, **hp)
    cls = torch.optim.Adam if kind == "Adam" else torch.optim.AdamW
    hp = dict(hp)
    betas = (hp.pop("beta1"), hp.pop("beta2"))
    return cls(params, betas=betas, foreach=False, **hp)


def trajectory(case) -> dict[str, np.ndarray]:
    """torch's parameter and state after every step of `case` (name, kind, hyperparameters)."""
    import torch

    name, kind, hp = case
    p0, grads = inputs(name)
    p = torch.tensor(p0.copy(), requires_grad=True)
    opt = torch_optimizer(kind, [p], hp)
    out = {"param": []} | {k: [] for k in STATE[kind]}
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        out["param"].append(p.detach().numpy().copy())
        st = opt.state[p]
        for k in STATE[kind]:
            v = st.get(k)
            out[k].append(np.zeros(SHAPE, np.float32) if v is None else v.numpy().copy())
    return {k: np.stack(v) for k, v in out.items()}


def path_of(name: str) -> Path:
    return ROOT / f"optim_{name}.npz"


def load(name: str) -> dict[str, np.ndarray]:
    with np.load(path_of(name)) as z:
        return {k: z[k] for k in z.files}


def main() -> None:
    import torch

    ROOT.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        name, kind, hp = case
        p0, grads = inputs(name)
        traj = trajectory(case)
        np.savez_compressed(path_of(name), p0=p0, grads=grads,
                            meta=np.array(json.dumps({"kind": kind, "hp": hp,
                                                      "torch": torch.__version__})), **traj)
        print(f"wrote {path_of(name).relative_to(ROOT.parent.parent)}")


if __name__ == "__main__":
    main()
