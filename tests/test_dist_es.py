"""fucina.dist.EsCluster (issue 19): ES members on Ray actors give the bytes of the
single-process run — also when an actor dies in the middle of a task or between iterations."""
import os
import sys
import tempfile

import pytest

import fucina as fu
from fucina import es

ray = pytest.importorskip("ray")
dist = pytest.importorskip("fucina.dist")
spirals = pytest.importorskip("examples.es_spirals")

POP, ITERS, SEED = 12, 12, 5


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    dist.connect("local", num_cpus=2)
    # the actors unpickle this module's replica builders by value (tests/ is not on their path)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def driver(seed=SEED):
    xs, labels = spirals.make_spirals(seed)
    ctx = fu.ExecContext(threads=1)
    model = spirals.Model(ctx, xs, labels, seed)
    trainer = es.Trainer(sigma=0.1, alpha=0.3, population=POP, antithetic=True, seed=seed)
    registry = spirals.register(model, trainer)
    return xs, labels, ctx, model, trainer, registry


def single_process_bytes(iters=ITERS) -> bytes:
    """The reference: every member scored in this process, in place."""
    xs, labels, ctx, model, trainer, registry = driver()
    stack = spirals.Stack(ctx, xs, labels, POP)
    for _ in range(iters):
        trainer.materialize_members(range(POP), stack.stacked)
        trainer.update([-float(c) for c in stack.ce()])
    with tempfile.TemporaryDirectory() as d:
        trainer.save_checkpoint(d, registry)
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            return f.read()


class KillOnce(spirals.RayReplica):
    """A replica whose process dies once (os._exit) while scoring `member` of `iteration` —
    a lost actor in the middle of a task. The marker file makes it happen only once."""

    def __init__(self, marker, iteration, member, *args):
        super().__init__(*args)
        self.marker, self.iteration, self.member = marker, iteration, member

    def __call__(self):
        replica = super().__call__()
        inner = replica.score

        def score(members):
            if (replica.trainer.iteration == self.iteration and self.member in members
                    and os.path.exists(self.marker)):
                os.remove(self.marker)
                os._exit(1)
            return inner(members)

        replica.score = score
        return replica


def cluster_bytes(builder_of, iters=ITERS, kill_between=None, block=3):
    xs, labels, ctx, model, trainer, registry = driver()
    builder = builder_of(xs, labels)
    with dist.EsCluster(builder, trainer, registry, actors=2, ray="local", block=block) as cluster:
        for it in range(iters):
            if it == kill_between:
                ray.kill(cluster.actors[1], no_restart=False)
            rewards = cluster.evaluate(trainer)
            trainer.update(rewards)
            cluster.update(trainer, rewards)
        digest = cluster.verify(trainer)
        restored = cluster.restored
    with tempfile.TemporaryDirectory() as d:
        trainer.save_checkpoint(d, registry)
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            return f.read(), digest, restored


def args(xs, labels):
    return (xs, labels, SEED, 0.1, 0.3, POP, "z_score", 3)


def test_cluster_matches_single_process_bytes():
    want = single_process_bytes()
    got, digest, restored = cluster_bytes(lambda xs, labels: spirals.RayReplica(*args(xs, labels)))
    assert got == want
    assert restored == 0 and len(digest) == 64


def test_actor_lost_mid_task_is_restored_and_the_bytes_do_not_change(tmp_path):
    marker = tmp_path / "kill-once"
    marker.write_text("x")
    want = single_process_bytes()
    got, _, restored = cluster_bytes(
        lambda xs, labels: KillOnce(str(marker), 4, 7, *args(xs, labels)))
    assert not marker.exists(), "the actor never reached the member that kills it"
    assert restored >= 1
    assert got == want


def test_actor_killed_between_iterations_is_restored():
    want = single_process_bytes()
    got, _, restored = cluster_bytes(lambda xs, labels: spirals.RayReplica(*args(xs, labels)),
                                     kill_between=6)
    assert restored >= 1
    assert got == want


def test_es_spirals_saves_the_same_file_with_and_without_ray(tmp_path):
    common = dict(iterations=20, population=POP, alpha=0.3, target=0.0, seed=SEED,
                  log=lambda s: None)
    spirals.run(**common, mode="team", save=str(tmp_path / "a"))
    spirals.run(**common, ray="local", actors=2, save=str(tmp_path / "b"))
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    b = (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a == b


def test_a_replica_at_another_iteration_is_refused():
    xs, labels, ctx, model, trainer, registry = driver()
    actor = dist.es._EsActor(spirals.RayReplica(*args(xs, labels)))
    with pytest.raises(fu.ReplicaOutOfSync, match="iteration 0; expected seed 5 iteration 3"):
        actor.score(SEED, 3, 0, 3)
    assert len(actor.score(SEED, 0, 0, 3)) == 3


def test_bad_arguments():
    xs, labels, ctx, model, trainer, registry = driver()
    builder = spirals.RayReplica(*args(xs, labels))
    with pytest.raises(fu.InvalidConfig, match="actors"):
        dist.EsCluster(builder, trainer, registry, actors=0)
    with pytest.raises(TypeError, match="es.Trainer"):
        dist.EsCluster(builder, object(), registry)
    with pytest.raises(fu.RayUnavailable):
        dist.connect("")
    with dist.EsCluster(builder, trainer, registry, actors=1) as cluster:
        with pytest.raises(fu.RewardCountMismatch):
            cluster.evaluate(trainer, [0.0] * (POP - 1))
        other = es.Trainer(sigma=0.1, population=POP, seed=1)
        with pytest.raises(fu.InvalidConfig, match="trainer the cluster"):
            cluster.evaluate(other)
