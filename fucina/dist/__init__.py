"""Past one process, on Ray (DESIGN §8): workers exchange only seeds, scalars and gradients, and
every sum across workers is taken in a fixed order on one side, so a distributed run is
byte-identical to the single-process run.

    cluster = fu.dist.EsCluster(build_replica, actors=2, ray="local")
    rewards = cluster.evaluate(trainer)     # member tasks out, one float per member back
    trainer.update(rewards); cluster.update(trainer, rewards)

Ray is an optional extra (`pip install fucina[dist]`); it is imported on first use.
"""
from .es import EsCluster, Replica
from .finetune import GradCluster
from .ray import connect

__all__ = ["EsCluster", "Replica", "GradCluster", "connect"]
