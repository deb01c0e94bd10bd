"""tools/export_gguf (SPEC T-23 transcode policy): a verbatim export is byte-identical; matrix
weights are re-encoded byte-for-byte as llama.cpp would (libgguf as the oracle), norms, 1-D
tensors and non-".weight" names keep their type, rows whose ne0 does not fit the block keep the
source type, quantized sources are never chain-requantized, and the gguf package reads every
file written."""
import gguf
import libgguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

import fucina as fu
from tools import export_gguf as ex

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
    with pytest.raises(ValueError):
        ex.plan("output.weight", "f16", (4, 96), "q3_k")
