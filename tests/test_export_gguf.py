"""tools/export_gguf (SPEC T-23 transcode policy): a verbatim export is byte-identical; matrix
weights are re-encoded byte-for-byte as llama.cpp would (libgguf as the oracle), norms, 1-D
tensors and non-".weight" names keep their type, rows whose ne0 does not fit the block keep the
source type, quantized sources are never chain-requantized, and the gguf package reads every
file written. The merge half: LoRA adapters (a safetensors file written by the safetensors
package) merged into f32/f16/bf16 bases of a synthetic Qwen3-shaped model equal W + (α/r)·B·A
computed in numpy, every other tensor stays byte-identical, every merge error, and the
merge-then-quantize flow."""
import os
import gguf
import libgguf
import numpy as np
import pytest
import safetensors.numpy
from gguf import GGMLQuantizationType as GT

import fucina as fu
from fucina.cli import export as ex

RNG = np.random.default_rng(31)


def f32(*shape):
    return (RNG.standard_normal(shape) * 0.05).astype(np.float32)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_token_list(["<s>", "a", "b"])
    ts = {"token_embd.weight": f32(64, 256), "blk.0.attn_q.weight": f32(32, 256).astype(np.float16),
          "blk.0.attn_norm.weight": f32(256), "blk.0.ffn_odd.weight": f32(8, 100),
          "rope_freqs": f32(32, 2)}
    for name, a in ts.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, ts


def read_types(path):
    r = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type, np.array(t.data)) for t in r.tensors}


def test_verbatim_is_byte_identical(model, tmp_path):
    src, _ = model
    out = tmp_path / "out.gguf"
    report = ex.export(str(src), str(out), "verbatim", log=lambda *_: None)
    assert out.read_bytes() == src.read_bytes()
    assert all(why == "verbatim" for _, why in report.values())


@pytest.mark.parametrize("target,gt", [("q4_k", GT.Q4_K), ("q6_k", GT.Q6_K), ("q8_0", GT.Q8_0)])
def test_quantized_targets(model, tmp_path, target, gt):
    src, ts = model
    out = tmp_path / f"{target}.gguf"
    lines = []
    report = ex.export(str(src), str(out), target, log=lines.append)
    got = read_types(out)
    for name in ("token_embd.weight", "blk.0.attn_q.weight"):
        assert report[name][0] == target and got[name][0] == gt
        want = libgguf.quantize_rows(ts[name].astype(np.float32), int(gt))
        assert np.array_equal(got[name][1].view(np.uint8).reshape(want.shape), want), name
    assert got["blk.0.attn_norm.weight"][0] == GT.F32          # a norm keeps its type
    assert got["rope_freqs"][0] == GT.F32                       # not a ".weight"
    assert got["blk.0.ffn_odd.weight"][0] == GT.F32             # ne0 = 100 fits no block here
    assert "not a multiple" in report["blk.0.ffn_odd.weight"][1]
    assert len(lines) == len(ts) + 1 and "wrote" in lines[-1]
    meta = gguf.GGUFReader(str(out)).fields
    assert int(meta["llama.context_length"].parts[-1][0]) == 128


def test_dense_targets(model, tmp_path):
    src, ts = model
    out = tmp_path / "f16.gguf"
    ex.export(str(src), str(out), "f16", log=lambda *_: None)
    got = read_types(out)
    assert got["token_embd.weight"][0] == GT.F16
    assert np.array_equal(got["token_embd.weight"][1], ts["token_embd.weight"].astype(np.float16))
    assert got["blk.0.attn_q.weight"][0] == GT.F16                        # already f16: kept
    assert got["blk.0.ffn_odd.weight"][0] == GT.F16                       # dense: no block rule
    out = tmp_path / "bf16.gguf"
    ex.export(str(src), str(out), "bf16", log=lambda *_: None)
    with fu.ExecContext() as ctx:
        f = fu.gguf.read(out, ctx)
        assert f.tensors["blk.0.attn_q.weight"].dtype == "bf16"
        np.testing.assert_allclose(f.tensors["blk.0.attn_q.weight"].numpy(),
                                   ts["blk.0.attn_q.weight"].astype(np.float32), rtol=1e-2, atol=1e-4)
        del f


def test_quantized_source_is_never_requantized(tmp_path):
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", libgguf.quantize_rows(f32(4, 256), int(GT.Q8_0)),
                 raw_dtype=GT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "o.gguf"
    with pytest.raises(fu.QuantizedSourceUnsupported, match="stored as q8_0"):
        ex.export(str(path), str(out), "q4_k", log=lambda *_: None)
    assert not out.exists()
    assert ex.main(["--from-gguf", str(path), "--out", str(out), "--dtype", "q6_k"]) == 1
    assert not out.exists()
    ex.export(str(path), str(out), "q8_0", log=lambda *_: None)   # already the target: kept
    assert out.read_bytes() == path.read_bytes()
    assert ex.main(["--from-gguf", str(path), "--out", str(out)]) == 0


def test_plan_rules():
    assert ex.plan("x.weight", "f32", (4, 256), "verbatim") == ("f32", "verbatim")
    assert ex.plan("blk.0.ffn_norm.weight", "f32", (4, 256), "q4_k")[0] == "f32"
    assert ex.plan("output.weight", "bf16", (4, 512), "tq2_0") == ("tq2_0", "bf16 -> tq2_0")
    assert ex.plan("output.weight", "f16", (4, 96), "q8_0") == ("q8_0", "f16 -> q8_0")
    assert ex.plan("output.weight", "f16", (4, 96), "q5_k")[0] == "f16"
    with pytest.raises(fu.InvalidExportOption, match="q3_k"):
        ex.plan("output.weight", "f16", (4, 96), "q3_k")


# ---------------------------------------------------------------------------------------------
# LoRA merge (SPEC T-23 merge policy) on a small synthetic Qwen3-shaped model

EMBED, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 96, 40, 2
ALPHA = 16.0
ADAPTED = {"layers.0.q": ("blk.0.attn_q.weight", 4), "layers.1.v": ("blk.1.attn_v.weight", 2),
           "layers.1.down": ("blk.1.ffn_down.weight", 3), "layers.0.o": ("blk.0.attn_output.weight", 2)}


def bf16_bits(a):
    """f32 -> bf16 bits, round to nearest even (SPEC R-9), numpy only."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def qwen3_tensors():
    """name -> float32 array, shaped like a Qwen3 checkpoint ([out, in] matrices)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    ts = {"token_embd.weight": f32(VOCAB, EMBED)}
    for i in range(LAYERS):
        ts.update({f"blk.{i}.attn_norm.weight": f32(EMBED), f"blk.{i}.attn_q.weight": f32(q, EMBED),
                   f"blk.{i}.attn_k.weight": f32(kv, EMBED), f"blk.{i}.attn_v.weight": f32(kv, EMBED),
                   f"blk.{i}.attn_output.weight": f32(EMBED, q), f"blk.{i}.attn_q_norm.weight": f32(HEAD_DIM),
                   f"blk.{i}.attn_k_norm.weight": f32(HEAD_DIM), f"blk.{i}.ffn_norm.weight": f32(EMBED),
                   f"blk.{i}.ffn_gate.weight": f32(FFN, EMBED), f"blk.{i}.ffn_up.weight": f32(FFN, EMBED),
                   f"blk.{i}.ffn_down.weight": f32(EMBED, FFN)})
    ts.update({"output_norm.weight": f32(EMBED), "output.weight": f32(VOCAB, EMBED)})
    return ts


def write_qwen3(path, dtype, quantized=()):
    """The model with its matrices stored as `dtype` (norms f32; names in `quantized`: q8_0);
    returns name -> the stored values as float32."""
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(LAYERS)
    w.add_embedding_length(EMBED)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(128)
    stored = {}
    for name, a in qwen3_tensors().items():
        if name in quantized:
            w.add_tensor(name, libgguf.quantize_rows(a, int(GT.Q8_0)), raw_dtype=GT.Q8_0)
        elif a.ndim == 1 or dtype == "f32":
            w.add_tensor(name, a)
            stored[name] = a
        elif dtype == "f16":
            w.add_tensor(name, a.astype(np.float16))
            stored[name] = a.astype(np.float16).astype(np.float32)
        else:
            bits = bf16_bits(a)
            w.add_tensor(name, bits.view(np.uint8), raw_dtype=GT.BF16)
            stored[name] = bf16_value(bits)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def write_adapters(path, entries=None):
    """A LoRA state dict (A [r, in], B [out, r], trained-looking nonzero B) for ADAPTED."""
    if entries is None:
        shapes = {name: a.shape for name, a in qwen3_tensors().items()}
        entries = {}
        for prefix, (tensor, rank) in ADAPTED.items():
            out, inn = shapes[tensor]
            entries[prefix + ".lora_a"] = f32(rank, inn) * 20
            entries[prefix + ".lora_b"] = f32(out, rank) * 20
    safetensors.numpy.save_file(entries, str(path))
    return entries


def numpy_merge(w, a, b):
    """w + (alpha/r)·B·A in float64 (scale = f32(alpha)/f32(r), as SPEC T-20)."""
    scale = float(np.float32(ALPHA) / np.float32(a.shape[0]))
    return w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))


def raw_tensors(path):
    r = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type, np.array(t.data).tobytes()) for t in r.tensors}


def quiet(*_):
    pass


def merged_values(kind, data, shape):
    if kind == GT.F32:
        return np.frombuffer(data, np.float32).reshape(shape)
    if kind == GT.F16:
        return np.frombuffer(data, np.float16).reshape(shape)
    return np.frombuffer(data, np.uint16).reshape(shape)


@pytest.mark.parametrize("dtype,gt", [("f32", GT.F32), ("f16", GT.F16), ("bf16", GT.BF16)],
                         ids=["f32", "f16", "bf16"])
def test_merge(tmp_path, dtype, gt):
    src, out, ad_path = tmp_path / "m.gguf", tmp_path / "merged.gguf", tmp_path / "a.safetensors"
    stored = write_qwen3(src, dtype)
    ad = write_adapters(ad_path)
    report = ex.export(str(src), str(out), adapters=str(ad_path), alpha=ALPHA, log=quiet)
    before, after = raw_tensors(src), raw_tensors(out)
    assert list(after) == list(before)
    merged = {tensor for tensor, _ in ADAPTED.values()}
    for name in before:
        if name not in merged:   # untouched tensors: byte-identical
            assert after[name] == before[name], name
            assert report[name][1] == "verbatim"
    for prefix, (tensor, rank) in ADAPTED.items():
        kind, data = after[tensor]
        assert kind == gt and report[tensor][0] == dtype and prefix in report[tensor][1]
        want = numpy_merge(stored[tensor], ad[prefix + ".lora_a"], ad[prefix + ".lora_b"])
        got = merged_values(kind, data, want.shape)
        if dtype == "f32":
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        else:   # the f32 merge then one rounding: at most one step of the 16-bit grid apart
            want32 = want.astype(np.float32)
            if dtype == "f16":
                want16, got32 = want32.astype(np.float16), got.astype(np.float32)
                step = np.spacing(np.abs(want16)).astype(np.float32)
                assert (np.abs(got32 - want32) <= step).all()
                assert (got == want16).mean() > 0.95
            else:
                want16, got32 = bf16_bits(want32), bf16_value(got)
                step = bf16_value(bf16_bits(np.abs(want32)) + 1) - bf16_value(bf16_bits(np.abs(want32)))
                assert (np.abs(got32 - want32) <= step).all()
                assert (got == want16).mean() > 0.95
        assert np.abs(got.astype(np.float32) if dtype != "bf16" else bf16_value(got)).max() > 0
        assert not np.allclose(want, stored[tensor], atol=1e-3)   # the adapter really moved it
    with fu.ExecContext() as ctx:   # the merged model loads, metadata unchanged
        f, g = fu.gguf.read(src, ctx), fu.gguf.read(out, ctx)
        assert dict(g.metadata) == dict(f.metadata) and g.metadata.types == f.metadata.types
        del f, g


def test_merge_then_quantize(tmp_path):
    """The D-5 flow: merge into the f16 model, then --dtype q8_0 the merged file; the same bytes
    as one run given both (merge first, then transcode)."""
    src, ad_path = tmp_path / "m.gguf", tmp_path / "ckpt"
    stored = write_qwen3(src, "f16")
    ad_path.mkdir()   # a checkpoint directory (SPEC T-19): its adapters.safetensors
    ad = write_adapters(ad_path / "adapters.safetensors")
    merged, quant, both = tmp_path / "merged.gguf", tmp_path / "q8.gguf", tmp_path / "both.gguf"
    assert ex.main(["--from-gguf", str(src), "--out", str(merged), "--adapters", str(ad_path),
                    "--alpha", "16"]) == 0
    assert ex.main(["--from-gguf", str(merged), "--out", str(quant), "--dtype", "q8_0"]) == 0
    with fu.ExecContext() as ctx:
        f = fu.gguf.read(quant, ctx)
        for prefix, (tensor, _) in ADAPTED.items():
            w = f.tensors[tensor]
            assert w.dtype == "q8_0"
            want = numpy_merge(stored[tensor], ad[prefix + ".lora_a"], ad[prefix + ".lora_b"])
            got = w.to("f32").numpy()
            np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() / 100)
            assert np.array_equal(got, libgguf.dequantize_rows(np.array(w.data_const()), int(GT.Q8_0))
                                  .reshape(got.shape))
        del f
    report = ex.export(str(src), str(both), "q8_0", adapters=str(ad_path), alpha=ALPHA, log=quiet)
    assert both.read_bytes() == quant.read_bytes()
    assert report["blk.0.attn_q.weight"][0] == "q8_0" and "f16 -> q8_0" in report["blk.0.attn_q.weight"][1]
    assert report["blk.0.attn_q.weight"][1].startswith("merged layers.0.q")


def test_merge_errors(tmp_path):
    src, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
    write_qwen3(src, "f32")
    good = write_adapters(tmp_path / "good.safetensors")
    a, b = good["layers.0.q.lora_a"], good["layers.0.q.lora_b"]

    def run(entries, err, match=None, **kw):
        path = tmp_path / "bad.safetensors"
        write_adapters(path, entries)
        with pytest.raises(err, match=match):
            ex.export(str(src), str(out), adapters=str(path), alpha=ALPHA, log=quiet, **kw)
        assert not out.exists()

    with pytest.raises(fu.MissingAlpha):
        ex.export(str(src), str(out), adapters=str(tmp_path / "good.safetensors"), log=quiet)
    assert ex.main(["--from-gguf", str(src), "--out", str(out), "--adapters",
                    str(tmp_path / "good.safetensors")]) == 1
    assert ex.main(["--from-gguf", str(src), "--out", str(out), "--alpha", "16"]) == 1
    assert not out.exists()
    with pytest.raises(fu.InvalidExportOption, match="--alpha"):
        ex.export(str(src), str(out), alpha=ALPHA, log=quiet)
    for bad_alpha in (float("nan"), float("inf"), True):
        with pytest.raises(fu.InvalidExportOption, match="finite --alpha"):
            ex.export(str(src), str(out), adapters=str(tmp_path / "good.safetensors"),
                      alpha=bad_alpha, log=quiet)
    with pytest.raises(fu.InvalidExportOption, match="--dtype"):
        ex.export(str(src), str(out), "q3_k", log=quiet)
    assert issubclass(fu.InvalidExportOption, (fu.FucinaError, ValueError))
    assert not out.exists()
    for bad in ("layers.0.qq.lora_a", "model.layers.0.q.lora_a", "layers.01.q.lora_a",
                "layers.0.q.lora_c", "layers.x.q.lora_a"):
        run({bad: a, "layers.0.q.lora_b": b}, fu.UnknownAdapterName, bad.replace(".", r"\."))
    run({"layers.7.q.lora_a": a, "layers.7.q.lora_b": b}, fu.UnknownAdapterName, "blk.7.attn_q.weight")
    run({"layers.0.q.lora_a": a}, fu.MissingLoraB, "layers.0.q")
    run({"layers.0.q.lora_a": a, "layers.0.q.lora_b": b, "layers.1.k.lora_b": b}, fu.OrphanLoraB,
        "layers.1.k")
    run({}, fu.NoAdaptersFound)
    with pytest.raises(fu.NoAdaptersFound, match="adapters.safetensors"):
        ex.export(str(src), str(out), adapters=str(tmp_path), alpha=ALPHA, log=quiet)   # no such file
    run({"layers.0.q.lora_a": a.astype(np.float16), "layers.0.q.lora_b": b}, fu.InvalidStateDict, "F16")
    run({"layers.0.q.lora_a": a[None], "layers.0.q.lora_b": b}, fu.InvalidStateDict, "rank-2")
    run({"layers.0.q.lora_a": a, "layers.0.q.lora_b": b.astype(np.float64)}, fu.InvalidStateDict, "F64")
    run({"layers.0.q.lora_a": a[:, :32], "layers.0.q.lora_b": b}, fu.ShapeMismatch, "blk.0.attn_q")
    run({"layers.0.q.lora_a": a[:2], "layers.0.q.lora_b": b}, fu.ShapeMismatch, "same rank")
    assert issubclass(fu.InvalidStateDict, fu.FucinaError)
    qsrc = tmp_path / "q.gguf"
    write_qwen3(qsrc, "f32", quantized={"blk.0.attn_q.weight"})
    ok = tmp_path / "ok.safetensors"   # the quantized tensor untouched by the adapters: fine
    write_adapters(ok, {k: v for k, v in good.items() if not k.startswith("layers.0.q.")})
    ex.export(str(qsrc), str(out), adapters=str(ok), alpha=ALPHA, log=quiet)
    assert raw_tensors(out)["blk.0.attn_q.weight"] == raw_tensors(qsrc)["blk.0.attn_q.weight"]


def test_merge_into_a_quantized_base_is_one_command(tmp_path):
    """Issue 16 item 6: a q8_0 base is decoded exactly, merged, and written at --dtype; with
    verbatim the merged tensors are f32 and the untouched ones keep their bytes."""
    src, ad = tmp_path / "q.gguf", tmp_path / "a.safetensors"
    write_qwen3(src, "f32", quantized={"blk.0.attn_q.weight", "blk.1.attn_v.weight",
                                       "blk.0.ffn_up.weight"})
    entries = write_adapters(ad)
    ctx = fu.ExecContext(threads=1)
    base = fu.gguf.read(str(src), ctx)
    for target, want_type in (("verbatim", GT.F32), ("f16", GT.F16), ("q8_0", GT.Q8_0)):
        out = tmp_path / f"m-{target}.gguf"
        ex.export(str(src), str(out), target, adapters=str(ad), alpha=ALPHA, log=quiet)
        got = raw_tensors(out)
        name = "blk.0.attn_q.weight"
        w = base.tensors[name].to("f32").numpy()
        merged = numpy_merge(w, entries["layers.0.q.lora_a"], entries["layers.0.q.lora_b"])
        assert got[name][0] == want_type
        back = fu.gguf.read(str(out), ctx).tensors[name].to("f32").numpy()
        tol = {"verbatim": 1e-6, "f16": 2e-3, "q8_0": 2e-2}[target]
        np.testing.assert_allclose(back, merged, rtol=0, atol=tol * np.abs(merged).max())
        untouched = "blk.0.ffn_up.weight"       # quantized, no adapter
        if target == "verbatim":
            assert got[untouched] == raw_tensors(src)[untouched]
        else:
            assert got[untouched][0] == want_type


def test_lora_gguf_for_llama_cpp(tmp_path):
    """Issue 16 item 4: llama.cpp's adapter GGUF, read back with the gguf package, holds our
    A and B with the metadata llama.cpp checks, and W + scale·B·A equals our merge."""
    src, ad, out = tmp_path / "m.gguf", tmp_path / "a.safetensors", tmp_path / "lora.gguf"
    write_qwen3(src, "f32")
    entries = write_adapters(ad)
    shapes = ex.lora_gguf(str(src), str(out), str(ad), ALPHA, log=quiet)
    r = gguf.GGUFReader(str(out))
    field = lambda k: r.fields[k].contents()
    assert field("general.type") == "adapter" and field("adapter.type") == "lora"
    assert field("general.architecture") == "qwen3"
    assert field("adapter.lora.alpha") == pytest.approx(ALPHA)
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == set(shapes)
    merged_out = tmp_path / "merged.gguf"
    ex.export(str(src), str(merged_out), adapters=str(ad), alpha=ALPHA, log=quiet)
    merged = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(merged_out)).tensors}
    base = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(src)).tensors}
    for prefix, (a_name, b_name) in {k[:-len(".lora_a")]: (k, k[:-1] + "b")
                                     for k in tensors if k.endswith(".lora_a")}.items():
        a, b = np.array(tensors[a_name].data), np.array(tensors[b_name].data)
        # ggml ne order: lora_a ne = [in, rank], lora_b ne = [rank, out]
        w = base[prefix]
        assert list(tensors[a_name].shape) == [w.shape[1], a.shape[0]]
        assert list(tensors[b_name].shape) == [a.shape[0], w.shape[0]]
        scale = float(np.float32(ALPHA) / np.float32(a.shape[0]))
        want = w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
        np.testing.assert_allclose(merged[prefix], want, rtol=0, atol=1e-5 * np.abs(want).max())
    layer, target = next(iter(entries)).split(".")[1:3]
    key = f"blk.{layer}.{ex.GGUF_TENSOR[target]}.weight.lora_a"
    assert np.array_equal(np.array(tensors[key].data), entries[f"layers.{layer}.{target}.lora_a"])
    # the command line: one of --out / --lora-gguf, adapters required
    assert ex.main(["--from-gguf", str(src), "--lora-gguf", str(tmp_path / "x.gguf"),
                    "--adapters", str(ad), "--alpha", str(ALPHA)]) == 0
    with pytest.raises(SystemExit):
        ex.main(["--from-gguf", str(src), "--lora-gguf", str(out)])
    with pytest.raises(SystemExit):
        ex.main(["--from-gguf", str(src)])



def test_merge_export_is_bitwise_equal_at_1_and_2_threads(tmp_path, monkeypatch):
    """The export's context takes os.cpu_count() threads: a quantized base merged and written at
    f32, f16 and q8_0 gives the same bytes with 1 and with 2 threads."""
    src, ad = tmp_path / "q.gguf", tmp_path / "a.safetensors"
    write_qwen3(src, "f32", quantized={"blk.0.attn_q.weight", "blk.1.attn_v.weight"})
    write_adapters(ad)
    for target in ("verbatim", "f16", "q8_0"):
        files = []
        for threads in (1, 2):
            monkeypatch.setattr(os, "cpu_count", lambda n=threads: n)
            out = tmp_path / f"m-{target}-{threads}.gguf"
            ex.export(str(src), str(out), target, adapters=str(ad), alpha=ALPHA, log=quiet)
            files.append(out.read_bytes())
        assert files[0] == files[1], target
