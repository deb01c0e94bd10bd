"""fucina.dist.GradCluster (issue 19): data-parallel LoRA accumulation on Ray actors leaves the
adapters byte-identical to the single-process accumulation of the same windows."""
import io
import sys

import pytest

import fucina as fu
from fucina.cli.tiny_model import build_tiny_model
from fucina.llm import IGNORE_INDEX, EncodeOptions, Pair, Template, Tokenizer, encode_pair
from fucina.llm.decoder import Model, Targets, Trainer

ray = pytest.importorskip("ray")
dist = pytest.importorskip("fucina.dist")

PAIRS = [Pair("What is the capital of France?", "Ahoy! Paris, matey."),
         Pair("Name a primary color.", "Ahoy! Red, matey."),
         Pair("What is two plus two?", "Ahoy! Four, matey."),
         Pair("How many days are in a week?", "Ahoy! Seven, matey.")]
WINDOWS = [[0, 1, 2], [3, 0, 1], [2, 3, 0]]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    dist.connect("local", num_cpus=2)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=3))


class Build:
    """Builds the trainer inside an actor: the same file, targets, rank, alpha, dropout, seed."""

    def __init__(self, path, dropout=0.0):
        self.path, self.dropout = path, dropout

    def __call__(self):
        ctx = fu.ExecContext(threads=1)
        model = Model.from_gguf(ctx, self.path, widen_frozen=True)
        return Trainer(model, Targets(q=True, v=True), fu.lora.LoraConfig(4, 8, self.dropout), 11)


def setup(path, dropout=0.0, threads=2):
    ctx = fu.ExecContext(threads=threads)
    f = fu.gguf.read(path, ctx)
    tok = Tokenizer.from_gguf(f)
    samples = [encode_pair(tok, Template.CHATML, p, EncodeOptions(seq_max=64)) for p in PAIRS]
    model = Model.from_gguf(ctx, f, widen_frozen=True)
    trainer = Trainer(model, Targets(q=True, v=True), fu.lora.LoraConfig(4, 8, dropout), 11)
    opt = fu.optim.AdamW(lr=1e-2, weight_decay=0.0)
    trainer.register_all_params(opt)
    return ctx, trainer, opt, samples


def micro_batches(samples, window):
    chosen = [samples[i] for i in window]
    valid = sum(1 for s in chosen for y in s.labels if y != IGNORE_INDEX)
    return [(s.inputs, s.labels, 1.0 / valid) for s in chosen]


def single_process(path, dropout=0.0):
    ctx, trainer, opt, samples = setup(path, dropout)
    losses = []
    for window in WINDOWS:
        total = 0.0
        for inputs, labels, scale in micro_batches(samples, window):
            with ctx.exec_scope():
                loss = trainer.loss_ext(inputs, labels, reduction="sum", loss_scale=scale)
                loss.backward()
                total += loss.item()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    buf = io.BytesIO()
    trainer.save_adapters(buf)
    return buf.getvalue(), losses, trainer.step_counter


def on_ray(path, dropout=0.0, kill_at=None):
    ctx, trainer, opt, samples = setup(path, dropout)
    losses = []
    with dist.GradCluster(Build(path, dropout), trainer, actors=2) as cluster:
        for k, window in enumerate(WINDOWS):
            if k == kill_at:
                ray.kill(cluster.actors[0], no_restart=False)
            losses.append(sum(cluster.accumulate(micro_batches(samples, window))))
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
        restarts = cluster.restarts
    buf = io.BytesIO()
    trainer.save_adapters(buf)
    return buf.getvalue(), losses, trainer.step_counter, restarts


def test_data_parallel_windows_give_the_single_process_adapters(tiny):
    want, want_losses, want_steps = single_process(tiny)
    got, losses, steps, restarts = on_ray(tiny)
    assert got == want
    assert losses == want_losses and steps == want_steps == 9
    assert restarts == 0


def test_dropout_streams_follow_the_step_counter(tiny):
    want, want_losses, _ = single_process(tiny, dropout=0.2)
    got, losses, _, _ = on_ray(tiny, dropout=0.2)
    assert got == want and losses == want_losses


def test_a_killed_actor_changes_nothing(tiny):
    want, want_losses, _ = single_process(tiny)
    got, losses, _, restarts = on_ray(tiny, kill_at=1)
    assert restarts >= 1
    assert got == want and losses == want_losses


def test_bad_arguments(tiny):
    ctx, trainer, opt, samples = setup(tiny)
    with pytest.raises(fu.InvalidConfig, match="actors"):
        dist.GradCluster(Build(tiny), trainer, actors=0)
    with dist.GradCluster(Build(tiny), trainer, actors=1) as cluster:
        with pytest.raises(fu.InvalidConfig, match="at least one micro-batch"):
            cluster.accumulate([])
