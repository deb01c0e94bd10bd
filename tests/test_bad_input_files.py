"""Bad-input battery for the file loaders (issue 20 item 6, the file part): FZT1/FZT2 tensor
files, safetensors state dicts, optimizer frames (bare and in their CRC32 envelope) and
checkpoint directories — truncation at every offset, flipped bytes, lying sizes and offsets,
unknown types. Each case asserts the exact FucinaError subclass, raised in-process, and that
the destinations are unchanged (loads are transactional)."""
import io
import json
import struct
import zlib

import numpy as np
import pytest

import fucina as fu
from conftest import bits, feed_grad as feed

F = np.float32
A = np.arange(6, dtype=F).reshape(2, 3) / 7
B = np.linspace(-1, 1, 4).astype(F)


@pytest.fixture(scope="module")
def mctx():
    c = fu.ExecContext()
    yield c
    c.close()


def _dests(ctx):
    return [ctx.variable(np.full((2, 3), 5, F), ("o", "i")), ctx.tensor(np.full(4, 5, F), ("i",))]


def _unchanged(dests):
    for d in dests:
        assert np.all(d.numpy() == 5)


# ---- FZT1 / FZT2 -------------------------------------------------------------------------------

def _fzt(mctx, checksum):
    f = io.BytesIO()
    fu.io.save_tensors(f, [mctx.tensor(A, ("o", "i")), mctx.tensor(B, ("i",))], checksum=checksum)
    return f.getvalue()


def _load_fzt(mctx, data, err):
    d = _dests(mctx)
    with pytest.raises(fu.FucinaError) as e:
        fu.io.load_tensors(io.BytesIO(data), d)
    assert e.type is err, (e.type, e.value)
    _unchanged(d)


FZT1_LEN, FZT2_LEN = 4 + 4 + (4 + 16 + 24) + (4 + 8 + 16), 4 + 4 + (4 + 16 + 24 + 4) + (4 + 8 + 16 + 4)


@pytest.mark.parametrize("cut", range(FZT1_LEN))
def test_fzt1_truncated(mctx, cut):
    _load_fzt(mctx, _fzt(mctx, False)[:cut], fu.InvalidDataLength)


@pytest.mark.parametrize("cut", range(FZT2_LEN))
def test_fzt2_truncated(mctx, cut):
    _load_fzt(mctx, _fzt(mctx, True)[:cut], fu.InvalidDataLength)


@pytest.mark.parametrize("pos", list(range(28, 56)) + list(range(68, 88)))
def test_fzt2_flipped_data_byte(mctx, pos):
    data = bytearray(_fzt(mctx, True))
    data[pos] ^= 0x80
    _load_fzt(mctx, bytes(data), fu.ChecksumMismatch)


@pytest.mark.parametrize("field,value,err", [
    ("magic", b"FZT3", fu.CheckpointMagicMismatch), ("magic", b"GGUF", fu.CheckpointMagicMismatch),
    ("magic", b"\0\0\0\0", fu.CheckpointMagicMismatch),
    ("count", 1, fu.CheckpointShapeMismatch), ("count", 3, fu.CheckpointShapeMismatch),
    ("count", 2 ** 32 - 1, fu.CheckpointShapeMismatch),
    ("rank", 0, fu.CheckpointShapeMismatch), ("rank", 3, fu.CheckpointShapeMismatch),
    ("rank", 2 ** 32 - 1, fu.CheckpointShapeMismatch),
    ("dim0", 3, fu.CheckpointShapeMismatch), ("dim0", 2 ** 64 - 1, fu.CheckpointShapeMismatch),
    ("dim1", 0, fu.CheckpointShapeMismatch)])
@pytest.mark.parametrize("checksum", [False, True])
def test_fzt_lying_header(mctx, field, value, err, checksum):
    data = bytearray(_fzt(mctx, checksum))
    at, fmt = {"magic": (0, None), "count": (4, "<I"), "rank": (8, "<I"), "dim0": (12, "<Q"),
               "dim1": (20, "<Q")}[field]
    raw = value if fmt is None else struct.pack(fmt, value)
    data[at:at + len(raw)] = raw
    _load_fzt(mctx, bytes(data), err)


# ---- safetensors state dicts -------------------------------------------------------------------

def _st(mctx):
    f = io.BytesIO()
    fu.io.save_state_dict(f, {"w": mctx.tensor(A, ("o", "i")), "b": mctx.tensor(B, ("i",))})
    return f.getvalue()


def _load_st(mctx, data, err, **kw):
    d = _dests(mctx)
    with pytest.raises(fu.FucinaError) as e:
        fu.io.load_state_dict(io.BytesIO(data), {"w": d[0], "b": d[1]}, **kw)
    assert e.type is err, (e.type, e.value)
    _unchanged(d)


def _with_header(obj, data_len=40, pad=True):
    text = json.dumps(obj, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data_len)


GOOD_HEADER = {"b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
               "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [16, 40]}}


def test_safetensors_reference_loads(mctx):
    d = _dests(mctx)
    fu.io.load_state_dict(io.BytesIO(_with_header(GOOD_HEADER)), {"w": d[0], "b": d[1]})
    assert np.all(d[0].numpy() == 0)


@pytest.mark.parametrize("cut", range(0, 8 + 104, 3))
def test_safetensors_truncated(mctx, cut):
    data = _st(mctx)
    assert cut < len(data)
    _load_st(mctx, data[:cut], fu.InvalidDataLength)


def _patched(**changes):
    h = json.loads(json.dumps(GOOD_HEADER))
    for key, (field, value) in changes.items():
        if field is None:
            h[key] = value
        else:
            h[key][field] = value
    return h


@pytest.mark.parametrize("header,err", [
    (_patched(b=("dtype", "Q8_0")), fu.CheckpointUnsupportedDtype),
    (_patched(b=("dtype", "f32")), fu.CheckpointUnsupportedDtype),
    (_patched(b=("dtype", 7)), fu.CheckpointMagicMismatch),
    ({"b": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}, "w": GOOD_HEADER["w"]
      | {"data_offsets": [8, 32]}}, fu.CheckpointDtypeMismatch),
    ({"b": {"dtype": "I64", "shape": [4], "data_offsets": [0, 32]}, "w": GOOD_HEADER["w"]
      | {"data_offsets": [32, 56]}}, fu.CheckpointDtypeMismatch),
    (_patched(b=("dtype", "F16")), fu.CheckpointShapeMismatch),  # offsets no longer fit F16
    (_patched(b=("shape", [5])), fu.CheckpointShapeMismatch),
    (_patched(b=("shape", [2, 2])), fu.CheckpointShapeMismatch),
    (_patched(b=("shape", [-4])), fu.CheckpointMagicMismatch),
    (_patched(b=("shape", "4")), fu.CheckpointMagicMismatch),
    (_patched(b=("data_offsets", [0, 12])), fu.CheckpointShapeMismatch),
    (_patched(b=("data_offsets", [4, 20])), fu.CheckpointShapeMismatch),
    (_patched(b=("data_offsets", [0, 2 ** 70])), fu.CheckpointShapeMismatch),
    (_patched(b=("data_offsets", [0])), fu.CheckpointMagicMismatch),
    (_patched(b=("data_offsets", [0, -16])), fu.CheckpointMagicMismatch),
    (_patched(w=("data_offsets", [24, 48])), fu.CheckpointShapeMismatch),
    (_patched(w=("data_offsets", [0, 24]), b=("data_offsets", [0, 16])), fu.CheckpointShapeMismatch),
    (_patched(b=(None, [1, 2])), fu.CheckpointMagicMismatch),
    (_patched(b=(None, None)), fu.CheckpointMagicMismatch),
    (_patched(x=(None, {"dtype": "F32", "shape": [0], "data_offsets": [40, 40]})),
     fu.CheckpointUnknownName),
    (_patched(__metadata__=(None, {"a": 1})), fu.CheckpointMagicMismatch),
    ({"": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}, fu.CheckpointInvalidName),
    ({"w": GOOD_HEADER["w"] | {"data_offsets": [0, 24]}}, fu.CheckpointMissingEntry),
    ([1, 2], fu.CheckpointMagicMismatch), ("text", fu.CheckpointMagicMismatch),
    (None, fu.CheckpointMagicMismatch)])
def test_safetensors_lying_header(mctx, header, err):
    _load_st(mctx, _with_header(header), err)


@pytest.mark.parametrize("raw,err", [
    (struct.pack("<Q", 2 ** 63) + b"{}", fu.CheckpointMagicMismatch),
    (struct.pack("<Q", 100_000_001), fu.CheckpointMagicMismatch),
    (struct.pack("<Q", 4096) + b"{}", fu.InvalidDataLength),
    (struct.pack("<Q", 3) + b"{}   ", fu.CheckpointMissingEntry),  # a valid empty header
    (struct.pack("<Q", 1) + b"{}   ", fu.CheckpointMagicMismatch),
    (struct.pack("<Q", 8) + b"\xff\xfe{}    ", fu.CheckpointMagicMismatch),
    (struct.pack("<Q", 8) + b"{\"b\":NaN}", fu.CheckpointMagicMismatch),
    (struct.pack("<Q", 16) + b'{"b":1,"b":2}   ', fu.CheckpointDuplicateName),
    (struct.pack("<Q", 8) + b"[" * 8, fu.CheckpointMagicMismatch)])
def test_safetensors_lying_length_and_garbage(mctx, raw, err):
    _load_st(mctx, raw, err)


# ---- optimizer frames --------------------------------------------------------------------------

def _opt(ctx, seed=0, dtype="f32"):
    rng = np.random.default_rng(seed)
    w = ctx.variable(rng.standard_normal((2, 3)).astype(F), ("o", "i"))
    opt = fu.optim.AdamW(lr=0.01, state_dtype=dtype)
    opt.add_param_named(w, "w")
    feed(ctx, w, rng.standard_normal((2, 3)))
    opt.step()
    return opt


def _frame(opt, checksum):
    f = io.BytesIO()
    opt.save_state(f, checksum=checksum)
    return f.getvalue()


def _load_opt(opt, data, err):
    before = _frame(opt, False)
    with pytest.raises(fu.FucinaError) as e:
        opt.load_state(io.BytesIO(data))
    assert e.type is err, (e.type, e.value)
    assert _frame(opt, False) == before


BARE_LEN = 4 + 4 + (2 + 1) + 16 + 8 + 24 + 24  # FZA3 | n | name "w" | dims | step | m | v


@pytest.mark.parametrize("checksum,cut", [(False, c) for c in range(0, BARE_LEN, 2)]
                         + [(True, c) for c in range(0, BARE_LEN + 16, 2)])
def test_frame_truncated(mctx, checksum, cut):
    data = _frame(_opt(mctx), checksum)
    assert len(data) == BARE_LEN + 16 * checksum
    _load_opt(_opt(mctx, 1), data[:cut], fu.InvalidDataLength)


@pytest.mark.parametrize("pos", range(12 + 4 + 4 + 3 + 16 + 8, 12 + BARE_LEN, 3))
def test_frame_flipped_state_byte(mctx, pos):
    data = bytearray(_frame(_opt(mctx), True))
    data[pos] ^= 0x01
    _load_opt(_opt(mctx, 1), bytes(data), fu.ChecksumMismatch)


@pytest.mark.parametrize("at,raw,err", [
    (0, b"FZA9", fu.CheckpointMagicMismatch), (0, b"FZS3", fu.CheckpointMagicMismatch),
    (4, struct.pack("<I", 0), fu.CheckpointMissingEntry),
    (4, struct.pack("<I", 2), fu.InvalidDataLength),
    (4, struct.pack("<I", 2 ** 32 - 1), fu.InvalidDataLength),
    (8, struct.pack("<H", 0), fu.CheckpointInvalidName),
    (8, struct.pack("<H", 2), fu.CheckpointUnknownName),
    (8, struct.pack("<H", 0xFFFF), fu.InvalidDataLength),
    (10, b"v", fu.CheckpointUnknownName),
    (11, struct.pack("<Q", 3), fu.CheckpointShapeMismatch),
    (19, struct.pack("<Q", 2 ** 64 - 1), fu.CheckpointShapeMismatch)])
def test_frame_lying_fields(mctx, at, raw, err):
    data = bytearray(_frame(_opt(mctx), False))
    data[at:at + len(raw)] = raw
    _load_opt(_opt(mctx, 1), bytes(data), err)
    # the same lie inside an intact envelope (CRC recomputed): the structural error stands
    inner = bytes(data)
    env = b"FZC1" + struct.pack("<Q", len(inner)) + inner + struct.pack("<I", zlib.crc32(inner))
    _load_opt(_opt(mctx, 1), env, err)


@pytest.mark.parametrize("tag,err", [(2, fu.CheckpointUnsupportedDtype),
                                     (255, fu.CheckpointUnsupportedDtype),
                                     (0, fu.CheckpointDtypeMismatch)])
def test_frame_unknown_state_dtype(mctx, tag, err):
    data = bytearray(_frame(_opt(mctx, dtype="bf16"), False))
    assert data[:4] == b"FZA4"
    data[4 + 4 + 3 + 16 + 8] = tag  # m's dtype tag
    _load_opt(_opt(mctx, 1, dtype="bf16"), bytes(data), err)


@pytest.mark.parametrize("raw,err", [
    (b"FZC1" + struct.pack("<Q", 0) + struct.pack("<I", 0), fu.InvalidDataLength),
    (b"FZC1", fu.InvalidDataLength), (b"FZC", fu.InvalidDataLength),
    (b"FZC2" + bytes(16), fu.CheckpointMagicMismatch)])
def test_envelope_garbage(mctx, raw, err):
    _load_opt(_opt(mctx, 1), raw, err)


# ---- checkpoint directories --------------------------------------------------------------------

def _ckpt(mctx, d):
    reg = fu.io.ParamRegistry()
    reg.add_param("w", mctx.tensor(A, ("o", "i")))
    fu.io.begin_save(d)
    fu.io.write_file_atomic(d / fu.io.MODEL_STATE_FILE, reg.save_state_dict)
    fu.io.write_file_atomic(d / fu.io.OPTIMIZER_STATE_FILE, _opt(mctx).save_state)
    fu.io.save_trainer_state(d, fu.io.TrainerState(step=5, seed=1))


@pytest.mark.parametrize("victim", [fu.io.MODEL_STATE_FILE, fu.io.OPTIMIZER_STATE_FILE])
@pytest.mark.parametrize("damage", ["flip_first", "flip_last", "truncate", "extend", "delete",
                                    "empty"])
def test_checkpoint_dir_damage(mctx, tmp_path, victim, damage):
    d = tmp_path / "c"
    _ckpt(mctx, d)
    p = d / victim
    data = bytearray(p.read_bytes())
    if damage == "flip_first":
        data[0] ^= 1
    elif damage == "flip_last":
        data[-1] ^= 0x40
    elif damage == "truncate":
        data = data[:-3]
    elif damage == "extend":
        data += b"\0"
    elif damage == "empty":
        data = b""
    if damage == "delete":
        p.unlink()
    else:
        p.write_bytes(bytes(data))
    with pytest.raises(fu.FucinaError) as e:
        fu.io.load_trainer_state(d)
    assert e.type is fu.ChecksumMismatch and victim in str(e.value)


@pytest.mark.parametrize("text,err", [
    (b"", None), (b"garbage", None),
    (b'{"format": "fucina.training_checkpoint", "version": 2, "step": 1, "seed": 1}',
     fu.UnsupportedTrainerStateVersion),
    (b'{"format": "other", "version": 1, "step": 1, "seed": 1}', fu.InvalidTrainerState),
    (b'{"format": "fucina.training_checkpoint", "version": 1, "step": -1, "seed": 1}',
     fu.InvalidTrainerState),
    (b'{"format": "fucina.training_checkpoint", "version": 1, "step": 1, "seed": 1, '
     b'"lora_alpha": "x"}', fu.InvalidTrainerState)])
def test_checkpoint_dir_bad_sentinel(mctx, tmp_path, text, err):
    d = tmp_path / "c"
    _ckpt(mctx, d)
    (d / fu.io.TRAINER_STATE_FILE).write_bytes(text)
    if err is None:
        assert fu.io.load_trainer_state(d) is None  # not JSON: an incomplete checkpoint
    else:
        with pytest.raises(fu.FucinaError) as e:
            fu.io.load_trainer_state(d)
        assert e.type is err


def test_intact_checkpoint_dir_loads(mctx, tmp_path):
    d = tmp_path / "c"
    _ckpt(mctx, d)
    assert fu.io.load_trainer_state(d).step == 5
    reg = fu.io.ParamRegistry()
    w = mctx.variable(np.zeros((2, 3), F), ("o", "i"))
    reg.add_param("w", w)
    reg.load_state_dict(str(d / fu.io.MODEL_STATE_FILE))
    assert np.array_equal(bits(w.numpy()), bits(A))
    opt = _opt(mctx, 3)
    with open(d / fu.io.OPTIMIZER_STATE_FILE, "rb") as f:
        opt.load_state(f)
    assert _frame(opt, False) == _frame(_opt(mctx), False)
