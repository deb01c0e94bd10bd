"""Safetensors state dicts (SPEC T-16): byte parity with the upstream `safetensors` package,
interop both ways, aliases, strict/non-strict, every error, transactional loads, corrupt input."""
import io
import json
import random
import struct

import numpy as np
import pytest
import safetensors.numpy as stnp
import safetensors.torch as stt
import torch

import fucina as fu
from fucina.io import Alias, NamedTensor
from fucina.io import safetensors as st

from conftest import bits

STORAGE = {"f32": np.uint32, "f16": np.uint16, "bf16": np.uint16, "i64": np.int64}


def _tensor(ctx, dtype, shape, seed, variable=False):
    """A tensor of `dtype` whose storage holds arbitrary bit patterns (NaN payloads, subnormals)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, np.iinfo(STORAGE[dtype]).max, size=shape, dtype=STORAGE[dtype],
                       endpoint=True)
    t = ctx.zeros(shape, tuple(f"d{k}" for k in range(len(shape))), dtype=dtype)
    t.data().reshape(-1).view(STORAGE[dtype])[:] = raw.reshape(-1)
    if variable:  # same bits, but a leaf that requires grad
        v = ctx.variable(np.zeros(shape, np.float32), t.tags, dtype=dtype)
        v.detach().data()[...] = t.data_const()
        return v
    return t


def _oracle(tensors: dict) -> bytes:
    """The upstream serializer's bytes: numpy for f32/f16/i64, torch (same Rust core) for bf16."""
    if any(t.dtype == "bf16" for t in tensors.values()):
        conv = {}
        for k, t in tensors.items():
            a = np.array(t.data_const())
            conv[k] = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if t.dtype == "bf16"
                       else torch.from_numpy(a))
        return stt.save(conv)
    return stnp.save({k: np.array(t.data_const()) for k, t in tensors.items()})


def _save(entries) -> bytes:
    f = io.BytesIO()
    fu.io.save_state_dict(f, entries)
    return f.getvalue()


def _header_keys(data: bytes) -> list:
    (n,) = struct.unpack("<Q", data[:8])
    return list(json.loads(data[8:8 + n]))


NAMES = ["w", "b", "a_1", "A", "layers.0.weight", "layers.10.weight", "layers.2.weight", "é", "z",
         "Z", "\u00ff", "\u4e2d\u6587", "\U0001f600", 'q"uote', "back\\slash", "tab\tnew\nline",
         "ctl\x01\x1f", "del\x7f", "sep\u2028", "x" * 37]


@pytest.mark.parametrize("seed", range(12))
def test_bytes_equal_upstream(ctx1, seed):
    rng = random.Random(seed)
    dtypes = ["f32", "f16", "i64"] + (["bf16"] if seed % 2 else [])
    names = rng.sample(NAMES, rng.randint(1, len(NAMES)))
    tensors = {}
    for k, name in enumerate(names):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice(dtypes)
        tensors[name] = _tensor(ctx1, dtype, shape, seed * 100 + k,
                                variable=k % 3 == 0 and dtype != "i64")
    mine = _save(tensors)
    assert mine == _oracle(tensors)
    assert (struct.unpack("<Q", mine[:8])[0]) % 8 == 0


def test_header_padding_every_residue(ctx1):
    """Header lengths of every residue mod 8 are padded like upstream's."""
    residues = set()
    for n in range(1, 17):
        tensors = {"p" * n: ctx1.tensor([1.0, 2.0], ("a",))}
        mine = _save(tensors)
        assert mine == _oracle(tensors)
        (hlen,) = struct.unpack("<Q", mine[:8])
        residues.add(len(mine[8:8 + hlen].rstrip(b" ")) % 8)
    assert residues == set(range(8))
    assert _save({}) == stnp.save({}) == b"\x08" + b"\0" * 7 + b"{}      "


def test_upstream_ordering_matches_spec(ctx1):
    """SPEC T-16: descending dtype declaration order (I64 > F32 > BF16 > F16), then bytewise name.
    Checked on the oracle itself, so a change upstream would show here."""
    tensors = {}
    for k, (name, dtype) in enumerate([("m", "f16"), ("a", "f32"), ("z", "i64"), ("b", "bf16"),
                                       ("é", "f32"), ("Z", "f32"), ("c", "i64"), ("a", "f16")]):
        tensors[name + dtype] = _tensor(ctx1, dtype, (2,), k)
    keys = _header_keys(_oracle(tensors))
    rank = {"i64": 0, "f32": 1, "bf16": 2, "f16": 3}
    assert keys == sorted(tensors, key=lambda n: (rank[tensors[n].dtype], n.encode()))
    assert keys == _header_keys(_save(tensors))
    assert list(st.DTYPE_ORDER).index("I64") > st.DTYPE_ORDER.index("F32") > \
        st.DTYPE_ORDER.index("BF16") > st.DTYPE_ORDER.index("F16")


def test_named_tensor_list_form_and_round_trip(ctx1, tmp_path):
    src = {"w": _tensor(ctx1, "f32", (3, 2), 1, variable=True), "h": _tensor(ctx1, "f16", (5,), 2),
           "z": _tensor(ctx1, "bf16", (2, 2), 3, variable=True), "i": _tensor(ctx1, "i64", (), 4)}
    listed = [NamedTensor.of(k, t) for k, t in src.items()]
    assert _save(listed) == _save(src) == _oracle(src)

    path = tmp_path / "model.safetensors"
    fu.io.save_state_dict(path, listed)
    assert path.read_bytes() == _oracle(src)
    dest = {k: ctx1.zeros(t.shape, t.tags, dtype=t.dtype) for k, t in src.items()}
    fu.io.load_state_dict(str(path), [NamedTensor(k, t) for k, t in dest.items()])
    for k in src:
        np.testing.assert_array_equal(dest[k].data_const(), src[k].data_const())
    assert src["z"].requires_grad  # loading into variables works and keeps them variables
    vdest = {k: ctx1.variable(np.zeros(t.shape), t.tags, dtype=t.dtype) for k, t in src.items()
             if t.dtype != "i64"}
    fu.io.load_state_dict(path, vdest, strict=False)
    for k, t in vdest.items():
        assert t.requires_grad
        np.testing.assert_array_equal(t.data_const(), src[k].data_const())


def test_upstream_files_load_and_ours_load_upstream(ctx1, tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"emb": rng.standard_normal((4, 3)).astype(np.float32),
              "half": rng.standard_normal(5).astype(np.float16),
              "ids": rng.integers(-50, 50, size=(2, 2)).astype(np.int64)}
    path = tmp_path / "upstream.safetensors"
    stnp.save_file(arrays, str(path), metadata={"format": "np", "note": "metadata is ignored"})
    dest = {"emb": ctx1.zeros((4, 3), ("a", "b")), "half": ctx1.zeros((5,), ("a",), dtype="f16"),
            "ids": ctx1.zeros((2, 2), ("a", "b"), dtype="i64")}
    fu.io.load_state_dict(path, dest)
    for k, a in arrays.items():
        np.testing.assert_array_equal(dest[k].data_const(), a)

    bf = torch.randn(3, 2).to(torch.bfloat16)
    stt.save_file({"bf": bf, "f": torch.ones(2)}, str(tmp_path / "t.safetensors"))
    dbf = ctx1.zeros((3, 2), ("a", "b"), dtype="bf16")
    df = ctx1.zeros((2,), ("a",))
    fu.io.load_state_dict(tmp_path / "t.safetensors", {"bf": dbf, "f": df})
    np.testing.assert_array_equal(dbf.data_const(), bf.view(torch.int16).numpy().view(np.uint16))

    ours = {k: ctx1.tensor(a, tuple("ab"[:a.ndim]), dtype={"float32": "f32", "float16": "f16",
                                                              "int64": "i64"}[a.dtype.name])
            for k, a in arrays.items()}
    back = stnp.load(_save(ours))
    assert set(back) == set(arrays)
    for k, a in arrays.items():
        np.testing.assert_array_equal(back[k], a)
    back = stt.load(_save({"bf": dbf}))
    assert torch.equal(back["bf"], bf)


def test_stream_holds_several_prefixes(ctx1):
    """load reads exactly one safetensors prefix, so files can be concatenated in one stream."""
    a = {"x": _tensor(ctx1, "f32", (3,), 1)}
    b = {"x": _tensor(ctx1, "f32", (3,), 2), "y": _tensor(ctx1, "i64", (2,), 3)}
    f = io.BytesIO(_save(a) + _save(b) + b"tail")
    da = {"x": ctx1.zeros((3,), ("d0",))}
    db = {"x": ctx1.zeros((3,), ("d0",))}
    fu.io.load_state_dict(f, da)
    fu.io.load_state_dict(f, db, strict=False)  # skips y's data
    assert f.read() == b"tail"
    np.testing.assert_array_equal(bits(da["x"].data_const()), bits(a["x"].data_const()))
    np.testing.assert_array_equal(bits(db["x"].data_const()), bits(b["x"].data_const()))


def test_aliases(ctx1):
    data = _save({"enc.w": _tensor(ctx1, "f32", (2,), 1), "enc.b": _tensor(ctx1, "f32", (1,), 2)})
    w, b = ctx1.zeros((2,), ("d0",)), ctx1.zeros((1,), ("d0",))
    dest = {"encoder.w": w, "encoder.b": b}
    with pytest.raises(fu.CheckpointUnknownName, match="'enc.b' matches no destination"):
        fu.io.load_state_dict(io.BytesIO(data), dest)
    rules = [Alias("enc.w", "encoder.w"), Alias("enc.w", "ignored.second.rule"), ("enc.b", "encoder.b")]
    fu.io.load_state_dict(io.BytesIO(data), dest, aliases=rules)
    want = stnp.load(data)
    np.testing.assert_array_equal(w.numpy(), want["enc.w"])
    np.testing.assert_array_equal(b.numpy(), want["enc.b"])
    # an alias maps stream names only: a stream entry already named like a destination is kept
    data2 = _save({"encoder.w": _tensor(ctx1, "f32", (2,), 3), "enc.w": _tensor(ctx1, "f32", (2,), 4)})
    with pytest.raises(fu.CheckpointDuplicateName, match="'encoder.w' is filled by both"):
        fu.io.load_state_dict(io.BytesIO(data2), {"encoder.w": w}, aliases=[Alias("enc.w", "encoder.w")])
    with pytest.raises(TypeError, match="Alias"):
        fu.io.load_state_dict(io.BytesIO(data), dest, aliases=["enc.w"])


def test_strict_and_non_strict(ctx1):
    src = {"a": _tensor(ctx1, "f32", (2,), 1), "b": _tensor(ctx1, "f16", (3,), 2),
           "extra": _tensor(ctx1, "i64", (4,), 3)}
    data = _save(src)
    a, b = ctx1.zeros((2,), ("d0",)), ctx1.zeros((3,), ("d0",), dtype="f16")
    keep = ctx1.tensor([9.0, 8.0], ("d0",))
    with pytest.raises(fu.CheckpointUnknownName, match="'extra'"):
        fu.io.load_state_dict(io.BytesIO(data), {"a": a, "b": b})
    with pytest.raises(fu.CheckpointMissingEntry, match=r"\['keep'\]"):
        fu.io.load_state_dict(io.BytesIO(data), {"a": a, "b": b, "extra": ctx1.zeros((4,), ("d0",),
                                                                                      dtype="i64"),
                                                 "keep": keep})
    assert not a.numpy().any()
    fu.io.load_state_dict(io.BytesIO(data), {"a": a, "b": b, "keep": keep}, strict=False)
    np.testing.assert_array_equal(bits(a.data_const()), bits(src["a"].data_const()))
    np.testing.assert_array_equal(bits(b.data_const()), bits(src["b"].data_const()))
    np.testing.assert_array_equal(keep.numpy(), [9.0, 8.0])  # absent from the stream: unchanged


def test_save_errors_write_nothing(ctx1):
    t = ctx1.tensor([1.0, 2.0], ("a",))
    m = ctx1.tensor(np.zeros((2, 3), np.float32), ("a", "b"))
    cases = [({"": t}, fu.CheckpointInvalidName, "non-empty"),
             ({"a\0b": t}, fu.CheckpointInvalidName, "NUL-free"),
             ({"__metadata__": t}, fu.CheckpointInvalidName, "__metadata__"),
             ({"bad\ud800": t}, fu.CheckpointInvalidName, "lone surrogate"),
             ({7: t}, fu.CheckpointInvalidName, "expected a str name, got int"),
             ([NamedTensor("x", t), NamedTensor("x", t)], fu.CheckpointDuplicateName, "'x' twice"),
             ({"mask": ctx1.tensor([True], ("a",), dtype="bool")}, fu.CheckpointUnsupportedDtype,
              r"entry 'mask': expected dtype in \('f32', 'f16', 'bf16', 'i64'\), got bool"),
             ({"ok": t, "view": m.narrow("b", 0, 2)}, fu.NonContiguousParam, "entry 'view'")]
    for entries, err, match in cases:
        f = io.BytesIO()
        with pytest.raises(err, match=match):
            fu.io.save_state_dict(f, entries)
        assert f.getvalue() == b""
    with pytest.raises(TypeError, match="NamedTensor"):
        fu.io.save_state_dict(io.BytesIO(), [("x", t)])
    with pytest.raises(fu.DTypeError, match="NamedTensor.of: entry 'mask'"):
        NamedTensor.of("mask", ctx1.tensor([True], ("a",), dtype="bool"))
    with pytest.raises(fu.NonContiguousParam, match="NamedTensor.of"):
        NamedTensor.of("v", m.narrow("b", 1, 2))


def _header_file(header, data=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_load_errors(ctx1):
    good = _save({"w": _tensor(ctx1, "f32", (2, 2), 1)})
    w = ctx1.zeros((2, 2), ("a", "b"))

    def fails(data, err, match, dest=None, **kw):
        d = dest if dest is not None else {"w": w}
        ts = list(d.values()) if isinstance(d, dict) else [e.tensor for e in d]
        before = [bits(t.data_const()).copy() for t in ts]
        with pytest.raises(err, match=match):
            fu.io.load_state_dict(io.BytesIO(data), d, **kw)
        for t, b in zip(ts, before):
            np.testing.assert_array_equal(bits(t.data_const()), b)

    fails(good, fu.CheckpointDtypeMismatch, "'w' -> 'w': expected F16, got F32",
          {"w": ctx1.zeros((2, 2), ("a", "b"), dtype="f16")})
    fails(good, fu.CheckpointShapeMismatch, r"expected shape \[4\], got \[2, 2\]",
          {"w": ctx1.zeros((4,), ("a",))})
    fails(good, fu.CheckpointShapeMismatch, r"expected shape \[2, 1\], got \[2, 2\]",
          {"w": ctx1.zeros((2, 1), ("a", "b"))})
    fails(good, fu.CheckpointDuplicateName, "unique names", [NamedTensor("w", w), NamedTensor("w", w)])
    f64 = stnp.save({"w": np.zeros((2, 2), np.float64)})
    fails(f64, fu.CheckpointDtypeMismatch, "expected F32, got F64")
    fu.io.load_state_dict(io.BytesIO(f64), {}, strict=False)  # an unmatched F64 entry is skipped
    fails(good[:-1], fu.InvalidDataLength, "the data of 'w'")
    fails(good[:5], fu.InvalidDataLength, "header length")
    fails(good[:20], fu.InvalidDataLength, "the safetensors header: expected")
    fails(struct.pack("<Q", 100_000_001) + good[8:], fu.CheckpointMagicMismatch, "at most 100000000")
    fails(struct.pack("<Q", 2**64 - 1), fu.CheckpointMagicMismatch, "at most")
    fails(_header_file(b"{not json}"), fu.CheckpointMagicMismatch, "unparseable")
    fails(_header_file(b"\xff\xfe{}"), fu.CheckpointMagicMismatch, "unparseable")
    fails(_header_file(b'{"w": NaN}'), fu.CheckpointMagicMismatch, "unparseable")
    fails(_header_file([1, 2]), fu.CheckpointMagicMismatch, "JSON object header, got list")
    fails(_header_file({"w": 3}), fu.CheckpointMagicMismatch, "tensor record, got int")
    fails(_header_file({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 4]}}),
          fu.CheckpointUnsupportedDtype, "got 'F7'")
    fails(_header_file({"w": {"dtype": "F32", "shape": [1, True], "data_offsets": [0, 4]}}),
          fu.CheckpointMagicMismatch, "shape")
    fails(_header_file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}),
          fu.CheckpointMagicMismatch, "shape")
    fails(_header_file({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}),
          fu.CheckpointMagicMismatch, "data_offsets")
    fails(_header_file({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [4, 20]}}, bytes(20)),
          fu.CheckpointShapeMismatch, r"expected data_offsets \[0, 16\].*got \[4, 20\]")
    fails(_header_file({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, bytes(12)),
          fu.CheckpointShapeMismatch, r"got \[0, 12\]")
    fails(_header_file({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)),
          fu.CheckpointShapeMismatch, "whole bytes")
    fails(_header_file(b'{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, '
                       b'"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]}}', bytes(32)),
          fu.CheckpointDuplicateName, "names 'w' twice")
    fails(_header_file({"": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, bytes(4)),
          fu.CheckpointInvalidName, "non-empty")
    fails(_header_file({"__metadata__": {"k": 1}}), fu.CheckpointMagicMismatch, "strings to strings")
    fails(_header_file({"__metadata__": {"k": "v"}, "w": {"dtype": "F32", "shape": [2, 2],
                                                         "data_offsets": [0, 16]}}, bytes(16)),
          fu.CheckpointMissingEntry, "'x'", {"w": w, "x": ctx1.zeros((1,), ("a",))})


def test_failure_after_earlier_entries_is_transactional(ctx1):
    """The last entry in file order mismatches: the ones before it stay untouched."""
    src = {"a": _tensor(ctx1, "i64", (3,), 1), "b": _tensor(ctx1, "f32", (2,), 2),
           "c": _tensor(ctx1, "f16", (2,), 3)}
    data = _save(src)
    dest = {"a": ctx1.zeros((3,), ("d0",), dtype="i64"), "b": ctx1.zeros((2,), ("d0",)),
            "c": ctx1.zeros((3,), ("d0",), dtype="f16")}
    with pytest.raises(fu.CheckpointShapeMismatch, match="'c'"):
        fu.io.load_state_dict(io.BytesIO(data), dest)
    assert not any(t.numpy().any() for t in dest.values())


def test_truncation_at_every_byte(ctx1):
    src = {"a": _tensor(ctx1, "i64", (2,), 1), "b": _tensor(ctx1, "f32", (2, 2), 2),
           "c": _tensor(ctx1, "bf16", (3,), 3), "d": _tensor(ctx1, "f16", (), 4)}
    data = _save(src)
    dest = {k: _tensor(ctx1, t.dtype, t.shape, 99 + i) for i, (k, t) in enumerate(src.items())}
    before = {k: bits(t.data_const()).copy() for k, t in dest.items()}
    for k in range(len(data)):
        with pytest.raises(fu.FucinaError):
            fu.io.load_state_dict(io.BytesIO(data[:k]), dest)
        for name, t in dest.items():
            np.testing.assert_array_equal(bits(t.data_const()), before[name])
    fu.io.load_state_dict(io.BytesIO(data), dest)
    for name, t in dest.items():
        np.testing.assert_array_equal(bits(t.data_const()), bits(src[name].data_const()))


def test_random_corruptions(ctx1):
    """Hundreds of corrupted files: a FucinaError with destinations unchanged, or a load whose
    result re-saves to exactly the bytes that were read."""
    src = {"a": _tensor(ctx1, "i64", (2,), 1), "b": _tensor(ctx1, "f32", (2, 2), 2),
           "c": _tensor(ctx1, "bf16", (3,), 3)}
    good = _save(src)
    (n,) = struct.unpack("<Q", good[:8])
    rng = random.Random(7)
    dest = {k: ctx1.zeros(t.shape, t.tags, dtype=t.dtype) for k, t in src.items()}
    counts = {"error": 0, "loaded": 0}
    for trial in range(400):
        data = bytearray(good)
        kind = trial % 4
        if kind == 0:  # anywhere
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:  # inside the JSON header, with JSON-ish characters
            for _ in range(rng.randint(1, 3)):
                data[8 + rng.randrange(n)] = ord(rng.choice('{}[]",:0123456789 FIabc\\'))
        elif kind == 2:  # the length field
            data[:8] = struct.pack("<Q", max(0, n + rng.randint(-16, 16)))
        else:  # the data section only: loads, with the corrupted values
            pos = 8 + n + rng.randrange(len(data) - 8 - n)
            data[pos] ^= 1 << rng.randrange(8)
        before = {k: bits(t.data_const()).copy() for k, t in dest.items()}
        try:
            fu.io.load_state_dict(io.BytesIO(bytes(data)), dest)
        except fu.FucinaError:
            counts["error"] += 1
            for k, t in dest.items():
                np.testing.assert_array_equal(bits(t.data_const()), before[k])
            continue
        counts["loaded"] += 1
        resaved = _save(dest)
        if kind == 3:
            assert resaved == bytes(data)
        else:  # a header edit that still parses (e.g. whitespace): the payload must match
            assert resaved[8 + n:] == bytes(data[-(len(good) - 8 - n):])
    assert counts["error"] > 150 and counts["loaded"] >= 100, counts


def test_save_streams_payload_from_storage(ctx1):
    """The payload goes out as views of tensor storage, one write per tensor: no file-sized
    bytes object is built."""
    big = ctx1.zeros((256, 1024), ("a", "b"))
    small = ctx1.tensor([1, 2], ("a",), dtype="i64")

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, b):
            self.writes.append(b)
            return len(memoryview(b).cast("B"))

    r = Recorder()
    fu.io.save_state_dict(r, {"big": big, "small": small})
    assert [len(memoryview(b).cast("B")) for b in r.writes[1:]] == [16, 256 * 1024 * 4]
    assert len(r.writes[0]) % 8 == 0
    for b, t in zip(r.writes[1:], (small, big)):
        assert np.shares_memory(np.frombuffer(b, np.uint8), t.data_const())


def test_partial_writes_are_completed(ctx1):
    """A raw stream may take part of a buffer per write call; every byte still goes out."""
    t = _tensor(ctx1, "f32", (64, 33), 1)

    class Dribble(io.RawIOBase):
        def __init__(self):
            self.data = bytearray()

        def writable(self):
            return True

        def write(self, b):
            b = memoryview(b).cast("B")[:7]
            self.data += b
            return len(b)

    out = Dribble()
    fu.io.save_state_dict(out, {"t": t})
    assert bytes(out.data) == _oracle({"t": t})
    out = Dribble()
    fu.io.save_tensors(out, [t])
    ref = io.BytesIO()
    fu.io.save_tensors(ref, [t])
    assert bytes(out.data) == ref.getvalue()
