"""The LoRA trainer's loss runs the head (final norm, x·Wᵀ over the vocabulary, soft-cap,
softmax) only on the supervised positions (llm.decoder.train.head_rows): the loss and every
adapter gradient must be bitwise those of the full head — the reference here is the trainer's
own full logits (forward_logits) and cross_entropy_ext with ignore_index, as the loss ran
before — for frozen weights widened to f32, as stored (q8_0, q4_k) and as bf16, prompt-masked,
sparse, empty and full supervision, at 1 and 2 threads."""
import numpy as np
import pytest

import fucina as fu
from conftest import assert_bitwise
from fucina.cli.tiny_model import build_tiny_model
from fucina.llm import IGNORE_INDEX
from fucina.llm.decoder import TARGETS, Model, Trainer
from fucina.llm.decoder import train

SEQ = 40
PATTERNS = {   # which positions are supervised
    "response": lambda i: i >= 26,          # a chat sample: the prompt masked
    "turns": lambda i: 8 <= i < 14 or i >= 33,   # two assistant turns
    "sparse": lambda i: i in (5, 30, 31),   # fewer than HEAD_MIN_ROWS: padded with ignored rows
    "none": lambda i: False,
    "all": lambda i: True,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("head_rows")
    return {"llama-q8_0": build_tiny_model(d / "llama.gguf", seed=21, arch="llama", dtype="q8_0"),
            "gemma3-softcap": build_tiny_model(d / "gemma.gguf", seed=22, arch="gemma3",
                                               layers=2, hidden=256, heads=2, kv_heads=1,
                                               head_dim=128, ffn=256, tied=True,
                                               final_softcap=3.0, dtype="q4_k")}


def labels_of(tokens, pattern):
    keep = PATTERNS[pattern]
    return [t if keep(i) else IGNORE_INDEX for i, t in enumerate(tokens[1:] + [3])]


def run(path, weights, threads, tokens, labels, full: bool, heads=None):
    """Loss and adapter gradients of one step, through loss() or the full-logits reference;
    the row count of each head call is appended to `heads`."""
    ctx = fu.ExecContext(threads=threads)
    opts = {"f32": {"widen_frozen": True}, "stored": {}, "bf16": {"compute": "bf16"}}[weights]
    model = Model.from_gguf(ctx, path, **opts)
    tr = Trainer(model, TARGETS, fu.lora.LoraConfig(4, 8.0), seed=5)
    for _, ad in tr.named_adapters():
        fu.rng.normal_fill(9, ad.b, 0.0, 0.05)
    head = model.head
    if heads is not None:
        model.head = lambda x: heads.append(x.shape[0]) or head(x)
    with ctx.exec_scope():
        if full:
            logits = tr.forward_logits(tokens, tr.step_counter)
            loss = logits.cross_entropy_ext("vocab", labels, ignore_index=IGNORE_INDEX)
        else:
            loss = tr.loss(tokens, labels)
        loss.backward()
        out = [loss.numpy()]
    out += [t.grad().numpy() for _, ad in tr.named_adapters() for t in (ad.a, ad.b)]
    ctx.close()
    return out


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("weights", ["f32", "stored", "bf16"])
@pytest.mark.parametrize("name", ["llama-q8_0", "gemma3-softcap"])
def test_the_head_on_supervised_rows_keeps_the_bits(files, name, weights, pattern):
    tokens = np.random.default_rng(7).integers(0, 500, SEQ).tolist()
    labels = labels_of(tokens, pattern)
    want = run(files[name], weights, 1, tokens, labels, full=True)
    supervised = sum(PATTERNS[pattern](i) for i in range(SEQ))
    for threads in (1, 2):
        heads = []
        got = run(files[name], weights, threads, tokens, labels, full=False, heads=heads)
        assert heads == [max(supervised, train.HEAD_MIN_ROWS) if supervised < SEQ else SEQ]
        for g, w in zip(got, want):
            assert_bitwise(g, w)
    if pattern == "all":
        assert np.isfinite(want[0]) and want[0] > 0
    if pattern == "none":
        assert float(want[0]) == 0.0


def test_head_rows_keeps_the_supervised_and_fills_up():
    ignored = np.ones(SEQ, bool)
    ignored[[5, 30, 31]] = False
    rows = train.head_rows(ignored)
    assert len(rows) == train.HEAD_MIN_ROWS and {5, 30, 31} <= set(rows.tolist())
    assert list(rows) == sorted(rows)
    ignored[:] = False
    assert train.head_rows(ignored) is None            # all supervised: the whole head
    short = np.ones(train.HEAD_MIN_ROWS, bool)
    short[0] = False
    assert train.head_rows(short) is None              # too short to leave rows out
    ignored[:] = True
    ignored[20:] = False
    assert train.head_rows(ignored).tolist() == list(range(20, SEQ))


def test_bad_labels_are_named_at_their_position(files, ctx1):
    """The labels are checked before any row is dropped: positions in the error are the
    caller's."""
    model = Model.from_gguf(ctx1, files["llama-q8_0"])
    tr = Trainer(model, ("q", "v"), fu.lora.LoraConfig(4, 8.0), seed=5)
    tokens = list(range(1, SEQ + 1))
    labels = [IGNORE_INDEX] * 30 + [2] * (SEQ - 30)
    labels[35] = model.config.vocab
    with ctx1.exec_scope(), pytest.raises(fu.errors.IndexOutOfBounds, match="position 35"):
        tr.loss(tokens, labels)


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("reward", ["acc", "nll"])
def test_es_rewards_on_supervised_rows_keep_the_bytes(tmp_path, monkeypatch, mode, reward):
    """es-finetune scores its members on the supervised positions' logits: the trained
    adapters (or weights) are the bytes of the run with the whole head."""
    from fucina.cli import es_finetune as ef
    path = build_tiny_model(tmp_path / "tiny.gguf", seed=9)
    used = []

    def spy(ignored):
        rows = train.head_rows(ignored)
        used.append(rows is not None)
        return rows
    out = {}
    for name, rows_fn in (("rows", spy), ("full", lambda ignored: None)):
        monkeypatch.setattr(ef, "head_rows", rows_fn)
        save = tmp_path / name
        r = ef.run(ef.Options(model=path, save=str(save), iterations=2, population=4, batch=2,
                              reward=reward, mode=mode, threads=1), out=lambda _: None)
        out[name] = (r.rewards, sorted((p.name, p.read_bytes()) for p in save.iterdir()))
    assert any(used)
    assert out["rows"][1] and out["rows"] == out["full"]
    assert len(set(out["rows"][0])) > 1     # the rewards move: the members were told apart
