"""Checkpoint directories (SPEC T-19): atomic writes, the sentinel protocol, trainer_state.json
exact bytes and parsing, interrupted saves."""
import os
import random

import numpy as np
import pytest

import fucina as fu
from fucina.io import ParamRegistry, TrainerState

FULL = dict(step=12, seed=34, lora_rank=8, lora_alpha=16.0, lora_dropout_p=0.125, learning_rate=1e-3,
            accum_steps=4, data_seed=42, data_epoch=2, data_index=3, es_sigma=0.001,
            es_alpha=0.0005, es_population=30, es_noise=1, es_antithetic=1, es_anchor_decay=2,
            es_anchor_lambda=10.0, es_ternary_flip_rate=0.001, es_ternary_update_fraction=0.005,
            es_ternary_update_decay=0.015, es_iteration=17)


def test_constants():
    assert fu.io.MODEL_STATE_FILE == "model.safetensors"
    assert fu.io.ADAPTERS_STATE_FILE == "adapters.safetensors"
    assert fu.io.OPTIMIZER_STATE_FILE == "optimizer.fucina"
    assert fu.io.TRAINER_STATE_FILE == "trainer_state.json"
    assert fu.io.step_dir("runs/x", 1000) == os.path.join("runs/x", "checkpoint-step-1000")


def test_exact_bytes():
    got = fu.io.format_trainer_state(TrainerState(step=12, seed=34, lora_rank=8, learning_rate=1e-3,
                                                  es_iteration=17))
    assert got == (b'{\n'
                   b'  "format": "fucina.training_checkpoint",\n'
                   b'  "version": 1,\n'
                   b'  "step": 12,\n'
                   b'  "seed": 34,\n'
                   b'  "lora_rank": 8,\n'
                   b'  "learning_rate": 0.001,\n'
                   b'  "es_iteration": 17\n'
                   b'}\n')
    assert fu.io.format_trainer_state(TrainerState()) == (
        b'{\n  "format": "fucina.training_checkpoint",\n  "version": 1,\n  "step": 0,\n  "seed": 0\n}\n')
    full = fu.io.format_trainer_state(TrainerState(**FULL)).decode()
    want = ('{\n  "format": "fucina.training_checkpoint",\n  "version": 1,\n  "step": 12,\n'
            '  "seed": 34,\n  "lora_rank": 8,\n  "lora_alpha": 16,\n  "lora_dropout_p": 0.125,\n'
            '  "learning_rate": 0.001,\n  "accum_steps": 4,\n  "data_seed": 42,\n  "data_epoch": 2,\n'
            '  "data_index": 3,\n  "es_sigma": 0.001,\n  "es_alpha": 0.0005,\n  "es_population": 30,\n'
            '  "es_noise": 1,\n  "es_antithetic": 1,\n  "es_anchor_decay": 2,\n'
            '  "es_anchor_lambda": 10,\n  "es_ternary_flip_rate": 0.001,\n'
            '  "es_ternary_update_fraction": 0.005,\n  "es_ternary_update_decay": 0.015,\n'
            '  "es_iteration": 17\n}\n')
    assert full == want


@pytest.mark.parametrize("value,text", [(16.0, "16"), (16, "16"), (0.1, "0.1"), (1e-10, "0.0000000001"),
                                        (2.5e-5, "0.000025"), (1e22, "10000000000000000000000"),
                                        (123456.789, "123456.789"), (-3.0, "-3"),
                                        (1 / 3, "0.3333333333333333")])
def test_floats_print_like_zig_decimal(value, text):
    got = fu.io.format_trainer_state(TrainerState(learning_rate=value)).decode()
    assert f'"learning_rate": {text}\n' in got
    assert fu.io.parse_trainer_state(got.encode()).learning_rate == float(value)


def test_float_round_trip_is_exact():
    rng = random.Random(3)
    for _ in range(300):
        v = rng.choice([rng.random() * 10 ** rng.randint(-30, 30), rng.uniform(-1, 1),
                        float(np.float32(rng.random())), 5e-324, 1.7976931348623157e308])
        s = fu.io.parse_trainer_state(fu.io.format_trainer_state(TrainerState(es_sigma=v)))
        assert s.es_sigma == v


def test_directory_round_trip(tmp_path):
    d = tmp_path / "a" / "b" / "ckpt"
    fu.io.begin_save(d)
    assert d.is_dir() and fu.io.load_trainer_state(d) is None
    fu.io.save_trainer_state(d, TrainerState(**FULL))
    assert fu.io.load_trainer_state(d) == TrainerState(**FULL)
    fu.io.begin_save(d)  # the sentinel goes first
    assert not (d / fu.io.TRAINER_STATE_FILE).exists()
    fu.io.save_trainer_state(str(d), TrainerState(step=3, seed=7))
    bare = fu.io.load_trainer_state(str(d))
    assert (bare.step, bare.seed, bare.version) == (3, 7, 1)
    assert bare.accum_steps is None and bare.es_sigma is None and bare.data_index is None
    assert sorted(os.listdir(d)) == [fu.io.MANIFEST_FILE, fu.io.TRAINER_STATE_FILE]


def _sentinel(tmp_path, text):
    d = tmp_path / f"c{abs(hash(text))}"
    d.mkdir()
    (d / fu.io.TRAINER_STATE_FILE).write_bytes(text if isinstance(text, bytes) else text.encode())
    return d


def test_parse_rules(tmp_path):
    head = '"format": "fucina.training_checkpoint", "version": 1'
    s = fu.io.load_trainer_state(_sentinel(
        tmp_path, '{%s, "seed": 5, "step": 9, "unknown": [1, {"x": null}], "lora_alpha": 8,'
                  ' "future_field": "ignored"}' % head))
    assert (s.step, s.seed, s.lora_alpha) == (9, 5, 8.0) and isinstance(s.lora_alpha, float)
    assert fu.io.load_trainer_state(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert fu.io.load_trainer_state(tmp_path / "empty") is None
    for garbage in [b"", b"{", b'{"format": "fucina.training_checkpoint", "version": 1, "st',
                    b"\xff\xfe\x00", b"not json", b'{"step": NaN}']:
        assert fu.io.load_trainer_state(_sentinel(tmp_path, garbage)) is None
        with pytest.raises(fu.InvalidTrainerState, match="unparseable"):
            fu.io.parse_trainer_state(garbage)
    invalid = [('[1, 2]', "JSON object"),
               ('{"format": "other", "version": 1, "step": 1, "seed": 1}', "format"),
               ('{"version": 1, "step": 1, "seed": 1}', "format"),
               ('{"format": "fucina.training_checkpoint", "step": 1, "seed": 1}', "'version'"),
               ('{%s, "seed": 1}' % head, "'step'"),
               ('{%s, "step": 1}' % head, "'seed'"),
               ('{%s, "step": -1, "seed": 1}' % head, "'step'"),
               ('{%s, "step": 1.0, "seed": 1}' % head, "'step'"),
               ('{%s, "step": true, "seed": 1}' % head, "'step'"),
               ('{%s, "step": 18446744073709551616, "seed": 1}' % head, "'step'"),
               ('{%s, "step": 1, "seed": 1, "lora_rank": 8.5}' % head, "'lora_rank'"),
               ('{%s, "step": 1, "seed": 1, "lora_alpha": "16"}' % head, "'lora_alpha'"),
               ('{%s, "step": 1, "seed": 1, "es_sigma": null}' % head, "'es_sigma'"),
               ('{%s, "step": 1, "seed": 1, "es_sigma": 1e999}' % head, "'es_sigma'"),
               ('{%s, "step": 1, "seed": 1, "es_sigma": 1%s}' % (head, "0" * 400), "'es_sigma'"),
               ('{"format": "fucina.training_checkpoint", "version": 4294967296, "step": 1, "seed": 1}',
                "'version'")]
    for text, match in invalid:
        with pytest.raises(fu.InvalidTrainerState, match=match):
            fu.io.load_trainer_state(_sentinel(tmp_path, text))
    with pytest.raises(fu.UnsupportedTrainerStateVersion, match="expected version 1, got 2"):
        fu.io.load_trainer_state(_sentinel(
            tmp_path, '{"format": "fucina.training_checkpoint", "version": 2, "step": 1, "seed": 1}'))
    big = fu.io.load_trainer_state(_sentinel(tmp_path, '{%s, "step": 18446744073709551615, "seed": 0}'
                                             % head))
    assert big.step == 2**64 - 1


def test_save_validates_before_writing(tmp_path):
    for bad, match in [(dict(step=-1), "'step'"), (dict(seed=2**64), "'seed'"),
                       (dict(step=True), "'step'"), (dict(learning_rate=float("nan")), "'learning_rate'"),
                       (dict(es_sigma=float("inf")), "'es_sigma'"),
                       (dict(es_alpha=10**400), "'es_alpha'"), (dict(lora_rank=8.0), "'lora_rank'"),
                       (dict(lora_alpha="16"), "'lora_alpha'"), (dict(version=2**32), "'version'")]:
        with pytest.raises(fu.InvalidTrainerState, match=match):
            fu.io.save_trainer_state(tmp_path, TrainerState(**bad))
    assert os.listdir(tmp_path) == []


def test_write_file_atomic(tmp_path):
    p = tmp_path / "sub" / "file.bin"
    fu.io.write_file_atomic(p, lambda f: f.write(b"old contents"))
    assert p.read_bytes() == b"old contents"
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(p).st_mode & 0o777 == 0o666 & ~umask

    def boom(f):
        f.write(b"half of the new")
        raise RuntimeError("disk on fire")
    with pytest.raises(RuntimeError, match="disk on fire"):
        fu.io.write_file_atomic(p, boom)
    assert p.read_bytes() == b"old contents"
    assert os.listdir(p.parent) == ["file.bin"]  # no temp file left behind

    def interrupted(f):
        f.write(b"x" * 100)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        fu.io.write_file_atomic(str(p), interrupted)
    assert p.read_bytes() == b"old contents" and os.listdir(p.parent) == ["file.bin"]
    fu.io.write_file_atomic(os.fsencode(p), lambda f: f.write(b"new"))
    assert p.read_bytes() == b"new" and os.listdir(p.parent) == ["file.bin"]


class Mlp:
    def __init__(self, ctx, seed):
        rng = np.random.default_rng(seed)
        self.w1 = ctx.variable(rng.standard_normal((8, 2)).astype(np.float32), ("h1", "in"))
        self.b1 = ctx.variable(np.zeros(8, np.float32), ("h1",))
        self.w2 = ctx.variable(rng.standard_normal((2, 8)).astype(np.float32), ("class", "h1"))
        self.b2 = ctx.variable(np.zeros(2, np.float32), ("class",))


def _save_checkpoint(d, reg, step, fail_in=None):
    """The T-19 protocol; `fail_in` names the payload whose writer dies halfway."""
    def payload(name, write):
        def writer(f):
            if name == fail_in:
                f.write(b"partial")
                raise OSError("simulated crash while writing " + name)
            write(f)
        fu.io.write_file_atomic(os.path.join(d, name), writer)
    fu.io.begin_save(d)
    payload(fu.io.MODEL_STATE_FILE, reg.save_state_dict)
    payload(fu.io.OPTIMIZER_STATE_FILE, lambda f: f.write(b"FZA3" + step.to_bytes(8, "little")))
    fu.io.save_trainer_state(d, TrainerState(step=step, seed=42))


def _latest_complete(save_dir):
    steps = sorted((int(n.rsplit("-", 1)[1]) for n in os.listdir(save_dir)
                    if n.startswith("checkpoint-step-")), reverse=True)
    for s in steps:
        d = fu.io.step_dir(save_dir, s)
        if fu.io.load_trainer_state(d) is not None:
            return d
    return None


def test_interrupted_save_keeps_previous_checkpoint(ctx1, tmp_path):
    model = Mlp(ctx1, 0)
    reg = ParamRegistry()
    reg.collect(model)
    first = fu.io.step_dir(tmp_path, 1000)
    _save_checkpoint(first, reg, 1000)
    saved_w1 = model.w1.numpy()

    model.w1.detach().data()[...] += 1.0  # training moves on
    for victim in (fu.io.MODEL_STATE_FILE, fu.io.OPTIMIZER_STATE_FILE):
        second = fu.io.step_dir(tmp_path, 2000)
        with pytest.raises(OSError, match="simulated crash"):
            _save_checkpoint(second, reg, 2000, fail_in=victim)
        assert fu.io.load_trainer_state(second) is None  # no sentinel: reads as absent
        assert not any(".tmp." in n for n in os.listdir(second))
        assert victim not in os.listdir(second)

    latest = _latest_complete(tmp_path)
    assert latest == first
    state = fu.io.load_trainer_state(latest)
    assert (state.step, state.seed) == (1000, 42)
    fresh = Mlp(ctx1, 7)
    freg = ParamRegistry()
    freg.collect(fresh)
    freg.load_state_dict(os.path.join(latest, fu.io.MODEL_STATE_FILE))
    np.testing.assert_array_equal(fresh.w1.numpy(), saved_w1)

    # the same directory, re-saved and interrupted: the old payload file is intact, no sentinel
    with pytest.raises(OSError):
        _save_checkpoint(first, reg, 1500, fail_in=fu.io.OPTIMIZER_STATE_FILE)
    assert fu.io.load_trainer_state(first) is None
    with open(os.path.join(first, fu.io.OPTIMIZER_STATE_FILE), "rb") as f:
        assert f.read() == b"FZA3" + (1000).to_bytes(8, "little")
    assert sorted(os.listdir(first)) == [fu.io.MODEL_STATE_FILE, fu.io.OPTIMIZER_STATE_FILE]


def test_random_sentinel_corruptions(tmp_path):
    """Corrupted sentinels: each loads, reads as absent (None) or raises a FucinaError."""
    good = fu.io.format_trainer_state(TrainerState(**FULL))
    rng = random.Random(11)
    d = tmp_path / "c"
    d.mkdir()
    outcomes = {"state": 0, "none": 0, "error": 0}
    for trial in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            if trial % 2:
                data[rng.randrange(len(data))] = ord(rng.choice('{}[]",:0123456789.-eE tfnul\\'))
            else:
                data[rng.randrange(len(data))] = rng.randrange(256)
        (d / fu.io.TRAINER_STATE_FILE).write_bytes(bytes(data))
        try:
            s = fu.io.load_trainer_state(d)
        except fu.FucinaError:
            outcomes["error"] += 1
            continue
        outcomes["none" if s is None else "state"] += 1
        if s is not None:  # whatever loaded is a valid state that formats again
            fu.io.format_trainer_state(s)
    assert all(outcomes.values()), outcomes


# ---- no litter: killed saves (issue 20 item 1) ----------------------------------------------

_KILLED_SAVER = r"""
import os, sys
import fucina.files as c
if sys.argv[2] == "named":
    c._open_unnamed = lambda parent: None   # the fallback path of systems without O_TMPFILE
def writer(f):
    chunk = b"\xab" * (1 << 20)
    for i in range(1 << 16):                 # 64 GiB: never finishes before the kill
        f.write(chunk)
        if i == 8:
            f.flush()
            print("writing", flush=True)
c.write_file_atomic(sys.argv[1], writer)
"""


def _kill_mid_save(path, mode):
    import signal
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", _KILLED_SAVER, str(path), mode],
                         stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert p.stdout.readline() == b"writing\n"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    assert p.returncode == -signal.SIGKILL


@pytest.mark.parametrize("mode", ["unnamed", "named"])
def test_killed_saves_leave_no_litter(tmp_path, mode):
    """SIGKILL in the middle of a large write, three times over: the previous file is intact
    each time, and the next save leaves the directory clean (an O_TMPFILE file has no name to
    leave; a named temp of a dead pid is removed)."""
    p = tmp_path / "state.bin"
    fu.io.write_file_atomic(p, lambda f: f.write(b"previous"))
    for _ in range(3):
        _kill_mid_save(p, mode)
        assert p.read_bytes() == b"previous"
        litter = [n for n in os.listdir(tmp_path) if n != "state.bin"]
        assert len(litter) == (1 if mode == "named" else 0), litter
    fu.io.write_file_atomic(p, lambda f: f.write(b"next"))
    assert os.listdir(tmp_path) == ["state.bin"] and p.read_bytes() == b"next"


def test_stale_temp_rules(tmp_path):
    """Only our pattern, only this host, only writers that cannot still be running."""
    from fucina import files as c
    host = c._HOST_TAG
    other = format(int(host, 16) ^ 1, "08x")
    live_old = os.getppid()  # alive, and started before the files below were written
    names = {
        f"a.bin.tmp.999999999.{host}00000000": True,          # dead pid: stale
        f"a.bin.tmp.{live_old}.{host}00000001": False,        # a live writer
        f"a.bin.tmp.{os.getpid()}.{host}00000002": False,     # this process (another thread)
        f"a.bin.tmp.999999999.{other}00000003": False,        # another host's writer
        "a.bin.tmp.999999999.00000004": False,                # the pre-host-tag pattern
        f"a.bin.tmp.999999999.{host}0000000": False,          # not our pattern
        f"a.bin.tmp.999999999.{host}00000005.bak": False,
        "notes.txt": False,
    }
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    reused = tmp_path / f"b.bin.tmp.{live_old}.{host}00000006"  # the pid was reused since
    reused.write_bytes(b"x")
    os.utime(reused, (0, 0))
    names[reused.name] = True
    (tmp_path / f"c.tmp.999999999.{host}00000007").mkdir()  # a directory: never touched
    names[f"c.tmp.999999999.{host}00000007"] = False
    removed = fu.io.remove_stale_temps(tmp_path)
    assert sorted(os.path.basename(r) for r in removed) == sorted(n for n, s in names.items() if s)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, s in names.items() if not s)
    assert fu.io.remove_stale_temps(tmp_path / "missing") == []


def test_write_file_atomic_without_link(tmp_path, monkeypatch):
    """Where the kernel refuses to link an O_TMPFILE file, its bytes are copied to a named temp."""
    from fucina import files as c
    real_link = os.link

    def refuse(src, dst, **kw):
        if kw.get("src_dir_fd") is not None:
            raise OSError(18, "Invalid cross-device link")
        return real_link(src, dst, **kw)
    monkeypatch.setattr(os, "link", refuse)
    data = bytes(range(256)) * 9000
    fu.io.write_file_atomic(tmp_path / "x", lambda f: f.write(data))
    assert (tmp_path / "x").read_bytes() == data and os.listdir(tmp_path) == ["x"]
    monkeypatch.setattr(c, "_open_unnamed", lambda parent: None)
    fu.io.write_file_atomic(tmp_path / "x", lambda f: f.write(b"named"))
    assert (tmp_path / "x").read_bytes() == b"named" and os.listdir(tmp_path) == ["x"]


# ---- the checksum manifest (issue 20 item 2) ------------------------------------------------

def _committed(ctx1, d):
    model = Mlp(ctx1, 0)
    reg = ParamRegistry()
    reg.collect(model)
    _save_checkpoint(d, reg, 1000)
    return reg


def test_manifest_written_before_the_sentinel_and_verified(ctx1, tmp_path):
    import hashlib
    import json
    d = tmp_path / "ckpt"
    _committed(ctx1, d)
    assert sorted(os.listdir(d)) == [fu.io.MANIFEST_FILE, fu.io.MODEL_STATE_FILE,
                                     fu.io.OPTIMIZER_STATE_FILE, fu.io.TRAINER_STATE_FILE]
    m = json.loads((d / fu.io.MANIFEST_FILE).read_bytes())
    assert m["format"] == "fucina.checksums" and m["version"] == 1
    for name in (fu.io.MODEL_STATE_FILE, fu.io.OPTIMIZER_STATE_FILE):
        raw = (d / name).read_bytes()
        assert m["files"][name] == {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
    assert sorted(m["files"]) == [fu.io.MODEL_STATE_FILE, fu.io.OPTIMIZER_STATE_FILE]
    assert fu.io.verify_checkpoint(d) is True
    assert fu.io.load_trainer_state(d).step == 1000
    fu.io.begin_save(d)  # a new save drops the sentinel and the manifest first
    assert not (d / fu.io.MANIFEST_FILE).exists() and fu.io.load_trainer_state(d) is None


@pytest.mark.parametrize("victim", [fu.io.MODEL_STATE_FILE, fu.io.OPTIMIZER_STATE_FILE])
def test_flipped_payload_byte_is_named(ctx1, tmp_path, victim):
    d = tmp_path / "ckpt"
    _committed(ctx1, d)
    good = (d / victim).read_bytes()
    rng = random.Random(7)
    for pos in sorted(rng.sample(range(len(good)), 6)) + [len(good) - 1]:
        bad = bytearray(good)
        bad[pos] ^= 1 << rng.randrange(8)
        (d / victim).write_bytes(bytes(bad))
        with pytest.raises(fu.ChecksumMismatch, match=rf"{victim}: expected sha256"):
            fu.io.load_trainer_state(d)
    (d / victim).write_bytes(good[:-1])
    with pytest.raises(fu.ChecksumMismatch, match=rf"{victim}: expected sha256 .*got .*\({len(good) - 1} bytes\)"):
        fu.io.load_trainer_state(d)
    (d / victim).unlink()
    with pytest.raises(fu.ChecksumMismatch, match=rf"{victim}: listed in checksums.json but missing"):
        fu.io.load_trainer_state(d)
    (d / victim).write_bytes(good)
    assert fu.io.load_trainer_state(d).step == 1000


@pytest.mark.parametrize("text", [b"", b"{", b"[]", b'{"format": "x", "version": 1, "files": {}}',
                                  b'{"format": "fucina.checksums", "version": 2, "files": {}}',
                                  b'{"format": "fucina.checksums", "version": 1, "files": []}',
                                  b'{"format": "fucina.checksums", "version": 1, "files": {"a": 1}}',
                                  b'{"format": "fucina.checksums", "version": 1, "files": '
                                  b'{"a": {"sha256": "00", "size": -1.5}}}',
                                  b'{"format": "fucina.checksums", "version": 1, "files": '
                                  b'{"../x": {"sha256": "00", "size": 1}}}'])
def test_corrupt_manifest(ctx1, tmp_path, text):
    d = tmp_path / "ckpt"
    _committed(ctx1, d)
    (d / fu.io.MANIFEST_FILE).write_bytes(text)
    with pytest.raises(fu.ChecksumMismatch, match="checksums.json"):
        fu.io.load_trainer_state(d)


def test_directories_without_manifest_still_load(ctx1, tmp_path):
    d = tmp_path / "old"
    _committed(ctx1, d)
    (d / fu.io.MANIFEST_FILE).unlink()  # a checkpoint from before manifests
    assert fu.io.verify_checkpoint(d) is False
    assert fu.io.load_trainer_state(d).step == 1000
    (d / fu.io.MODEL_STATE_FILE).write_bytes(b"anything: nothing to check it against")
    assert fu.io.load_trainer_state(d).step == 1000
