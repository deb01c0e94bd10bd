"""Checkpoint directories (SPEC T-19): payload files replaced atomically, then
`trainer_state.json` written last as the commit sentinel.

    begin_save(d)                                   # mkdir -p, delete the old sentinel first
    write_file_atomic(d / MODEL_STATE_FILE, registry.save_state_dict)
    write_file_atomic(d / OPTIMIZER_STATE_FILE, opt.save_state)
    save_trainer_state(d, TrainerState(step=1000, seed=42))
    state = load_trainer_state(d)                   # None: no complete checkpoint here

A crash anywhere before the sentinel lands leaves a directory without a parseable sentinel,
which readers treat as absent; a crash inside one payload write leaves the previous file intact.
"""
from __future__ import annotations

import dataclasses
import decimal
import json
import math
import os
import secrets

from ..errors import InvalidTrainerState, UnsupportedTrainerStateVersion

MODEL_STATE_FILE = "model.safetensors"
ADAPTERS_STATE_FILE = "adapters.safetensors"
OPTIMIZER_STATE_FILE = "optimizer.fucina"
TRAINER_STATE_FILE = "trainer_state.json"
FORMAT_MARKER = "fucina.training_checkpoint"
VERSION = 1

_U64 = 1 << 64
_U32 = 1 << 32


def step_dir(save_dir, step: int) -> str:
    """Where periodic saves go: `<save_dir>/checkpoint-step-N`."""
    return os.path.join(os.fspath(save_dir), f"checkpoint-step-{step}")


def _fsync_dir(path) -> None:
    """Make a rename or unlink inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomic(path, writer_fn) -> None:
    """Write `path` through writer_fn(f) (f: a binary file) so that readers see the old file or
    the complete new one, never a part: a temp file in the same directory, flushed and fsynced,
    then os.replace. If writer_fn raises (or the process is interrupted), the temp file is
    removed, the old file is untouched and the exception propagates."""
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    while True:  # O_EXCL: never clobber another writer's temp file; 0o666 honours the umask
        tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            writer_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(parent)


def begin_save(dir_path) -> None:
    """Create the directory and delete its sentinel, so that until save_trainer_state runs the
    directory reads as "no checkpoint" whatever state the payload files are in."""
    dir_path = os.fspath(dir_path)
    os.makedirs(dir_path, exist_ok=True)
    try:
        os.unlink(os.path.join(dir_path, TRAINER_STATE_FILE))
    except FileNotFoundError:
        return
    _fsync_dir(dir_path)


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
    write_file_atomic(os.path.join(os.fspath(dir_path), TRAINER_STATE_FILE), lambda f: f.write(data))


def load_trainer_state(dir_path) -> TrainerState | None:
    """The directory's trainer state, or None when it has no sentinel or the sentinel is not
    JSON (an incomplete checkpoint). A JSON sentinel of the wrong shape raises
    InvalidTrainerState; another version raises UnsupportedTrainerStateVersion."""
    path = os.path.join(os.fspath(dir_path), TRAINER_STATE_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    obj = _json_object(data)
    return None if obj is None else _from_object(obj, path)
