"""SentencePiece BPE tokenizer read from GGUF metadata (`tokenizer.ggml.model == "llama"`).

This is the tokenizer of Gemma 1-3, Llama-2 and Mistral GGUF files. `Tokenizer.from_gguf`
returns it for those files; it has the byte-level tokenizer's surface (encode_raw, encode,
decode, decode_bytes, token_to_id, bos_id, eos_id, add_bos, ...).

Encoding, as transformers builds the tokenizer from the same GGUF (and llama.cpp mirrors):
1. special tokens — every CONTROL token, every USER_DEFINED and UNKNOWN token that is a
   vocabulary spelling, and the bos/eos/unk/padding tokens — are cut out whole, leftmost-longest;
2. each piece of text between them has its spaces replaced by the marker `▁`; with
   `tokenizer.ggml.add_space_prefix` (default true; Gemma's files set false) the first piece
   of the text gets a `▁` in front unless it already starts with one (transformers 5.23 adds
   it to a llama-architecture file even when the flag is false; llama.cpp and this follow the
   flag);
3. the piece is split into characters (a character missing from the vocabulary becomes the
   byte tokens `<0xNN>` of its UTF-8) and merged by score ("BPE by score"): repeatedly the
   adjacent pair whose concatenation is a vocabulary entry of best priority, leftmost on ties.
   The priority is the merged entry's score, higher first (Gemma: its position in the file,
   earlier first, because Gemma's scores do not follow its merge order), then the longer left
   part, then the longer right part, then the entry's position. Gemma files spell the tokens of
   two or more spaces with real spaces; they are read as runs of `▁` and reached by merging,
   not cut out whole (as transformers reads them).

The merge never crosses a boundary between two characters that no vocabulary entry holds side by
side, so each piece is cut at such boundaries before a `▁` and the parts are merged separately
and cached (LRU): the result is the same as merging the whole piece, only faster.

Decoding is the exact byte inverse: `▁` becomes a space, BYTE tokens their byte, special tokens
their text, UNUSED tokens nothing; no space is stripped (streaming-safe `decode_bytes`).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

from ..errors import InvalidArgumentType, UnsupportedTokenizer
from .tokenizer import (BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, Vocabulary,
                        literal_matcher, merge_pairs)

__all__ = ["SpmTokenizer", "MARKER"]

MARKER = "\u2581"   # ▁, SentencePiece's space
_TYPES = (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)
_RESPELL_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})   # whitespace tokens stored as spaces
_BYTE_NAMES = tuple(f"<0x{b:02X}>" for b in range(256))
_PAIR_CACHE = 1 << 20   # pair priorities remembered (cleared when full)


class SpmTokenizer(Vocabulary):
    """A SentencePiece BPE vocabulary: tokens, scores (or file order), token types, specials."""

    def __init__(self, tokens, scores=None, *, token_types=None, order_priority=False,
                 add_space_prefix=True, bos_id=None, eos_id=None, unk_id=None, pad_id=None,
                 add_bos=False, add_eos=False, plain_ids=(), cache_size=1 << 16):
        where = "SpmTokenizer"
        tokens = list(tokens)
        if not tokens:
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.tokens: expected a non-empty list")
        for i, t in enumerate(tokens):
            if not isinstance(t, str):
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.tokens[{i}]: expected a str, "
                                           f"got {type(t).__name__}")
        n = len(tokens)
        token_types = [NORMAL] * n if token_types is None else list(token_types)
        if len(token_types) != n:
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.token_type: expected {n} entries "
                                       f"(one per token), got {len(token_types)}")
        for i, ty in enumerate(token_types):
            if ty not in _TYPES:
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.token_type[{i}]: expected one "
                                           f"of {list(_TYPES)}, got {ty!r}")
        if not order_priority:
            if scores is None:
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.scores: expected a list of "
                                           f"{n} floats, got none")
            scores = list(scores)
            if len(scores) != n or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                           for x in scores):
                raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.scores: expected {n} floats "
                                           f"(one per token), got {len(scores)} entries")
        if not isinstance(add_space_prefix, bool):
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.add_space_prefix: expected a "
                                       f"bool, got {add_space_prefix!r}")
        self._tokens, self._types = tokens, token_types
        self._to_id = {}
        first = {}
        for i, t in enumerate(tokens):   # a repeated spelling: the last id wins, as in transformers
            self._to_id[t] = i
            first.setdefault(t, i)
        # merge priority of a pair: (primary, -len(left), -len(right), first position) of the
        # entry it makes, the primary being -score, or the entry's (last) position when
        # order_priority; packed into one int, smaller first: the entry's part in _base
        if order_priority:
            primary = self._to_id
        else:
            primary = {t: -float(scores[self._to_id[t]]) for t in first}
        rank = {v: k for k, v in enumerate(sorted(set(primary.values())))}
        self._span = span = max(map(len, first)) + 1
        self._stride = n
        self._base = {t: (rank[primary[t]] * span * span) * n + first[t] for t in first}
        self.add_space_prefix = add_space_prefix
        self.order_priority = order_priority
        self.bos_id = self._special_id(where, "bos", bos_id)
        self.eos_id = self._special_id(where, "eos", eos_id)
        self.unk_id = self._special_id(where, "unknown", unk_id)
        self.pad_id = self._special_id(where, "padding", pad_id)
        self._set_policy(where, add_bos, add_eos)
        plain_ids = frozenset(plain_ids)   # never cut out whole (Gemma's respelled whitespace)
        whole = {t for i, (t, ty) in enumerate(zip(tokens, token_types))
                 if ty in (CONTROL, USER_DEFINED, UNKNOWN) and i not in plain_ids}
        whole |= {tokens[i] for i in (self.bos_id, self.eos_id, self.unk_id, self.pad_id)
                  if i is not None}
        self._special_re = literal_matcher(whole)
        # the characters some entry holds right before a ▁: the merge can cross a boundary
        # before a ▁ only after one of them, so the text is cut before every other ▁
        self._glue = {t[k] for t in self._to_id for k in range(len(t) - 1) if t[k + 1] == MARKER}
        self._byte_ids = [self._to_id.get(name) for name in _BYTE_NAMES]
        self._pieces = self._piece_bytes()
        self._pair_key: dict = {}
        self._encode_part = functools.lru_cache(maxsize=cache_size)(self._bpe)

    @classmethod
    def from_gguf(cls, gguf_file, **kw) -> "SpmTokenizer":
        """The tokenizer of a SentencePiece GGUF file (`fu.gguf.read(...)` or its metadata):
        `tokenizer.ggml.{tokens, scores, token_type, add_space_prefix, bos/eos/unknown/
        padding_token_id, add_bos_token, add_eos_token}` and `general.architecture`."""
        meta = gguf_file if isinstance(gguf_file, Mapping) else getattr(gguf_file, "metadata", None)
        if not isinstance(meta, Mapping):
            raise InvalidArgumentType("SpmTokenizer.from_gguf: expected a GGUF file "
                                      "(fu.gguf.read) or its "
                                      f"metadata mapping, got {type(gguf_file).__name__}")
        where = "SpmTokenizer.from_gguf"
        model = meta.get("tokenizer.ggml.model")
        if model != "llama":
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.model {model!r} is not "
                                       f"supported; expected 'llama' (SentencePiece)")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre != "default":
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.pre {pre!r} is not supported "
                                       f"for a SentencePiece vocabulary; expected 'default'")
        if "tokenizer.ggml.merges" in meta:
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.merges is not supported for a "
                                       f"SentencePiece vocabulary; expected scores only")
        if "tokenizer.ggml.precompiled_charsmap" in meta:
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.precompiled_charsmap (a "
                                       f"normalizer) is not supported; expected none")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise UnsupportedTokenizer(f"{where}: tokenizer.ggml.tokens: expected a list of "
                                       f"strings, got {type(tokens).__name__}")
        arch = meta.get("general.architecture")
        respell = arch in _RESPELL_ARCHS
        plain_ids = ()
        if respell:
            plain_ids = [i for i, t in enumerate(tokens) if isinstance(t, str) and " " in t
                         and not t.strip()]
            tokens = list(tokens)
            for i in plain_ids:
                tokens[i] = MARKER * len(tokens[i])
        return cls(tokens, meta.get("tokenizer.ggml.scores"),
                   token_types=meta.get("tokenizer.ggml.token_type"), order_priority=respell,
                   add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", True),
                   bos_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_id=meta.get("tokenizer.ggml.eos_token_id"),
                   unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
                   pad_id=meta.get("tokenizer.ggml.padding_token_id"),
                   add_bos=meta.get("tokenizer.ggml.add_bos_token", True),
                   add_eos=meta.get("tokenizer.ggml.add_eos_token", False),
                   plain_ids=plain_ids, **kw)

    def _piece_bytes(self) -> list[bytes]:
        out = []
        for text, ty in zip(self._tokens, self._types):
            if ty == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                out.append(bytes([int(text[3:5], 16)]))
            elif ty == UNUSED:
                out.append(b"")
            elif ty in (NORMAL, USER_DEFINED):
                out.append(text.replace(MARKER, " ").encode("utf-8", "surrogateescape"))
            else:
                out.append(text.encode("utf-8", "surrogateescape"))
        return out

    def __repr__(self):
        return (f"SpmTokenizer(vocab_size={self.vocab_size}, add_space_prefix="
                f"{self.add_space_prefix}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"add_bos={self.add_bos})")

    # -----------------------------------------------------------------------------------------

    def encode_raw(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens in the text are matched whole; nothing is added
        (no BOS/EOS: see `encode`, and the chat template writes its own)."""
        if not isinstance(text, str):
            raise InvalidArgumentType("Tokenizer.encode_raw: text: expected a str, got "
                                      f"{type(text).__name__}")
        out: list[int] = []
        if self._special_re is None:
            if text:
                self._encode_plain(text, True, out)
            return out
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                self._encode_plain(text[pos:m.start()], pos == 0, out)
            out.append(self._to_id[m.group()])
            pos = m.end()
        if pos < len(text):
            self._encode_plain(text[pos:], pos == 0, out)
        return out

    def _encode_plain(self, text: str, first: bool, out: list[int]) -> None:
        text = text.replace(" ", MARKER)
        if first and self.add_space_prefix and not text.startswith(MARKER):
            text = MARKER + text
        glue, encode, to_id = self._glue, self._encode_part, self._to_id
        pieces = text.split(MARKER)
        part = pieces[0]
        for piece in pieces[1:]:
            # no cut where some entry holds part[-1] + ▁, nor after a byte-fallback character
            # when an entry holds ">▁" (the end of a <0xNN> symbol)
            if part and (part[-1] in glue or (part[-1] not in to_id and ">" in glue)):
                part += MARKER + piece
            else:
                if part:
                    out.extend(encode(part))
                part = MARKER + piece
        if part:
            out.extend(encode(part))

    def _key(self, left: str, right: str):
        """Merge priority of the pair (smaller first), or None when left+right is no entry."""
        pair = (left, right)
        key = self._pair_key.get(pair, False)
        if key is False:
            base = self._base.get(left + right)
            if base is not None:
                span = self._span
                key = base + ((span - 1 - len(left)) * span + span - 1 - len(right)) * self._stride
            else:
                key = None
            if len(self._pair_key) >= _PAIR_CACHE:
                self._pair_key.clear()
            self._pair_key[pair] = key
        return key

    def _bpe(self, part: str) -> tuple[int, ...]:
        """BPE by score of one part (tokenizer.merge_pairs)."""
        to_id = self._to_id
        syms: list = []
        for c in part:
            if c in to_id:
                syms.append(c)
            else:   # byte fallback: the character's UTF-8 bytes as <0xNN> entries
                for b in c.encode("utf-8", "surrogateescape"):
                    syms.append(_BYTE_NAMES[b] if self._byte_ids[b] is not None else None)
        known, key = self._pair_key.get, self._key   # cached priorities first

        def priority(a, b):
            k = known((a, b), False)
            return key(a, b) if k is False else k
        merge_pairs(syms, priority)
        unk = self.unk_id
        ids = []
        for s in syms:
            if s is False:
                continue
            if s is None:   # a byte with no <0xNN> entry
                if unk is None:
                    raise UnsupportedTokenizer(
                        "Tokenizer.encode_raw: a character needs a byte token the vocabulary "
                        "lacks and tokenizer.ggml.unknown_token_id is unset; expected one of them")
                if not ids or ids[-1] != unk:   # consecutive unknowns fuse, as in transformers
                    ids.append(unk)
            else:
                ids.append(to_id[s])
        return tuple(ids)
