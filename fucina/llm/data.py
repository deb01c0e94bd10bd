"""SFT data (SPEC T-22): instruction/response pairs, their encoding into (inputs, labels), and
a resumable sample-order loader.

    data = SftText.from_jsonl("pairs.jsonl")            # or SftText.from_pairs([Pair(q, a), ...])
    sample = encode_pair(tok, Template.CHATML, data.pairs[0], EncodeOptions(seq_max=256))
    loader = Loader(len(data.pairs), "shuffled", seed=42)
    i = loader.next(); state = loader.state(); loader.restore(state)

There is no padded batcher on purpose: the trainers take one flat sequence per loss call and
batching is gradient accumulation.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import EmptyDataset, InvalidLoaderState, MalformedJsonl, SampleTooLong
from ..rng import MASK64, at, splitmix64
from .template import Template

__all__ = ["IGNORE_INDEX", "Pair", "SftText", "EncodeOptions", "Sample", "encode_prompt",
           "encode_pair", "Loader", "LoaderState"]

IGNORE_INDEX = 2**64 - 1   # the label of a position that is not supervised


@dataclass(frozen=True)
class Pair:
    """One supervised example: the user's instruction and the assistant response to learn."""

    instruction: str
    response: str

    def __post_init__(self):
        for name in ("instruction", "response"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Pair: {name}: expected a str, got "
                                f"{type(getattr(self, name)).__name__}")


class SftText:
    """A list of Pairs, from memory or from a JSONL file."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __repr__(self):
        return f"SftText({len(self.pairs)} pairs)"

    @classmethod
    def from_pairs(cls, pairs) -> "SftText":
        """Use the caller's pairs as they are (no copy when given a list of Pair)."""
        if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
            raise TypeError(f"SftText.from_pairs: pairs: expected a sequence of Pair, got "
                            f"{type(pairs).__name__}")
        if not isinstance(pairs, list):
            pairs = list(pairs)
        for k, p in enumerate(pairs):
            if not isinstance(p, Pair):
                raise TypeError(f"SftText.from_pairs: pairs[{k}]: expected a Pair, got "
                                f"{type(p).__name__}")
        return cls(pairs)

    @classmethod
    def from_jsonl(cls, path, instruction_key: str = "instruction",
                   response_key: str = "response") -> "SftText":
        """One JSON object per line holding the two string keys. Lines are stripped of spaces,
        tabs and carriage returns; blank lines are skipped; any other line that is not such an
        object raises MalformedJsonl naming the file and the 1-based line number."""
        path = os.fspath(path)
        with open(path, "rb") as f:
            data = f.read()
        pairs = []
        for number, raw in enumerate(data.split(b"\n"), start=1):
            line = raw.strip(b" \t\r")
            if not line:
                continue
            where = f"SftText.from_jsonl: {path}:{number}"
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise MalformedJsonl(f"{where}: expected UTF-8 text, got an invalid byte at "
                                     f"column {e.start + 1}") from None
            except json.JSONDecodeError as e:
                raise MalformedJsonl(f"{where}: expected one JSON object per line, got invalid "
                                     f"JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise MalformedJsonl(f"{where}: expected a JSON object, got a JSON "
                                     f"{_json_kind(obj)}")
            values = []
            for key in (instruction_key, response_key):
                if key not in obj:
                    raise MalformedJsonl(f"{where}: expected a string under key {key!r}, the "
                                         f"key is missing")
                if not isinstance(obj[key], str):
                    raise MalformedJsonl(f"{where}: expected a string under key {key!r}, got a "
                                         f"JSON {_json_kind(obj[key])}")
                values.append(obj[key])
            pairs.append(Pair(*values))
        return cls(pairs)


def _json_kind(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}[type(value)]


@dataclass
class EncodeOptions:
    """How encode_prompt / encode_pair render and cut a sample."""

    seq_max: int = 256              # at most seq_max inputs (seq_max + 1 sequence tokens)
    ignore_index: int = IGNORE_INDEX
    mask_prompt: bool = True        # supervise the response only
    system: str | None = None
    think_off: bool = True


@dataclass(frozen=True)
class Sample:
    """One encoded example: `labels[i]` is the token that should follow `inputs[:i+1]`."""

    inputs: list
    labels: list


def encode_prompt(tok, template: Template, instruction: str, opts: EncodeOptions | None = None) -> list:
    """The ids of the first user turn (system and think_off from `opts`)."""
    opts = EncodeOptions() if opts is None else opts
    return tok.encode_raw(template.render_turn(opts.system, instruction, True, opts.think_off))


def encode_pair(tok, template: Template, pair: Pair, opts: EncodeOptions | None = None) -> Sample:
    """prompt ids ++ ids of (response + stop marker), encoded separately (encoding the joined
    text would move BPE boundaries across the join), cut to seq_max + 1 tokens, shifted into
    inputs and next-token labels; prompt positions are masked when `opts.mask_prompt`.
    SampleTooLong when no response token survives the cut."""
    opts = EncodeOptions() if opts is None else opts
    if not isinstance(pair, Pair):
        raise TypeError(f"encode_pair: pair: expected a Pair, got {type(pair).__name__}")
    if not isinstance(opts.seq_max, int) or isinstance(opts.seq_max, bool):
        raise TypeError(f"encode_pair: opts.seq_max: expected an int, got {opts.seq_max!r}")
    if opts.seq_max < 0:
        raise ValueError(f"encode_pair: opts.seq_max: expected an int >= 0, got {opts.seq_max}")
    prompt = encode_prompt(tok, template, pair.instruction, opts)
    response = tok.encode_raw(pair.response + template.stop_marker())
    total = min(len(prompt) + len(response), opts.seq_max + 1)
    if total < 2 or len(prompt) + 1 > total:
        raise SampleTooLong(
            f"encode_pair: the prompt is {len(prompt)} tokens and the response {len(response)}; "
            f"expected room for at least one response token within seq_max + 1 = "
            f"{opts.seq_max + 1} tokens")
    seq = (prompt + response)[:total]
    ignore, n_prompt = opts.ignore_index, len(prompt)
    labels = [ignore if opts.mask_prompt and i < n_prompt else seq[i] for i in range(1, total)]
    return Sample(seq[:-1], labels)


@dataclass(frozen=True)
class LoaderState:
    """Where a Loader is: the permutation comes back from (seed, epoch); `index` is the
    position of the next draw in it. Persisted as data_seed / data_epoch / data_index."""

    seed: int
    epoch: int
    index: int


class Loader:
    """Deterministic order over `n` dataset indices, resumable from a LoaderState.

    "sequential" yields 0, 1, ..., n-1, 0, ... . "shuffled" draws a new permutation per epoch,
    a pure function of (seed, epoch) — a checkpoint contract that must never change: start
    from the identity, `state = at(seed, epoch)`, then for i = n-1 down to 1:
    `value, state = splitmix64(state)`, `j = value % (i + 1)`, swap perm[i] and perm[j]."""

    ORDERS = ("sequential", "shuffled")

    def __init__(self, n: int, order: str = "sequential", seed: int = 0):
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"Loader: n: expected an int, got {n!r}")
        if n <= 0:
            raise EmptyDataset(f"Loader: expected at least one sample, got n = {n}")
        if order not in self.ORDERS:
            raise ValueError(f"Loader: order: expected one of {self.ORDERS}, got {order!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"Loader: seed: expected an int, got {type(seed).__name__}")
        self.n, self.order = n, order
        self.seed, self.epoch, self.index = seed & MASK64, 0, 0
        self.perm = self._permutation()

    def _permutation(self) -> list:
        perm = list(range(self.n))
        if self.order == "shuffled":
            state = at(self.seed, self.epoch)
            for i in range(self.n - 1, 0, -1):
                value, state = splitmix64(state)
                j = value % (i + 1)
                perm[i], perm[j] = perm[j], perm[i]
        return perm

    def next(self) -> int:
        """The next dataset index; the last one of an epoch starts the next epoch."""
        idx = self.perm[self.index]
        self.index += 1
        if self.index == self.n:
            self.epoch += 1
            self.index = 0
            self.perm = self._permutation()
        return idx

    def state(self) -> LoaderState:
        return LoaderState(self.seed, self.epoch, self.index)

    def restore(self, s: LoaderState) -> None:
        """Continue from `s` (taken from a Loader over the same n with the same order: the
        order itself is not part of the state)."""
        where = "Loader.restore"
        for name in ("seed", "epoch", "index"):
            v = getattr(s, name, None)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MASK64:
                raise InvalidLoaderState(f"{where}: {name}: expected an int in [0, 2^64), got {v!r}")
        if s.index >= self.n:
            raise InvalidLoaderState(f"{where}: index: expected an index < n = {self.n} (a "
                                     f"checkpoint of this dataset), got {s.index}")
        self.seed, self.epoch, self.index = s.seed, s.epoch, s.index
        self.perm = self._permutation()
