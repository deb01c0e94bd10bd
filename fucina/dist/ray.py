"""Joining or starting a Ray cluster: the one place fucina imports Ray."""
from __future__ import annotations

from ..errors import RayUnavailable

MODES = ("local", "auto")


def ray_module():
    """The `ray` package, or RayUnavailable naming the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(f"fucina.dist: expected the `ray` package (pip install "
                             f"'fucina[dist]'), got ImportError: {e}") from None
    return ray


def connect(where: str = "local", num_cpus: int | None = None):
    """Ray, initialised: "local" starts a private single-machine cluster (no dashboard, `num_cpus`
    CPUs), "auto" joins the cluster this machine belongs to, anything else is a cluster address
    ("HOST:PORT" or "ray://HOST:PORT"). A process already connected keeps its connection."""
    if not isinstance(where, str) or not where:
        raise RayUnavailable(f"fucina.dist.connect: expected 'local', 'auto' or a cluster address, "
                             f"got {where!r}")
    ray = ray_module()
    if ray.is_initialized():
        return ray
    kw = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        if where == "local":   # a private cluster that listens on loopback only
            ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kw)
        else:
            ray.init(address=where, **kw)
    except Exception as e:   # ConnectionError, ValueError, RuntimeError from a missing cluster
        raise RayUnavailable(f"fucina.dist.connect: could not {'start' if where == 'local' else 'join'}"
                             f" Ray at {where!r}: {type(e).__name__}: {e}") from None
    return ray


class Actors:
    """What every fucina.dist cluster shares: `actors` built from one actor class on Ray
    (restarted by Ray when lost: max_restarts), closed together."""

    def __init__(self, body, args, count: int, where: str, cpus_per_actor: float = 1):
        self._ray = connect(where)
        remote = self._ray.remote(num_cpus=cpus_per_actor, max_restarts=-1, max_task_retries=0)
        cls = remote(body)
        self.actors = [cls.remote(*args) for _ in range(int(count))]

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
        self.actors = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

