"""Checkpoint directories (SPEC T-19): payload files replaced atomically, then
`trainer_state.json` written last as the commit sentinel.

    begin_save(d)                                   # mkdir -p, delete the old sentinel first
    write_file_atomic(d / MODEL_STATE_FILE, registry.save_state_dict)
    write_file_atomic(d / OPTIMIZER_STATE_FILE, opt.save_state)
    save_trainer_state(d, TrainerState(step=1000, seed=42))  # checksums.json, then the sentinel
    state = load_trainer_state(d)                   # None: no complete checkpoint here

A crash anywhere before the sentinel lands leaves a directory without a parseable sentinel,
which readers treat as absent; a crash inside one payload write leaves the previous file intact,
and its temp file is either nameless (O_TMPFILE) or removed by the next save into the directory.
`checksums.json` (sha256 and size per payload file, not in SPEC T-19) is written just before the
sentinel and checked by load_trainer_state: a changed payload raises ChecksumMismatch naming it.
Directories without it (older checkpoints) load unchecked.
"""
from __future__ import annotations

import dataclasses
import decimal
import hashlib
import json
import math
import os

from ..errors import ChecksumMismatch, InvalidTrainerState, UnsupportedTrainerStateVersion
from ..files import fsync_dir, remove_stale_temps, write_file_atomic  # noqa: F401 (re-exported)

MODEL_STATE_FILE = "model.safetensors"
ADAPTERS_STATE_FILE = "adapters.safetensors"
OPTIMIZER_STATE_FILE = "optimizer.fucina"
TRAINER_STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "checksums.json"
MANIFEST_FORMAT = "fucina.checksums"
_PAYLOAD_SUFFIXES = (".safetensors", ".fucina")
_PAYLOAD_NAMES = ("ternary.gguf",)  # fucina.es genomes (other GGUFs there are exports, not state)
FORMAT_MARKER = "fucina.training_checkpoint"
VERSION = 1

_U64 = 1 << 64
_U32 = 1 << 32


def step_dir(save_dir, step: int) -> str:
    """Where periodic saves go: `<save_dir>/checkpoint-step-N`."""
    return os.path.join(os.fspath(save_dir), f"checkpoint-step-{step}")


def begin_save(dir_path) -> None:
    """Create the directory and delete its sentinel, so that until save_trainer_state runs the
    directory reads as "no checkpoint" whatever state the payload files are in."""
    dir_path = os.fspath(dir_path)
    os.makedirs(dir_path, exist_ok=True)
    removed = False
    for name in (TRAINER_STATE_FILE, MANIFEST_FILE):  # the sentinel first: it commits
        try:
            os.unlink(os.path.join(dir_path, name))
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        fsync_dir(dir_path)


def _sha256(path: str) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return h.hexdigest(), size
            h.update(chunk)
            size += len(chunk)


def _payload_names(dir_path: str) -> list[str]:
    """The payload files: regular *.safetensors / *.fucina files and the ES genomes, sorted."""
    out = []
    for e in os.scandir(dir_path):
        if (e.name.endswith(_PAYLOAD_SUFFIXES) or e.name in _PAYLOAD_NAMES) \
                and e.is_file(follow_symlinks=True):
            out.append(e.name)
    return sorted(out)


def write_manifest(dir_path) -> None:
    """Write `checksums.json` (sha256 and size of every payload file) atomically: the step
    before the sentinel, so a committed checkpoint always carries the digests of its payload."""
    dir_path = os.fspath(dir_path)
    os.makedirs(dir_path, exist_ok=True)
    files = {}
    for name in _payload_names(dir_path):
        digest, size = _sha256(os.path.join(dir_path, name))
        files[name] = {"sha256": digest, "size": size}
    data = (json.dumps({"format": MANIFEST_FORMAT, "version": 1, "files": files}, indent=2,
                       sort_keys=False) + "\n").encode()
    write_file_atomic(os.path.join(dir_path, MANIFEST_FILE), lambda f: f.write(data))


def verify_checkpoint(dir_path) -> bool:
    """Check every file `checksums.json` lists against its sha256 and size: ChecksumMismatch
    naming the file on any difference (missing included) or an unreadable manifest. False when
    the directory has no manifest (checkpoints from before manifests), True when all match."""
    dir_path = os.fspath(dir_path)
    where = os.path.join(dir_path, MANIFEST_FILE)
    try:
        with open(where, "rb") as f:
            obj = _json_object(f.read())
    except (FileNotFoundError, NotADirectoryError):
        return False
    files = obj.get("files") if isinstance(obj, dict) and obj.get("format") == MANIFEST_FORMAT \
        and obj.get("version") == 1 else None
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and _is_int(v.get("size"))
            for v in files.values()):
        raise ChecksumMismatch(f"verify_checkpoint: {where}: expected a {MANIFEST_FORMAT} "
                               f"version 1 manifest, got unparseable or malformed bytes")
    for name, want in files.items():
        path = os.path.join(dir_path, name)
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ChecksumMismatch(f"verify_checkpoint: {where}: expected plain file names, got "
                                   f"{name!r}")
        try:
            digest, size = _sha256(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ChecksumMismatch(f"verify_checkpoint: {path}: listed in {MANIFEST_FILE} but "
                                   f"missing") from None
        if size != want["size"] or digest != want["sha256"]:
            raise ChecksumMismatch(f"verify_checkpoint: {path}: expected sha256 {want['sha256']} "
                                   f"({want['size']} bytes), got {digest} ({size} bytes)")
    return True


@dataclasses.dataclass
class TrainerState:
    """The sentinel's fields. Optional ones are written only when set, in declaration order
    (that order is the file format). u64 fields are ints, f64 fields floats."""

    step: int = 0
    seed: int = 0
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout_p: float | None = None
    learning_rate: float | None = None
    accum_steps: int | None = None
    data_seed: int | None = None
    data_epoch: int | None = None
    data_index: int | None = None
    es_sigma: float | None = None
    es_alpha: float | None = None
    es_population: int | None = None
    es_noise: int | None = None          # 0 iid, 1 correlated
    es_antithetic: int | None = None     # 1 mirrored pairs
    es_anchor_decay: int | None = None   # 0/absent none, 1 l1, 2 l2
    es_anchor_lambda: float | None = None
    es_ternary_flip_rate: float | None = None
    es_ternary_update_fraction: float | None = None
    es_ternary_update_decay: float | None = None
    es_iteration: int | None = None
    version: int = VERSION


_REQUIRED = ("step", "seed")
_OPTIONAL = tuple(f.name for f in dataclasses.fields(TrainerState)
                  if f.name not in _REQUIRED and f.name != "version")
_FLOAT_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainerState) if f.type == "float | None")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_f64(v) -> float | None:
    """v as a finite float, or None (bools, non-numbers, infinities, ints beyond f64)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _u64_text(name: str, v, limit: int = _U64) -> str:
    if not _is_int(v) or not 0 <= v < limit:
        raise InvalidTrainerState(f"save_trainer_state: field {name!r}: expected an integer in "
                                  f"[0, {limit}), got {v!r}")
    return str(v)


def _f64_text(name: str, v) -> str:
    """Zig's `{d}`: the shortest round-trip digits in positional notation (16 -> "16",
    1e-3 -> "0.001", 1e-10 -> "0.0000000001")."""
    f = _as_f64(v)
    if f is None:
        raise InvalidTrainerState(f"save_trainer_state: field {name!r}: expected a finite number, "
                                  f"got {v!r}")
    text = format(decimal.Decimal(repr(f)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def format_trainer_state(state: TrainerState) -> bytes:
    """The sentinel's exact bytes (SPEC T-19)."""
    lines = [f'  "format": "{FORMAT_MARKER}"',
             f'  "version": {_u64_text("version", state.version, _U32)}',
             f'  "step": {_u64_text("step", state.step)}',
             f'  "seed": {_u64_text("seed", state.seed)}']
    for name in _OPTIONAL:
        v = getattr(state, name)
        if v is not None:
            text = _f64_text(name, v) if name in _FLOAT_FIELDS else _u64_text(name, v)
            lines.append(f'  "{name}": {text}')
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode()


def _reject_constant(name):
    raise ValueError(f"non-JSON number {name}")


def _json_object(data: bytes):
    """The parsed JSON value, or None when the bytes are not JSON at all."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def _from_object(obj, where: str) -> TrainerState:
    if not isinstance(obj, dict):
        raise InvalidTrainerState(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT_MARKER:
        raise InvalidTrainerState(f"{where}: expected \"format\": \"{FORMAT_MARKER}\", "
                                  f"got {obj.get('format')!r}")

    def u64(name, limit=_U64):
        v = obj.get(name)
        if not _is_int(v) or not 0 <= v < limit:
            raise InvalidTrainerState(f"{where}: field {name!r}: expected an integer in "
                                      f"[0, {limit}), got {v!r}")
        return v

    version = u64("version", _U32)
    if version != VERSION:
        raise UnsupportedTrainerStateVersion(f"{where}: expected version {VERSION}, got {version}")
    values = {"version": version, "step": u64("step"), "seed": u64("seed")}
    for name in _OPTIONAL:
        if name not in obj:
            continue
        if name in _FLOAT_FIELDS:
            v = _as_f64(obj[name])
            if v is None:
                raise InvalidTrainerState(f"{where}: field {name!r}: expected a finite number, "
                                          f"got {obj[name]!r}")
            values[name] = v
        else:
            values[name] = u64(name)
    return TrainerState(**values)


def parse_trainer_state(data: bytes, where: str = TRAINER_STATE_FILE) -> TrainerState:
    """Parse sentinel bytes: InvalidTrainerState (not JSON, wrong format marker, a field of the
    wrong type), UnsupportedTrainerStateVersion. Unknown keys are ignored; a missing optional
    field is None."""
    obj = _json_object(data)
    if obj is None:
        raise InvalidTrainerState(f"{where}: expected a JSON document, got unparseable bytes")
    return _from_object(obj, where)


def save_trainer_state(dir_path, state: TrainerState) -> None:
    """Write the sentinel atomically: the last step of a save (it commits the checkpoint)."""
    data = format_trainer_state(state)  # validate before touching the directory
    write_manifest(dir_path)
    write_file_atomic(os.path.join(os.fspath(dir_path), TRAINER_STATE_FILE), lambda f: f.write(data))


def load_trainer_state(dir_path) -> TrainerState | None:
    """The directory's trainer state, or None when it has no sentinel or the sentinel is not
    JSON (an incomplete checkpoint). A JSON sentinel of the wrong shape raises
    InvalidTrainerState; another version raises UnsupportedTrainerStateVersion; a payload file
    that disagrees with `checksums.json` raises ChecksumMismatch naming it (verify_checkpoint:
    every loader reads the sentinel first, so this is where the whole directory is checked)."""
    path = os.path.join(os.fspath(dir_path), TRAINER_STATE_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    obj = _json_object(data)
    if obj is None:
        return None
    state = _from_object(obj, path)
    verify_checkpoint(dir_path)
    return state
