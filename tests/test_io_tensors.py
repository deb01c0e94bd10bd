"""FZT1 parameter files (SPEC T-15): exact bytes, errors, transactional loads, corrupt input."""
import io
import random
import struct
import zlib

import numpy as np
import pytest

import fucina as fu

from conftest import bits


def _vals(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _expected_bytes(arrays, checked=False):
    out = (b"FZT2" if checked else b"FZT1") + struct.pack("<I", len(arrays))
    for a in arrays:
        out += struct.pack("<I", a.ndim) + b"".join(struct.pack("<Q", d) for d in a.shape)
        out += a.astype("<f4").tobytes()
        if checked:
            out += struct.pack("<I", zlib.crc32(out))
    return out


def _model(ctx1):
    """Four tensors (variables and constants, rank 0 to 3) and their values."""
    arrays = [_vals((2, 3), 1), _vals((4,), 2), np.float32(7.25).reshape(()), _vals((2, 1, 3), 3)]
    tensors = [ctx1.variable(arrays[0], ("o", "i")), ctx1.tensor(arrays[1], ("o",)),
               ctx1.tensor(arrays[2], ()), ctx1.variable(arrays[3], ("a", "b", "c"))]
    return arrays, tensors


def _fresh(ctx, arrays, fill=np.float32(np.nan)):
    """Destinations shaped like `arrays`, filled with a recognisable pattern (NaN payload bits)."""
    out = []
    for i, a in enumerate(arrays):
        v = np.full(a.shape, fill, np.float32)
        v.reshape(-1).view(np.uint32)[:] = 0x7FC00000 + 17 * i + np.arange(v.size, dtype=np.uint32)
        out.append(ctx.variable(v, tuple(f"t{i}_{k}" for k in range(a.ndim))) if i % 2 == 0
                   else ctx.tensor(v, tuple(f"t{i}_{k}" for k in range(a.ndim))))
    return out


def _snapshot(tensors):
    return [bits(t.data_const()).copy() for t in tensors]


def test_exact_bytes(ctx1):
    arrays, tensors = _model(ctx1)
    f = io.BytesIO()
    fu.io.save_tensors(f, tensors, checksum=False)  # the SPEC T-15 bytes
    assert f.getvalue() == _expected_bytes(arrays)
    f = io.BytesIO()
    fu.io.save_tensors(f, tensors)  # the default: FZT2, a running CRC32 after each tensor
    assert f.getvalue() == _expected_bytes(arrays, checked=True)
    f = io.BytesIO()
    fu.io.save_tensors(f, [], checksum=False)
    assert f.getvalue() == b"FZT1\x00\x00\x00\x00"
    f = io.BytesIO()
    fu.io.save_tensors(f, [])
    assert f.getvalue() == b"FZT2\x00\x00\x00\x00"


@pytest.mark.parametrize("checked", [False, True])
def test_both_versions_load(ctx1, checked):
    arrays, _ = _model(ctx1)
    dest = _fresh(ctx1, arrays)
    fu.io.load_tensors(io.BytesIO(_expected_bytes(arrays, checked)), dest)
    for a, t in zip(arrays, dest):
        np.testing.assert_array_equal(bits(t.data_const()), bits(a))


def test_every_flipped_byte_is_caught(ctx1):
    """FZT2: a flip anywhere is a clear error (ChecksumMismatch inside the data) and leaves
    every destination unchanged; FZT1 cannot see data flips (why FZT2 exists)."""
    arrays, tensors = _model(ctx1)
    good = _expected_bytes(arrays, checked=True)
    dest = _fresh(ctx1, arrays)
    before = _snapshot(dest)
    data_flips = 0
    for pos in range(len(good)):
        bad = bytearray(good)
        bad[pos] ^= 0x10
        with pytest.raises((fu.ChecksumMismatch, fu.CheckpointShapeMismatch,
                            fu.CheckpointMagicMismatch, fu.InvalidDataLength)) as e:
            fu.io.load_tensors(io.BytesIO(bytes(bad)), dest)
        data_flips += e.type is fu.ChecksumMismatch
        for b, t in zip(before, dest):
            np.testing.assert_array_equal(bits(t.data_const()), b)
    assert data_flips >= 4 * (6 + 4 + 1 + 6)  # every data byte (and every crc byte)


def test_round_trip_stream_and_path(ctx1, tmp_path):
    arrays, tensors = _model(ctx1)
    f = io.BytesIO()
    fu.io.save_tensors(f, tensors)
    f.write(b"trailing")
    f.seek(0)
    dest = _fresh(ctx1, arrays)
    fu.io.load_tensors(f, dest)
    assert f.read() == b"trailing"  # exactly one FZT1 prefix was consumed
    for a, t in zip(arrays, dest):
        np.testing.assert_array_equal(bits(t.data_const()), bits(a))
    assert dest[0].requires_grad  # a variable stays a variable

    path = tmp_path / "params.fzt"
    fu.io.save_tensors(path, tensors)
    assert path.read_bytes() == _expected_bytes(arrays, checked=True)
    dest = _fresh(ctx1, arrays)
    fu.io.load_tensors(str(path), dest)
    for a, t in zip(arrays, dest):
        np.testing.assert_array_equal(bits(t.data_const()), bits(a))


def test_short_reads(ctx1):
    """A stream that hands out one byte per read (a pipe) still loads."""
    arrays, tensors = _model(ctx1)
    f = io.BytesIO()
    fu.io.save_tensors(f, tensors)

    class Trickle(io.RawIOBase):
        def __init__(self, data):
            self.data, self.pos = data, 0

        def readable(self):
            return True

        def readinto(self, b):
            if self.pos >= len(self.data) or len(b) == 0:
                return 0
            b[0] = self.data[self.pos]
            self.pos += 1
            return 1

    dest = _fresh(ctx1, arrays)
    fu.io.load_tensors(Trickle(f.getvalue()), dest)
    for a, t in zip(arrays, dest):
        np.testing.assert_array_equal(bits(t.data_const()), bits(a))


def test_save_errors(ctx1):
    w = ctx1.tensor(_vals((3, 4), 0), ("a", "b"))
    f = io.BytesIO()
    with pytest.raises(fu.NonContiguousParam, match="tensor 1.*contiguous"):
        fu.io.save_tensors(f, [w, w.narrow("b", 1, 2)])
    with pytest.raises(fu.DTypeError, match="save_tensors: tensor 0.*f16"):
        fu.io.save_tensors(f, [ctx1.tensor([1.0], ("a",), dtype="f16")])
    with pytest.raises(TypeError, match="expected a fucina Tensor"):
        fu.io.save_tensors(f, [np.zeros(3, np.float32)])
    assert f.getvalue() == b""  # validated before the first byte
    gone = ctx1.tensor([1.0], ("a",))
    gone.release()
    with pytest.raises(fu.FucinaError, match="released"):
        fu.io.save_tensors(f, [gone])


def test_load_errors_leave_destinations_unchanged(ctx1):
    arrays, tensors = _model(ctx1)
    f = io.BytesIO()
    fu.io.save_tensors(f, tensors)
    good = f.getvalue()

    def check(data, err, match, dest_arrays=arrays):
        dest = _fresh(ctx1, dest_arrays)
        before = _snapshot(dest)
        with pytest.raises(err, match=match):
            fu.io.load_tensors(io.BytesIO(data), dest)
        for b, t in zip(before, dest):
            np.testing.assert_array_equal(bits(t.data_const()), b)

    check(b"FZT3" + good[4:], fu.CheckpointMagicMismatch,
          r"expected magic b'FZT1' or b'FZT2', got b'FZT3'")
    check(good, fu.CheckpointShapeMismatch, "expected 3 tensors, the file holds 4", arrays[:3])
    check(good, fu.CheckpointShapeMismatch, "expected 5 tensors, the file holds 4",
          arrays + [arrays[0]])
    wrong_rank = arrays[:3] + [arrays[3].reshape(2, 3)]
    check(good, fu.CheckpointShapeMismatch, r"tensor 3: expected rank 2 .*rank 3", wrong_rank)
    wrong_dims = [arrays[0], arrays[1], arrays[2], arrays[3].reshape(2, 3, 1)]
    check(good, fu.CheckpointShapeMismatch, r"tensor 3: expected shape \(2, 3, 1\).*\(2, 1, 3\)",
          wrong_dims)
    check(good[:-5], fu.InvalidDataLength, "tensor 3's data: expected 24 bytes, got 23")
    check(good[:-1], fu.InvalidDataLength, "tensor 3's CRC32: expected 4 bytes, got 3")
    flipped = bytearray(good)
    flipped[-6] ^= 1
    check(bytes(flipped), fu.ChecksumMismatch, r"load_tensors\(<stream>\): tensor 3: expected CRC32")
    check(b"", fu.InvalidDataLength, "the FZT1 magic")

    w = ctx1.tensor(_vals((3, 4), 0), ("a", "b"))
    with pytest.raises(fu.NonContiguousParam):
        fu.io.load_tensors(io.BytesIO(good), [w.narrow("b", 0, 2)])
    with pytest.raises(fu.DTypeError):
        fu.io.load_tensors(io.BytesIO(good), [ctx1.tensor([1, 2], ("a",), dtype="i64")])


def test_truncation_at_every_byte(ctx1):
    """Every proper prefix of a file fails and leaves every destination bit-identical."""
    arrays, tensors = _model(ctx1)
    f = io.BytesIO()
    fu.io.save_tensors(f, tensors)
    good = f.getvalue()
    dest = _fresh(ctx1, arrays)
    before = _snapshot(dest)
    for k in range(len(good)):
        with pytest.raises(fu.InvalidDataLength, match="the stream ended"):
            fu.io.load_tensors(io.BytesIO(good[:k]), dest)
        for b, t in zip(before, dest):
            np.testing.assert_array_equal(bits(t.data_const()), b)
    fu.io.load_tensors(io.BytesIO(good), dest)
    for a, t in zip(arrays, dest):
        np.testing.assert_array_equal(bits(t.data_const()), bits(a))


@pytest.mark.parametrize("checksum", [False, True])
def test_random_corruptions(ctx1, checksum):
    """Hundreds of corrupted files: each raises a FucinaError (destinations unchanged) or loads
    exactly what the file says (re-saving reproduces the bytes that were read). FZT2 loads only
    what is byte-identical to the saved file (a corruption past its end)."""
    arrays, tensors = _model(ctx1)
    f = io.BytesIO()
    fu.io.save_tensors(f, tensors, checksum=checksum)
    good = f.getvalue()
    rng = random.Random(1234)
    dest = _fresh(ctx1, arrays)
    outcomes = {"error": 0, "loaded": 0}
    for trial in range(400):
        data = bytearray(good)
        kind = trial % 4
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            del data[rng.randrange(len(data)):]
        elif kind == 2:
            pos = rng.randrange(len(data))
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        else:
            pos = rng.randrange(12)  # the header words: count, rank, dims
            data[pos:pos + 4] = struct.pack("<I", rng.choice([0, 1, 5, 2**31, 2**32 - 1]))
        before = _snapshot(dest)
        try:
            fu.io.load_tensors(io.BytesIO(bytes(data)), dest)
        except fu.FucinaError:
            outcomes["error"] += 1
            for b, t in zip(before, dest):
                np.testing.assert_array_equal(bits(t.data_const()), b)
            continue
        outcomes["loaded"] += 1
        out = io.BytesIO()
        fu.io.save_tensors(out, dest, checksum=checksum)
        assert bytes(data[:len(out.getvalue())]) == out.getvalue()
        if checksum:
            assert bytes(data[:len(good)]) == good
    if checksum:
        assert outcomes["error"] > 380, outcomes
    else:
        assert outcomes["error"] > 100 and outcomes["loaded"] > 20, outcomes


def test_contiguous_views_with_offset(ctx1):
    """A leading-axis narrow is contiguous: it saves its own rows and loads into them only."""
    base = _vals((4, 3), 5)
    w = ctx1.tensor(base, ("r", "c"))
    f = io.BytesIO()
    fu.io.save_tensors(f, [w.narrow("r", 1, 2)])
    assert f.getvalue() == _expected_bytes([base[1:3]], checked=True)
    dest = ctx1.variable(np.zeros((4, 3), np.float32), ("r", "c"))
    f.seek(0)
    fu.io.load_tensors(f, [dest.detach().narrow("r", 2, 2)])
    want = np.zeros((4, 3), np.float32)
    want[2:4] = base[1:3]
    np.testing.assert_array_equal(dest.numpy(), want)
