"""Byte-level BPE tokenizer read from GGUF metadata (`tokenizer.ggml.model == "gpt2"`).

This is the tokenizer of Qwen2/Qwen3, SmolLM2 and Llama-3 GGUF files:

    tok = Tokenizer.from_gguf(fu.gguf.read(path, ctx))
    ids = tok.encode_raw("<|im_start|>user\\nhi<|im_end|>")   # no BOS/EOS added
    tok.decode(ids)

Encoding, in the order the original (Hugging Face) tokenizers apply it and llama.cpp mirrors:
1. special tokens — every CONTROL, USER_DEFINED and UNKNOWN token of `tokenizer.ggml.token_type`
   (e.g. `<|im_start|>`, `<think>`) — are cut out of the text whole, leftmost-longest first;
2. the text between them is split into pre-tokens by the regex that `tokenizer.ggml.pre`
   selects ("gpt-2", "qwen2", "smollm", "llama-bpe" / "llama3");
3. each pre-token's UTF-8 bytes are mapped to GPT-2's printable byte alphabet and merged by BPE:
   repeatedly the adjacent pair of lowest rank in `tokenizer.ggml.merges` (leftmost on ties);
   with "llama-bpe" / "llama3" a pre-token that is a vocabulary entry as a whole is taken
   directly (HF's `ignore_merges`). Results are cached per pre-token (LRU).

Decoding is the exact byte inverse (no clean-up of spaces): normal tokens map back through the
byte alphabet, special tokens give their text, BYTE tokens `<0xNN>` their byte, UNUSED tokens
nothing (llama.cpp's rule); the bytes are then read as UTF-8 (invalid sequences become U+FFFD;
`decode_bytes` returns the raw bytes, for streaming).
"""
from __future__ import annotations

import functools
import heapq
import operator
from collections.abc import Mapping

import regex

from ..errors import IndexOutOfBounds, InvalidArgumentType, UnsupportedTokenizer

__all__ = ["Tokenizer", "Vocabulary", "UnsupportedTokenizer", "PRE_TOKENIZERS", "NORMAL", "UNKNOWN", "CONTROL",
           "USER_DEFINED", "UNUSED", "BYTE"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_MATCHED_WHOLE = (CONTROL, USER_DEFINED, UNKNOWN)

# Pre-tokenizer regex per `tokenizer.ggml.pre`, as each model's tokenizer.json configures it
# (llama.cpp's llama-vocab.cpp selects the same ones). SmolLM's tokenizer.json first isolates every
# digit and then applies GPT-2's regex to the pieces between digits; _SMOLLM is that two-pass split
# as one regex: a lone digit first, no multi-digit alternative, and GPT-2's "whitespace not
# followed by a non-space" where a digit counts as the end of a piece.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_SMOLLM = r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt-2": _GPT2, "qwen2": _QWEN2, "smollm": _SMOLLM, "llama-bpe": _LLAMA3,
                  "llama3": _LLAMA3, "llama-v3": _LLAMA3}
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})


def merge_pairs(syms: list, priority) -> None:
    """BPE over the symbols `syms` in place: the adjacent pair of smallest priority(left,
    right) merges first (ties: the leftmost), until no pair has a priority (None). A heap of
    pairs keyed (priority, left position); a popped pair is applied only if both of its
    symbols are still what they were when pushed. A merged-away slot becomes False; a None
    symbol never merges. Shared by the byte-level BPE (merge ranks) and SentencePiece
    (scores)."""
    n = len(syms)
    if n < 2:
        return
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        a, b = syms[i], syms[i + 1]
        if a is not None and b is not None:
            k = priority(a, b)
            if k is not None:
                heap.append((k, i, a, b))
    heapq.heapify(heap)
    while heap:
        _, i, left, right = heapq.heappop(heap)
        j = nxt[i]
        if j < 0 or syms[i] != left or syms[j] != right:
            continue   # stale: one side was merged since
        merged = left + right
        syms[i], syms[j] = merged, False
        k2 = nxt[j]
        nxt[i] = k2
        if k2 >= 0:
            prv[k2] = i
            if syms[k2] is not None:
                r = priority(merged, syms[k2])
                if r is not None:
                    heapq.heappush(heap, (r, i, merged, syms[k2]))
        p = prv[i]
        if p >= 0 and syms[p] is not None:
            r = priority(syms[p], merged)
            if r is not None:
                heapq.heappush(heap, (r, p, syms[p], merged))


def literal_matcher(strings):
    """A compiled regex matching any of `strings`, leftmost and then longest, or None when
    there are none. Written as a trie (shared prefixes factored out, a longer continuation
    tried before stopping) so that thousands of special tokens (Gemma has 6,400) match at the
    speed of a few: a flat alternation is tried entry by entry at every position."""
    trie: dict = {}
    for t in strings:
        if t:
            node = trie
            for c in t:
                node = node.setdefault(c, {})
            node[""] = {}

    def pattern(node) -> str:
        alts = [regex.escape(c) + pattern(child) for c, child in sorted(node.items()) if c]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return regex.compile(pattern(trie)) if trie else None


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map: bytes that are printable Latin-1 stand for
    themselves, the other 68 take the code points 256, 257, ... in byte order."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, shift = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shift))
            shift += 1
    return out


_BYTE_CHAR = byte_alphabet()
_CHAR_BYTE = {c: b for b, c in enumerate(_BYTE_CHAR)}
_LATIN1_TO_ALPHABET = {b: c for b, c in enumerate(_BYTE_CHAR)}   # str.translate table


class Vocabulary:
    """What every GGUF tokenizer shares: `tokens[id]`, token types, special ids and the BOS/EOS
    policy, id lookups and byte-exact decoding. Subclasses set `_tokens`, `_to_id`, `_types`,
    `_pieces` (each id's decoded bytes) and implement `encode_raw`."""

    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False   # tokenizer.ggml.add_bos_token: the model expects BOS first
    add_eos: bool = False   # tokenizer.ggml.add_eos_token

    def _special_id(self, where, name, value):
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(self._tokens):
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.{name}_token_id: expected an id in "
                                       f"[0, {len(self._tokens)}), got {value!r}")
        return value

    def _set_policy(self, where, add_bos, add_eos):
        for name, flag in (("add_bos_token", add_bos), ("add_eos_token", add_eos)):
            if not isinstance(flag, bool):
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.{name}: expected a bool, "
                                           f"got {flag!r}")
        if add_bos and self.bos_id is None:
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.add_bos_token is true; expected "
                                       f"tokenizer.ggml.bos_token_id, got none")
        if add_eos and self.eos_id is None:
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.add_eos_token is true; expected "
                                       f"tokenizer.ggml.eos_token_id, got none")
        self.add_bos, self.add_eos = add_bos, add_eos

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_to_id(self, text: str) -> int | None:
        """The id of the vocabulary entry spelled exactly `text` (as the GGUF file spells it:
        "Ġthe" in byte-level BPE, "▁the" in SentencePiece), or None."""
        return self._to_id.get(text)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` as stored in the GGUF file."""
        return self._tokens[self._check_id("id_to_token", 0, token_id)]

    def token_type(self, token_id: int) -> int:
        """tokenizer.ggml.token_type of `token_id` (NORMAL, CONTROL, USER_DEFINED, ...)."""
        return self._types[self._check_id("token_type", 0, token_id)]

    def _check_id(self, op, pos, token_id) -> int:
        try:
            token_id = operator.index(token_id)
        except TypeError:
            raise InvalidArgumentType(f"Tokenizer.{op}: ids[{pos}]: expected an int, got "
                                      f"{type(token_id).__name__}") from None
        if not 0 <= token_id < len(self._tokens):
            raise IndexOutOfBounds(f"Tokenizer.{op}: ids[{pos}]: expected an id in "
                                   f"[0, {len(self._tokens)}), got {token_id}")
        return token_id

    def encode(self, text: str) -> list[int]:
        """encode_raw(text) with BOS / EOS added as the file's add_bos_token / add_eos_token
        ask (plain text, e.g. a perplexity passage; chat templates write their own BOS)."""
        ids = self.encode_raw(text)
        return ([self.bos_id] if self.add_bos else []) + ids + ([self.eos_id] if self.add_eos else [])

    def decode_bytes(self, ids) -> bytes:
        """The bytes the ids stand for (a token may end mid-character: join before decoding)."""
        ids = list(ids)
        pieces = self._pieces
        try:
            if min(ids, default=0) >= 0:
                return b"".join([pieces[i] for i in ids])
        except (TypeError, IndexError):
            pass   # the checked path names the offending id
        return b"".join(pieces[self._check_id("decode", k, i)] for k, i in enumerate(ids))

    def decode(self, ids) -> str:
        """The text of `ids` (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class Tokenizer(Vocabulary):
    """A byte-level BPE vocabulary: `tokens[id]`, merge ranks, token types, special ids.
    `Tokenizer.from_gguf` returns a SentencePiece tokenizer (fucina.llm.spm) for
    `tokenizer.ggml.model == "llama"` files: the same surface."""

    def __init__(self, tokens, merges, *, token_types=None, pre="gpt-2", bos_id=None,
                 eos_id=None, pad_id=None, add_bos=False, add_eos=False, cache_size=1 << 16):
        where = "Tokenizer"
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedTokenizer(
                f"{where}: tokenizer.ggml.pre {pre!r} is not supported; expected one of "
                f"{sorted(PRE_TOKENIZERS)}")
        tokens = list(tokens)
        if not tokens:
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.tokens: expected a non-empty list")
        self._to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if not isinstance(t, str):
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.tokens[{i}]: expected a str, "
                                           f"got {type(t).__name__}")
            if t in self._to_id:
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.tokens: duplicate token {t!r} "
                                           f"at ids {self._to_id[t]} and {i}")
            self._to_id[t] = i
        self._tokens = tokens
        if token_types is None:
            token_types = [NORMAL] * len(tokens)
        token_types = list(token_types)
        if len(token_types) != len(tokens):
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.token_type: expected "
                                       f"{len(tokens)} entries (one per token), got {len(token_types)}")
        self._types = token_types
        self._ranks: dict[tuple[str, str], int] = {}
        for r, m in enumerate(merges):
            if not isinstance(m, str):
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.merges[{r}]: expected a str "
                                           f"'left right', got {type(m).__name__}")
            cut = m.find(" ", 1)
            if cut < 0:
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.merges[{r}]: expected "
                                           f"'left right', got {m!r}")
            self._ranks.setdefault((m[:cut], m[cut + 1:]), r)
        self.pre = pre
        self.bos_id = self._special_id(where, "bos", bos_id)
        self.eos_id = self._special_id(where, "eos", eos_id)
        self.pad_id = self._special_id(where, "padding", pad_id)
        self._set_policy(where, add_bos, add_eos)
        self._pattern = regex.compile(PRE_TOKENIZERS[pre])
        self._ignore_merges = pre in _IGNORE_MERGES
        self._special_re = literal_matcher(t for t, ty in zip(tokens, token_types)
                                           if ty in _MATCHED_WHOLE)
        self._pieces = self._piece_bytes()
        self._encode_word = functools.lru_cache(maxsize=cache_size)(self._bpe_word)

    @classmethod
    def from_gguf(cls, gguf_file, **kw) -> "Tokenizer":
        """The tokenizer of a GGUF file: a `fu.gguf.read(...)` result, or its metadata mapping.
        Reads `tokenizer.ggml.{model, pre, tokens, token_type, merges, bos_token_id,
        eos_token_id, padding_token_id, add_bos_token, add_eos_token}` as llama.cpp's convert
        script writes them. A SentencePiece file (`tokenizer.ggml.model == "llama"`: Gemma,
        Llama-2, Mistral) gives a `fucina.llm.spm.SpmTokenizer` with the same surface."""
        meta = gguf_file if isinstance(gguf_file, Mapping) else getattr(gguf_file, "metadata", None)
        if not isinstance(meta, Mapping):
            raise InvalidArgumentType("Tokenizer.from_gguf: expected a GGUF file (fu.gguf.read) "
                                      f"or its metadata mapping, got {type(gguf_file).__name__}")
        where = "Tokenizer.from_gguf"
        model = meta.get("tokenizer.ggml.model")
        if model == "llama" and cls is Tokenizer:
            from .spm import SpmTokenizer
            return SpmTokenizer.from_gguf(meta, **kw)
        if model != "gpt2":
            raise UnsupportedTokenizer(
                f"{where}: tokenizer.ggml.model {model!r} is not supported; expected 'gpt2' "
                f"(byte-level BPE: Qwen2/3, SmolLM2, Llama-3) or 'llama' (SentencePiece: Gemma)")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if not isinstance(meta.get(key), list):
                raise UnsupportedTokenizer(f"{where}: {key}: expected a list of strings, got "
                                           f"{type(meta.get(key)).__name__}")
        pre = meta.get("tokenizer.ggml.pre", "gpt-2")
        return cls(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
                   token_types=meta.get("tokenizer.ggml.token_type"), pre=pre,
                   bos_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_id=meta.get("tokenizer.ggml.eos_token_id"),
                   pad_id=meta.get("tokenizer.ggml.padding_token_id"),
                   add_bos=meta.get("tokenizer.ggml.add_bos_token", False),
                   add_eos=meta.get("tokenizer.ggml.add_eos_token", False), **kw)

    def _piece_bytes(self) -> list[bytes]:
        """Each id's decoded bytes (see the module docstring)."""
        out = []
        for text, ty in zip(self._tokens, self._types):
            if ty == NORMAL or ty not in (UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE):
                try:
                    out.append(bytes(_CHAR_BYTE[c] for c in text))
                except KeyError:   # not a byte-alphabet string: its own UTF-8 (HF's fallback)
                    out.append(text.encode("utf-8", "surrogateescape"))
            elif ty == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                out.append(bytes([int(text[3:5], 16)]))
            elif ty == UNUSED:
                out.append(b"")
            else:
                out.append(text.encode("utf-8", "surrogateescape"))
        return out

    # -----------------------------------------------------------------------------------------
    # public surface

    def encode_raw(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens in the text are matched whole; nothing is added
        (no BOS/EOS: the chat template decides every structural token)."""
        if not isinstance(text, str):
            raise InvalidArgumentType("Tokenizer.encode_raw: text: expected a str, got "
                                      f"{type(text).__name__}")
        out: list[int] = []
        if self._special_re is None:
            self._encode_plain(text, out)
            return out
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                self._encode_plain(text[pos:m.start()], out)
            out.append(self._to_id[m.group()])
            pos = m.end()
        if pos < len(text):
            self._encode_plain(text[pos:], out)
        return out

    def __repr__(self):
        return (f"Tokenizer(vocab_size={self.vocab_size}, pre={self.pre!r}, merges={len(self._ranks)}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")

    # -----------------------------------------------------------------------------------------
    # encoding internals

    def _pre_tokens(self, text: str) -> list[str]:
        parts = self._pattern.findall(text)
        if sum(map(len, parts)) == len(text):
            return parts
        parts, pos = [], 0   # text the regex skipped stays in, as pieces of its own
        for m in self._pattern.finditer(text):
            if m.start() > pos:
                parts.append(text[pos:m.start()])
            parts.append(m.group())
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def _encode_plain(self, text: str, out: list[int]) -> None:
        encode_word = self._encode_word
        for piece in self._pre_tokens(text):
            out.extend(encode_word(piece))

    def _bpe_word(self, piece: str) -> tuple[int, ...]:
        """BPE of one pre-token: heap of adjacent pairs keyed (rank, left position); a popped
        pair is applied only if both of its symbols are still what they were when pushed."""
        word = piece.encode("utf-8", "surrogateescape").decode("latin-1").translate(_LATIN1_TO_ALPHABET)
        to_id = self._to_id
        if self._ignore_merges and word in to_id:
            return (to_id[word],)
        syms: list = list(word)
        ranks = self._ranks
        merge_pairs(syms, lambda a, b: ranks.get((a, b)))
        ids = []
        for s in syms:
            if s is False:
                continue
            t = to_id.get(s)
            if t is not None:
                ids.append(t)
            else:   # a merge result missing from the vocabulary: its single characters
                ids.extend(to_id[c] for c in s if c in to_id)
        return tuple(ids)
