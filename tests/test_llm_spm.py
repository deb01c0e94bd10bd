"""fu.llm's SentencePiece tokenizer (fucina/llm/spm.py) against transformers' tokenizer built
from the same GGUF file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).

Small SentencePiece vocabularies are made from a mixed corpus (characters, frequent substrings
with count-based scores full of ties, entries that span a space, byte tokens, control and
user-defined tokens, some characters left out so that byte fallback runs), written with
fu.gguf.write under a llama or a gemma3 architecture, and encoded by both. With the real files
of `make models` present: Gemma-3-270M's ids, BOS policy and chat template against transformers,
and Qwen2.5-Coder's byte-level BPE ids.
"""
import collections
from collections.abc import Mapping
import random
import time

import numpy as np
import pytest

import fucina as fu
from fucina.gguf import Metadata
from fucina.llm import ChatTemplate, Template, Tokenizer, UnsupportedTokenizer
from fucina.llm.spm import MARKER, SpmTokenizer
from fucina.llm.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED

from real_models import hf_tokenizer, require
from test_llm_tokenizer import CORPUS

transformers = pytest.importorskip("transformers")

EXTRA = [
    "", " ", "  ", "   leading spaces", "trailing   ", "a  b   c    d", "\n", "\n\n\nx\n\n",
    "<s>", "<s>hello", "hello<s>", "hi</s> there", "<bos>x<eos>", "<pad><mask>y", "<start_of_turn>user\nWhat's up?<end_of_turn>\n"
    "<start_of_turn>model\n", "<think>plan</think>answer", "<unk>", "<s><s>  x",
    "emoji 😀👍🏽 mixed日本語 ¿qué? ok", "\x00\x01 control \x7f", "tab\there", "ZZZZ zzzz",
    "the the the of the of", "ÆØÅ æøå Straße", "<0x41> is not a byte", "▁ literal marker ▁▁",
]


def _texts():
    lines = CORPUS.split("\n")
    return [CORPUS, *lines, *EXTRA, *(a + " " + b for a, b in zip(lines, lines[1:]))]


def _synthetic(arch: str, seed: int):
    """(tokens, scores, types) of a small SentencePiece vocabulary learned crudely from CORPUS."""
    rng = random.Random(seed)
    text = CORPUS.replace(" ", MARKER)
    if arch == "gemma3":   # Gemma's names (transformers' GemmaTokenizer adds them otherwise)
        specials = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL),
                    ("<unk>", UNKNOWN), ("<mask>", CONTROL)]
    else:
        specials = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
    specials += [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL),
                ("<think>", USER_DEFINED), ("</think>", USER_DEFINED), ("\n\n", USER_DEFINED)]
    if arch == "gemma3":   # Gemma stores whitespace-run tokens with real spaces
        specials += [("  ", USER_DEFINED), ("   ", USER_DEFINED)]
    chars = sorted(set(text) - {"\n"})
    left_out = set(rng.sample([c for c in chars if ord(c) > 127], 12)) | {"😀", "日"}
    chars = [c for c in chars if c not in left_out]
    counts = collections.Counter()
    for n in range(2, 7):
        for i in range(len(text) - n + 1):
            piece = text[i:i + n]
            if "\n" not in piece and not (set(piece) & left_out):
                counts[piece] += 1
    pieces = [p for p, c in counts.most_common() if c >= 3][:500]
    pieces += ["o▁", "e▁t", "▁of▁the", "he▁", "s▁a", "▁▁▁▁"]
    vocab = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)]
    types = [ty for _, ty in specials] + [BYTE] * 256
    scores = [0.0] * len(vocab)
    body = chars + [p for p in pieces if p not in chars and p not in vocab]
    body = list(dict.fromkeys(body))
    rng.shuffle(body)
    for p in body:
        vocab.append(p)
        types.append(NORMAL)
        # a coarse score: many ties, broken by length and position
        scores.append(0.0 if len(p) == 1 else float(-round(8 - np.log(counts[p] + 1))))
    if arch == "gemma3":
        scores = [-1000.0 if ty != BYTE else 0.0 for ty in types]   # order, not score, ranks
    return vocab, scores, types


def _write(path, arch, tokens, scores, types, **extra):
    md = Metadata()

    def put(key, value, ty):
        md[key] = value
        md.types[key] = ty

    put("general.architecture", arch, "str")
    put("general.name", "tiny-spm", "str")
    for key, value in (("context_length", 128), ("embedding_length", 16), ("block_count", 1),
                       ("feed_forward_length", 32), ("attention.head_count", 2),
                       ("attention.head_count_kv", 1)):
        put(f"{arch}.{key}", value, "u32")
    put(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, "f32")
    put("tokenizer.ggml.model", "llama", "str")
    put("tokenizer.ggml.pre", "default", "str")
    put("tokenizer.ggml.tokens", tokens, "[str]")
    put("tokenizer.ggml.scores", scores, "[f32]")
    put("tokenizer.ggml.token_type", types, "[i32]")
    put("tokenizer.ggml.unknown_token_id", tokens.index("<unk>"), "u32")
    gemma = "<bos>" in tokens
    put("tokenizer.ggml.bos_token_id", tokens.index("<bos>" if gemma else "<s>"), "u32")
    put("tokenizer.ggml.eos_token_id", tokens.index("<eos>" if gemma else "</s>"), "u32")
    if gemma:
        put("tokenizer.ggml.padding_token_id", tokens.index("<pad>"), "u32")
    for key, (value, ty) in extra.items():
        put(key, value, ty)
    fu.gguf.write(path, {}, md)
    return md


def _hf(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("arch,seed,extra", [
    ("llama", 0, {}),
    ("llama", 1, {"tokenizer.ggml.add_space_prefix": (True, "bool")}),
    ("gemma3", 2, {"tokenizer.ggml.add_space_prefix": (False, "bool")}),
    ("gemma3", 3, {"tokenizer.ggml.add_space_prefix": (False, "bool"),
                   "tokenizer.ggml.add_bos_token": (True, "bool")}),
], ids=["llama", "llama-prefix", "gemma3", "gemma3-bos"])
def test_synthetic_vocabularies_match_transformers(tmp_path, arch, seed, extra):
    tokens, scores, types = _synthetic(arch, seed)
    path = tmp_path / f"{arch}.gguf"
    md = _write(path, arch, tokens, scores, types, **extra)
    ours = Tokenizer.from_gguf(md)
    assert isinstance(ours, SpmTokenizer)
    hf = _hf(path)
    fallback = 0
    for text in _texts():
        got = ours.encode_raw(text)
        assert got == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text) == hf.encode(text), text   # BOS policy as transformers'
        fallback += sum(ours.token_type(i) == BYTE for i in got)
        # decode is the exact inverse of the marked text; transformers' llama decoder also
        # strips one leading space (the dummy prefix)
        text_back = ours.decode(got)
        prefixed = ours.add_space_prefix and got and ours.token_type(got[0]) == NORMAL
        plain = text.replace(MARKER, " ")   # a literal ▁ is a space to SentencePiece
        assert text_back == (" " + plain if prefixed and not plain.startswith(" ") else plain)
        want = hf.decode(got)
        assert (text_back[1:] if ours.add_space_prefix and text_back.startswith(" ")
                else text_back) == want, text
    assert fallback > 0   # the corpus did exercise byte fallback


def test_merge_order_is_by_score_then_longer_left(tmp_path):
    """A hand-made vocabulary where each rule of the priority decides one merge."""
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "d", "ab", "bc", "abc", "cd", "bcd", "▁"]
    scores = [0, 0, 0, 0, 0, 0, 0, -5, -1, -2, -1, -1, 0]
    types = [UNKNOWN, CONTROL, CONTROL] + [NORMAL] * 10
    path = tmp_path / "m.gguf"
    md = _write(path, "llama", tokens, [float(s) for s in scores], types)
    ours, hf = Tokenizer.from_gguf(md), _hf(path)
    for text in ["abcd", "abc", "bcd", "ab", "dabcab", "cdab", "a b  c"]:
        assert ours.encode_raw(text) == hf.encode(text, add_special_tokens=False), text
    spelled = [ours.id_to_token(i) for i in ours.encode_raw("abc")]
    assert spelled == ["▁", "abc"]   # bc (-1) before ab (-5), then abc (-2)
    # bc and cd tie (-1): leftmost first; bcd (-1) then wins over abc (-2): a + bcd
    assert [ours.id_to_token(i) for i in ours.encode_raw("abcd")] == ["▁", "a", "bcd"]


def test_add_space_prefix_false_is_honoured():
    """llama.cpp adds the dummy prefix only when tokenizer.ggml.add_space_prefix allows it;
    transformers 5.23's llama GGUF converter always adds it, so this follows llama.cpp."""
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab"]
    md = {"general.architecture": "llama", "tokenizer.ggml.model": "llama",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0, 0, 0, 0, 0, 0, -1, -2],
          "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL] + [NORMAL] * 5,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    on = Tokenizer.from_gguf(md)
    off = Tokenizer.from_gguf({**md, "tokenizer.ggml.add_space_prefix": False})
    assert [on.id_to_token(i) for i in on.encode_raw("ab a")] == ["▁a", "b", "▁a"]
    assert [off.id_to_token(i) for i in off.encode_raw("ab a")] == ["ab", "▁a"]
    assert on.add_bos and on.encode("ab") == [1, 6, 5]   # SentencePiece files default to BOS


def test_decode_is_exact_and_streaming_safe(tmp_path):
    tokens, scores, types = _synthetic("gemma3", 5)
    md = _write(tmp_path / "g.gguf", "gemma3", tokens, scores, types,
                **{"tokenizer.ggml.add_space_prefix": (False, "bool")})
    tok = Tokenizer.from_gguf(md)
    for text in _texts():
        ids = tok.encode_raw(text)
        plain = text.replace(MARKER, " ")   # a literal ▁ is a space to SentencePiece
        assert tok.decode(ids) == plain
        assert b"".join(tok.decode_bytes([i]) for i in ids) == plain.encode()
    # a character cut mid-way by byte fallback: the pieces join to its bytes
    ids = tok.encode_raw("😀")
    assert [tok.token_type(i) for i in ids] == [BYTE] * 4
    assert tok.decode(ids[:2]) == "\ufffd" and tok.decode(ids) == "😀"


def test_bad_metadata_names_the_field(tmp_path):
    tokens, scores, types = _synthetic("llama", 7)
    md = _write(tmp_path / "b.gguf", "llama", tokens, scores, types)
    cases = [
        ("tokenizer.ggml.pre", "qwen2", "tokenizer.ggml.pre 'qwen2'"),
        ("tokenizer.ggml.merges", ["a b"], "tokenizer.ggml.merges"),
        ("tokenizer.ggml.precompiled_charsmap", [0], "tokenizer.ggml.precompiled_charsmap"),
        ("tokenizer.ggml.scores", scores[:-1], "tokenizer.ggml.scores: expected"),
        ("tokenizer.ggml.token_type", types[:-1] + [9], r"tokenizer.ggml.token_type\[.*\]"),
        ("tokenizer.ggml.add_space_prefix", 1, "tokenizer.ggml.add_space_prefix"),
        ("tokenizer.ggml.add_bos_token", "yes", "tokenizer.ggml.add_bos_token"),
        ("tokenizer.ggml.bos_token_id", len(tokens), "tokenizer.ggml.bos_token_id"),
        ("tokenizer.ggml.tokens", "abc", "tokenizer.ggml.tokens"),
    ]
    for key, value, match in cases:
        bad = dict(md)
        bad[key] = value
        with pytest.raises(UnsupportedTokenizer, match=match):
            Tokenizer.from_gguf(bad)
    bad = {k: v for k, v in md.items() if k != "tokenizer.ggml.scores"}
    with pytest.raises(UnsupportedTokenizer, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf(bad)


# ---- the real files of `make models` ----

REAL_TEXT = CORPUS + "\n".join([
    "The Eiffel Tower is located in the city of Paris, France.",
    "Gemma 3 270M is a compact model built for task-specific fine-tuning.",
    "    def indented(self):\n        return {'key': [1, 2, 3]}  # trailing comment\n",
    "Mathematics: ∑_{i=1}^{n} i² = n(n+1)(2n+1)/6; ∫₀^∞ e^{-x} dx = 1; α β γ δ ∂ ∇ ≤ ≥ ≠ ≈.",
    "Mixed scripts: Ελληνικά, Русский, العربية, עברית, हिन्दी, ไทย, 中文, 日本語, 한국어.",
    "Rare characters: \U0001d54f\U0001d552 \u2603 \U0001f9ec \u0f00 \U00010348 \ue000 \x7f.",
    "Multiple   spaces,\ttabs\t\tand\n\n\n\nnewlines \r\n in \x0b odd \x0c places.",
])


FUZZ_ALPHABET = (list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789  \n\t\r.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`|▁")
                 + ["é", "ß", "ø", "Ж", "λ", "中", "日", "한", "😀", "👍🏽", "\u200b", "\u00a0", "\u3000",
                    "\x00", "\x7f", "\ufffd", "\U0001d54f", "ـ", "ि"])
FUZZ_SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>", "<mask>",
                 "<unused3>", "[multimodal]", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
                 "<think>"]


def _fuzz(ours, hf, count=1500, seed=1):
    """Random short strings of letters, whitespace runs, rare characters and special tokens."""
    rng = random.Random(seed)
    for _ in range(count):
        text = "".join(rng.choice(FUZZ_SPECIALS) if rng.random() < 0.03
                       else rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(1, 40)))
        assert ours.encode_raw(text) == hf.encode(text, add_special_tokens=False), repr(text)


@pytest.fixture(scope="module")
def gemma3():
    path = require("gemma3")
    ctx = fu.ExecContext(threads=1)
    ours = Tokenizer.from_gguf(fu.gguf.read(path, ctx))
    yield path, ours, hf_tokenizer("gemma3")
    ctx.close()


def test_gemma3_ids_match_transformers(gemma3):
    _, ours, hf = gemma3
    assert isinstance(ours, SpmTokenizer) and not ours.add_space_prefix
    text = REAL_TEXT * 2
    assert len(text.encode()) > 4000
    assert ours.encode_raw(text) == hf.encode(text, add_special_tokens=False)
    for line in REAL_TEXT.split("\n") + EXTRA:
        ids = ours.encode_raw(line)
        assert ids == hf.encode(line, add_special_tokens=False), line
        assert ours.decode(ids) == hf.decode(ids) == line.replace(MARKER, " ")
    _fuzz(ours, hf)
    # the encode speed, printed (not asserted): a cold cache and a second pass
    ours._encode_part.cache_clear()   # cold: no part and no pair priority cached
    ours._pair_key.clear()
    t0 = time.perf_counter()
    ours.encode_raw(text)
    t1 = time.perf_counter()
    ours.encode_raw(text)
    t2 = time.perf_counter()
    hf.encode(text, add_special_tokens=False)
    t3 = time.perf_counter()
    print(f"\ngemma3 encode of {len(text.encode())} bytes: fucina {1e3 * (t1 - t0):.1f} ms cold, "
          f"{1e3 * (t2 - t1):.1f} ms warm; transformers {1e3 * (t3 - t2):.1f} ms")


def test_gemma3_bos_policy(gemma3):
    _, ours, hf = gemma3
    assert ours.add_bos and ours.bos_id == hf.bos_token_id == ours.token_to_id("<bos>")
    text = "The Eiffel Tower is located in the city of"
    assert ours.encode(text) == hf.encode(text) == [ours.bos_id] + ours.encode_raw(text)
    assert ours.eos_id == hf.eos_token_id


# A Jinja template of the Gemma turn format, written here for the test (Gemma-3-270M, a base
# model, ships no template): the system text opens the first user turn, assistant is "model",
# contents are trimmed.
GEMMA_JINJA = (
    "{{ bos_token }}{% set ns = namespace(head='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.head = (m['content'] | trim) ~ '\\n\\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\\n' ~ ns.head"
    " ~ (m['content'] | trim) ~ '<end_of_turn>\\n' }}{% set ns.head = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of Italy?"},
     {"role": "assistant", "content": "Rome."},
     {"role": "user", "content": "And of  Spain?\nThanks 😀"}],
]


def test_gemma3_chat_template_matches_transformers(gemma3):
    """The file has no template: ChatTemplate.from_gguf falls back to the built-in gemma
    format, which must render as transformers renders a Gemma-format Jinja template, and that
    same Jinja source rendered by ChatTemplate too; then the ids agree."""
    path, ours, hf = gemma3
    ctx = fu.ExecContext(threads=1)
    f = fu.gguf.read(path, ctx)
    assert "tokenizer.chat_template" not in f.metadata
    builtin = ChatTemplate.from_gguf(f, ours)
    assert builtin.kind is Template.GEMMA
    jinja = ChatTemplate(GEMMA_JINJA, special_tokens=builtin.special_tokens)
    for messages in CHATS:
        last_is_user = messages[-1]["role"] == "user"
        for gen in (True, False) if last_is_user else (False,):
            want = hf.apply_chat_template(messages, chat_template=GEMMA_JINJA, tokenize=False,
                                          add_generation_prompt=gen)
            assert jinja.render(messages, add_generation_prompt=gen) == want
            if gen:
                assert builtin.render(messages, add_generation_prompt=True) == want
            assert want.startswith("<bos><start_of_turn>user\n")
            want_ids = hf.apply_chat_template(messages, chat_template=GEMMA_JINJA, tokenize=True,
                                              add_generation_prompt=gen)
            if isinstance(want_ids, Mapping):   # a BatchEncoding
                want_ids = want_ids["input_ids"]
            got = ours.encode_raw(want)
            assert got == want_ids and got[0] == ours.bos_id and got.count(ours.bos_id) == 1
    assert builtin.stop_strings()[0] == "<end_of_turn>"
    ctx.close()


def test_qwen2_byte_level_ids_match_transformers():
    path = require("qwen2")
    ctx = fu.ExecContext(threads=1)
    ours = Tokenizer.from_gguf(fu.gguf.read(path, ctx))
    hf = hf_tokenizer("qwen2")
    assert type(ours) is Tokenizer and ours.pre == "qwen2" and not ours.add_bos
    text = REAL_TEXT * 2
    assert ours.encode_raw(text) == hf.encode(text, add_special_tokens=False)
    for line in REAL_TEXT.split("\n") + EXTRA:
        assert ours.encode_raw(line) == hf.encode(line, add_special_tokens=False), line
    _fuzz(ours, hf)
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode_raw(chat) == hf.encode(chat, add_special_tokens=False)
    ctx.close()


def test_template_less_gemma_file_gets_the_gemma_format_with_bos(tmp_path):
    tokens, scores, types = _synthetic("gemma3", 11)
    md = _write(tmp_path / "g.gguf", "gemma3", tokens, scores, types,
                **{"tokenizer.ggml.add_space_prefix": (False, "bool"),
                   "tokenizer.ggml.add_bos_token": (True, "bool")})
    tok = Tokenizer.from_gguf(md)
    chat = ChatTemplate.from_gguf(md, tok)
    assert chat.kind is Template.GEMMA and chat.stop_strings() == ("<end_of_turn>", "<eos>")
    text = chat.render([{"role": "user", "content": " Hi "}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode_raw(text)
    assert ids[:2] == [tok.bos_id, tok.token_to_id("<start_of_turn>")]
    assert tok.encode("Hi") == [tok.bos_id] + tok.encode_raw("Hi")
    llama = _write(tmp_path / "l.gguf", "llama", *_synthetic("llama", 11))
    assert ChatTemplate.from_gguf(llama).kind is Template.CHATML


def test_byte_level_tokenizer_reads_the_bos_policy():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3],
            "tokenizer.ggml.bos_token_id": 3}
    assert Tokenizer.from_gguf(meta).encode("ab") == [2]
    on = Tokenizer.from_gguf({**meta, "tokenizer.ggml.add_bos_token": True})
    assert on.add_bos and on.encode("ab<s>") == [3, 2, 3]
    with pytest.raises(UnsupportedTokenizer, match="tokenizer.ggml.add_eos_token is true"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.add_eos_token": True})
