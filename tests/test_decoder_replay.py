"""Replayed training steps (fucina/llm/decoder/replay.py): Trainer.loss_backward on samples of
one length captures a step, checks one replay against an eager run, then replays — every loss
and every gradient bitwise the eager trainer's, at 1 and 2 threads, f32 and bf16 compute,
plain and checkpointed layers, masked prompts; steps it must not replay stay eager."""
import numpy as np
import pytest

import fucina as fu
from conftest import assert_bitwise
from fucina.cli.tiny_model import build_tiny_model
from fucina.errors import ContextClosed, IndexOutOfBounds, LabelLengthMismatch
from fucina.llm import IGNORE_INDEX
from fucina.llm.decoder import TARGETS, Model, Trainer

VOCAB = 512
GEMMA = dict(arch="gemma3", layers=3, hidden=256, heads=2, kv_heads=1, head_dim=256, ffn=256,
             sliding_window=5)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    return {"qwen3": build_tiny_model(d / "qwen3.gguf", seed=5),
            "qwen2": build_tiny_model(d / "qwen2.gguf", seed=6, arch="qwen2"),
            "gemma3": build_tiny_model(d / "gemma3.gguf", seed=7, **GEMMA)}


def twins(ctx, path, compute="f32", targets=TARGETS, dropout=0.0, ckpt=False):
    """Two trainers on one model, alike but for replay (on, off), each with its AdamW."""
    model = Model.from_gguf(ctx, path, compute=compute)
    out = []
    for replay in (True, False):
        tr = Trainer(model, targets, fu.lora.LoraConfig(4, 8.0, dropout), seed=3,
                     checkpoint_layers=ckpt)
        tr.replay = replay
        opt = fu.optim.AdamW(lr=1e-2)
        tr.register_all_params(opt)
        out.append((tr, opt))
    return out


def sample(n, seed, masked=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, n + 1)
    labels = tokens[1:].astype(np.uint64)
    labels[:masked] = IGNORE_INDEX
    return tokens[:-1], labels


def grads(tr):
    return [None if t.grad() is None else t.grad().numpy()
            for _, ad in tr.named_adapters() for t in (ad.a, ad.b)]


def step_both(pair, tokens, labels, step=True):
    """One loss_backward on each twin: the losses and gradients must agree bit for bit."""
    (ta, oa), (tb, ob) = pair
    va, vb = ta.loss_backward(tokens, labels), tb.loss_backward(tokens, labels)
    assert_bitwise(np.float64(va), np.float64(vb))
    for ga, gb in zip(grads(ta), grads(tb)):
        assert (ga is None) == (gb is None)
        if ga is not None:
            assert_bitwise(ga, gb)
    assert ta.step_counter == tb.step_counter
    if step:
        for _, opt in pair:
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "gemma3"])
@pytest.mark.parametrize("compute", ["f32", "bf16"])
def test_replayed_steps_are_the_eager_steps(files, threads, arch, compute):
    ctx = fu.ExecContext(threads=threads)
    pair = twins(ctx, files[arch], compute)
    replays = pair[0][0]._replays
    for s in range(6):
        step_both(pair, *sample(24, s))
    assert replays.step is not None and replays.step.trusted
    assert replays.runs == 3        # eager twice, captured, checked (a replay), 2 replays
    assert pair[1][0]._replays.runs == 0


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_masked_prompts_and_checkpointed_layers_replay(files, ctx2, ckpt):
    """Chat SFT: the first half of each sample masked (the head on the supervised rows)."""
    pair = twins(ctx2, files["qwen3"], ckpt=ckpt, targets=("q", "v", "down"))
    for s in range(5):
        step_both(pair, *sample(30, s, masked=15))
    assert pair[0][0]._replays.runs == 2
    tokens, labels = sample(30, 5)
    labels[5:20] = IGNORE_INDEX           # as many masked, elsewhere: other head rows
    step_both(pair, tokens, labels)
    assert pair[0][0]._replays.runs == 2


def test_a_new_shape_drops_the_replay_and_comes_back(files, ctx2):
    pair = twins(ctx2, files["qwen3"])
    r = pair[0][0]._replays
    for s in range(4):
        step_both(pair, *sample(20, s))
    assert r.runs == 1 and r.step.trusted
    step_both(pair, *sample(12, 9))                 # another length: eager, the replay gone
    assert r.step is None and r.runs == 1
    tokens, labels = sample(20, 10)
    labels[3] = IGNORE_INDEX                        # the same length, another mask: a new key
    step_both(pair, tokens, labels)
    for s in range(11, 16):
        step_both(pair, *sample(20, s))
    assert r.runs == 3
    pair[0][0].replay = False                       # off: the replay and its memory dropped
    assert r.step is None
    step_both(pair, *sample(20, 16))
    assert r.runs == 3


def test_a_held_gradient_is_never_written_over(files, ctx2):
    """A view of a replayed gradient (grad_view) keeps its values: the next step runs eagerly
    into new buffers while the view is held, and replays again once it is gone."""
    pair = twins(ctx2, files["qwen3"])
    tr, r = pair[0][0], pair[0][0]._replays
    for s in range(4):
        step_both(pair, *sample(16, s), step=s < 3)
    a = tr.named_adapters()[0][1].b
    view = a.grad_view()
    kept = view.numpy().copy()
    for _, opt in pair:
        opt.step()
        opt.zero_grad()
    runs = r.runs
    step_both(pair, *sample(16, 4))
    assert r.runs == runs
    assert_bitwise(view.numpy(), kept)
    del view
    step_both(pair, *sample(16, 5))
    assert r.runs == runs + 1


def test_accumulation_and_dropout_stay_eager(files, ctx2):
    pair = twins(ctx2, files["qwen3"])
    r = pair[0][0]._replays
    for s in range(4):
        step_both(pair, *sample(16, s))
    runs = r.runs
    step_both(pair, *sample(16, 4), step=False)     # a replay ...
    step_both(pair, *sample(16, 5))                 # ... then one accumulating into it: eager
    assert r.runs == runs + 1
    pair = twins(ctx2, files["qwen3"])                # two samples a step, summed gradients
    for s in range(6):
        step_both(pair, *sample(16, 2 * s), step=False)
        step_both(pair, *sample(16, 2 * s + 1))   # (the second one eager: it accumulates)
    assert pair[0][0]._replays.runs == 4            # captured at step 1, checked at 2
    pair = twins(ctx2, files["qwen3"], dropout=0.25)
    for s in range(5):
        step_both(pair, *sample(16, s))
    assert pair[0][0]._replays.runs == 0 and pair[0][0]._replays.step is None


def test_bad_inputs_are_named_on_every_path(files):
    ctx = fu.ExecContext(threads=2)
    (tr, opt), _ = twins(ctx, files["qwen3"])
    for s in range(4):
        tr.loss_backward(*sample(16, s))
        opt.step()
        opt.zero_grad()
    assert tr._replays.step.trusted
    tokens, labels = sample(16, 9)
    bad = tokens.copy()
    bad[2] = VOCAB
    with pytest.raises(IndexOutOfBounds, match="loss_backward: token id 512"):
        tr.loss_backward(bad, labels)
    with pytest.raises(LabelLengthMismatch, match="loss_backward: expected one label per token"):
        tr.loss_backward(tokens, labels[:-1])
    with pytest.raises(TypeError, match="loss_backward: expected a real loss_scale"):
        tr.loss_backward(tokens, labels, loss_scale="2")
    worse = labels.copy()
    worse[0] = VOCAB + 3
    with pytest.raises(IndexOutOfBounds, match="label 515"):
        tr.loss_backward(tokens, worse)
    assert tr._replays.step.trusted                 # refused before anything ran
    ctx.close()
    with pytest.raises(ContextClosed):
        tr.loss_backward(tokens, labels)


def test_a_capture_or_check_that_fails_leaves_the_key_eager(files, ctx2):
    """Labels whose bytes are the tokens' (the two uploads cannot be told apart): no replay.
    A replay that disagrees with the eager run (here: its feeds swapped) is dropped and the
    step's results are the eager ones."""
    pair = twins(ctx2, files["qwen3"])
    r = pair[0][0]._replays
    for s in range(5):
        tokens, _ = sample(16, s)
        step_both(pair, tokens, tokens.astype(np.uint64))
    assert r.step is None and r.rejected is not None and r.runs == 0
    pair = twins(ctx2, files["qwen3"])
    r = pair[0][0]._replays
    for s in range(3):
        step_both(pair, *sample(16, s))
    assert r.step is not None and not r.step.trusted
    r.step.feeds = r.step.feeds[::-1]
    step_both(pair, *sample(16, 3))
    assert r.step is None and r.runs == 1 and r.rejected is not None
    for s in range(4, 7):
        step_both(pair, *sample(16, s))
    assert r.runs == 1
