"""SFT data (SPEC T-22): instruction/response pairs, their encoding into (inputs, labels), and
a resumable sample-order loader.

    data = SftText.from_jsonl("pairs.jsonl")            # or SftText.from_pairs([Pair(q, a), ...])
    sample = encode_pair(tok, Template.CHATML, data.pairs[0], EncodeOptions(seq_max=256))
    loader = Loader(len(data.pairs), "shuffled", seed=42)
    i = loader.next(); state = loader.state(); loader.restore(state)

Data as users have it: a JSONL line is either an instruction/response pair or a chat
`{"messages": [{"role", "content"}, ...]}` (multi-turn, system turns) — a `Conversation`.
`encode_chat` renders either through the model file's own `ChatTemplate` and supervises only
the assistant turns (their content and the end-of-turn marker after it).

There is no padded batcher on purpose: the trainers take one flat sequence per loss call and
batching is gradient accumulation.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import (ChatTemplateError, EmptyDataset, InvalidArgument, InvalidArgumentType,
                      InvalidLoaderState, MalformedJsonl, SampleTooLong)
from ..rng import MASK64, at, splitmix64
from .template import ChatTemplate, Template

__all__ = ["IGNORE_INDEX", "Pair", "Conversation", "SftText", "EncodeOptions", "Sample",
           "encode_prompt", "encode_pair", "encode_chat", "chat_messages", "chat_prompt_text", "Loader",
           "LoaderState"]

IGNORE_INDEX = 2**64 - 1   # the label of a position that is not supervised


@dataclass(frozen=True)
class Pair:
    """One supervised example: the user's instruction and the assistant response to learn."""

    instruction: str
    response: str

    def __post_init__(self):
        for name in ("instruction", "response"):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgumentType(f"Pair: {name}: expected a str, got "
                                          f"{type(getattr(self, name)).__name__}")


@dataclass(frozen=True)
class Conversation:
    """One chat to learn from: `messages` are {"role", "content"} dicts (system, user and
    assistant turns in any number); every assistant turn is supervised."""

    messages: tuple

    def __post_init__(self):
        where = "Conversation"
        if isinstance(self.messages, (str, bytes, dict)) or not isinstance(self.messages,
                                                                            (list, tuple)):
            raise InvalidArgumentType(f"{where}: messages: expected a list of dicts, got "
                                      f"{type(self.messages).__name__}")
        checked = []
        for k, m in enumerate(self.messages):
            if not isinstance(m, dict):
                raise InvalidArgumentType(f"{where}: messages[{k}]: expected a dict, got "
                                          f"{type(m).__name__}")
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    raise InvalidArgumentType(f"{where}: messages[{k}][{key!r}]: expected a str, "
                                              f"got {type(m.get(key)).__name__}")
            checked.append(dict(m))
        if not any(m["role"] == "assistant" for m in checked):
            raise InvalidArgument(f"{where}: messages: expected at least one assistant turn to "
                                  f"supervise, got roles {[m['role'] for m in checked]}")
        object.__setattr__(self, "messages", tuple(checked))

    @property
    def instruction(self) -> str:
        """The first user turn (what BEFORE/AFTER samples ask)."""
        return next((m["content"] for m in self.messages if m["role"] == "user"), "")

    @property
    def response(self) -> str:
        """The first assistant turn."""
        return next(m["content"] for m in self.messages if m["role"] == "assistant")


class SftText:
    """A list of examples (Pair or Conversation), from memory or from a JSONL file. The
    attribute keeps its SPEC name `pairs`."""

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
            raise InvalidArgumentType("SftText.from_pairs: pairs: expected a sequence of Pair, "
                                      f"got {type(pairs).__name__}")
        if not isinstance(pairs, list):
            pairs = list(pairs)
        for k, p in enumerate(pairs):
            if not isinstance(p, Pair):
                raise InvalidArgumentType(f"SftText.from_pairs: pairs[{k}]: expected a Pair, got "
                                          f"{type(p).__name__}")
        return cls(pairs)

    @classmethod
    def from_jsonl(cls, path, instruction_key: str = "instruction",
                   response_key: str = "response", messages_key: str = "messages") -> "SftText":
        """One JSON object per line holding the two string keys, or a `messages_key` list of
        {"role", "content"} objects (a Conversation). Lines are stripped of spaces, tabs and
        carriage returns; blank lines are skipped; any other line that is not such an object
        raises MalformedJsonl naming the file and the 1-based line number."""
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
            if messages_key in obj:
                pairs.append(_conversation(obj[messages_key], messages_key, where))
                continue
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


def _conversation(value, key, where) -> Conversation:
    if not isinstance(value, list):
        raise MalformedJsonl(f"{where}: expected a list of messages under key {key!r}, got a "
                             f"JSON {_json_kind(value)}")
    for k, m in enumerate(value):
        if not isinstance(m, dict):
            raise MalformedJsonl(f"{where}: {key}[{k}]: expected a JSON object with 'role' and "
                                 f"'content', got a JSON {_json_kind(m)}")
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                got = "the key is missing" if field not in m else \
                    f"got a JSON {_json_kind(m[field])}"
                raise MalformedJsonl(f"{where}: {key}[{k}]: expected a string under key "
                                     f"{field!r}, {got}")
    if not any(m["role"] == "assistant" for m in value):
        raise MalformedJsonl(f"{where}: {key}: expected at least one assistant turn to "
                             f"supervise, got roles {[m['role'] for m in value]}")
    return Conversation(tuple({"role": m["role"], "content": m["content"]} for m in value))


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
    """The ids of the first user turn (system and think_off from `opts`); a ChatTemplate
    renders it as the served prompt of that one turn."""
    opts = EncodeOptions() if opts is None else opts
    if isinstance(template, ChatTemplate):
        head = [] if opts.system is None else [{"role": "system", "content": opts.system}]
        return tok.encode_raw(chat_prompt_text(
            template, head + [{"role": "user", "content": instruction}], opts))
    return tok.encode_raw(template.render_turn(opts.system, instruction, True, opts.think_off))


def encode_pair(tok, template: Template, pair: Pair, opts: EncodeOptions | None = None) -> Sample:
    """prompt ids ++ ids of (response + stop marker), encoded separately (encoding the joined
    text would move BPE boundaries across the join), cut to seq_max + 1 tokens, shifted into
    inputs and next-token labels; prompt positions are masked when `opts.mask_prompt`.
    SampleTooLong when no response token survives the cut."""
    opts = EncodeOptions() if opts is None else opts
    if isinstance(template, ChatTemplate):   # the file's own template: see encode_chat
        if not isinstance(pair, Pair):
            raise InvalidArgumentType("encode_pair: pair: expected a Pair, got "
                                      f"{type(pair).__name__}")
        return encode_chat(tok, template, pair, opts)
    if not isinstance(pair, Pair):
        raise InvalidArgumentType(f"encode_pair: pair: expected a Pair, got {type(pair).__name__}")
    if not isinstance(opts.seq_max, int) or isinstance(opts.seq_max, bool):
        raise InvalidArgumentType("encode_pair: opts.seq_max: expected an int, got "
                                  f"{opts.seq_max!r}")
    if opts.seq_max < 0:
        raise InvalidArgument("encode_pair: opts.seq_max: expected an int >= 0, got "
                              f"{opts.seq_max}")
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


def chat_messages(example, system: str | None = None) -> list:
    """The messages of a Pair ([system], user, assistant) or a Conversation (as given)."""
    if isinstance(example, Conversation):
        return [dict(m) for m in example.messages]
    if isinstance(example, Pair):
        head = [] if system is None else [{"role": "system", "content": system}]
        return head + [{"role": "user", "content": example.instruction},
                       {"role": "assistant", "content": example.response}]
    raise InvalidArgumentType(f"chat_messages: example: expected a Pair or a Conversation, got "
                              f"{type(example).__name__}")


def _variables(template: ChatTemplate, opts: EncodeOptions) -> dict:
    # the reasoning switch only where the template has one (Qwen3's enable_thinking)
    if template.builtin is not None or template.uses("enable_thinking"):
        return {"enable_thinking": not opts.think_off}
    return {}


def chat_prompt_text(template: ChatTemplate, messages, opts: EncodeOptions | None = None) -> str:
    """The served prompt of `messages`: rendered with the generation prompt."""
    opts = EncodeOptions() if opts is None else opts
    return template.render(messages, True, **_variables(template, opts))


_HOLE = "\ue000{}\ue001"   # private-use code points: survive trim, never in real data


def _assistant_spans(template: ChatTemplate, messages, variables, where) -> tuple[str, list]:
    """(full text up to the end of the last assistant turn, [(start, end)] character spans of
    each assistant turn's content plus the end-of-turn marker that follows it).

    The spans are found by rendering once more with a marker string (_HOLE) in place of each
    assistant content: the text between markers is the template's own, so each content's rendered
    form (after the template's trim and the like) is what lies between those pieces."""
    full = template.render(messages, False, **variables)
    holes = [dict(m) for m in messages]
    slots = [k for k, m in enumerate(holes) if m["role"] == "assistant"]
    for n, k in enumerate(slots):
        holes[k]["content"] = _HOLE.format(n)
    skeleton = template.render(holes, False, **variables)
    pieces, rest = [], skeleton
    for n in range(len(slots)):
        mark = _HOLE.format(n)
        if rest.count(mark) != 1:
            raise ChatTemplateError(f"{where}: the chat template does not write assistant "
                                    f"turn {n} exactly once; cannot tell which text to supervise")
        head, rest = rest.split(mark)
        pieces.append(head)
    pieces.append(rest)
    stops = template.stop_strings()
    spans, pos = [], 0
    for n in range(len(slots)):
        if not full.startswith(pieces[n], pos):
            raise ChatTemplateError(f"{where}: the chat template renders the text around "
                                    f"assistant turn {n} differently for different contents")
        start = pos + len(pieces[n])
        nxt = pieces[n + 1]
        if n + 1 == len(slots):
            end = len(full) - len(nxt)
            if end < start or not full.endswith(nxt):
                raise ChatTemplateError(f"{where}: the chat template renders the text after "
                                        f"the last assistant turn differently for different "
                                        f"contents")
        else:
            end = full.find(nxt, start) if nxt else start
            if end < 0:
                raise ChatTemplateError(f"{where}: the chat template renders the text after "
                                        f"assistant turn {n} differently for different contents")
        marker = next((m for m in stops if nxt.startswith(m)), None)
        if marker is None:
            raise ChatTemplateError(f"{where}: assistant turn {n} is not followed by an "
                                    f"end-of-turn marker {stops}; expected the template to "
                                    f"close every assistant turn")
        spans.append((start, end + len(marker)))
        pos = end
    return full[:spans[-1][1]], spans


def encode_chat(tok, template: ChatTemplate, example, opts: EncodeOptions | None = None) -> Sample:
    """A Pair or Conversation rendered through the model file's own `template` and encoded so
    that only assistant turns (content + end-of-turn marker) are supervised.

    The text is cut at the assistant spans and each piece is encoded on its own, as SPEC T-22
    encodes prompt and response separately: the tokens before a reply are exactly what the
    served prompt (`chat_prompt_text` of the turns before it) encodes to, and the reply's
    tokens are the reply encoded alone, as generation produces them — no BPE merge crosses a
    boundary. The text after the last assistant turn is dropped. Cut to seq_max + 1 tokens;
    SampleTooLong when no supervised token survives (or `opts.mask_prompt` is off: then every
    position is supervised)."""
    opts = EncodeOptions() if opts is None else opts
    where = "encode_chat"
    if not isinstance(template, ChatTemplate):
        raise InvalidArgumentType(f"{where}: template: expected a ChatTemplate, got "
                                  f"{type(template).__name__}")
    if not isinstance(opts.seq_max, int) or isinstance(opts.seq_max, bool) or opts.seq_max < 0:
        raise InvalidArgument(f"{where}: opts.seq_max: expected an int >= 0, got {opts.seq_max!r}")
    messages = chat_messages(example, opts.system)
    text, spans = _assistant_spans(template, messages, _variables(template, opts), where)
    seq, supervised, pos = [], [], 0
    for start, end in spans:
        ids = tok.encode_raw(text[pos:start])
        seq += ids
        supervised += [False] * len(ids)
        ids = tok.encode_raw(text[start:end])
        seq += ids
        supervised += [True] * len(ids)
        pos = end
    total = min(len(seq), opts.seq_max + 1)
    ignore = opts.ignore_index
    labels = [seq[i] if supervised[i] or not opts.mask_prompt else ignore
              for i in range(1, total)]
    if total < 2 or all(y == ignore for y in labels):
        first = supervised.index(True) if True in supervised else len(seq)
        raise SampleTooLong(
            f"{where}: the first supervised token is at position {first} of {len(seq)}; "
            f"expected at least one within seq_max + 1 = {opts.seq_max + 1} tokens")
    return Sample(seq[:total - 1], labels)


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
            raise InvalidArgumentType(f"Loader: n: expected an int, got {n!r}")
        if n <= 0:
            raise EmptyDataset(f"Loader: expected at least one sample, got n = {n}")
        if order not in self.ORDERS:
            raise InvalidArgument(f"Loader: order: expected one of {self.ORDERS}, got {order!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InvalidArgumentType(f"Loader: seed: expected an int, got {type(seed).__name__}")
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
