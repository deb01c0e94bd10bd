"""Chat templates for SFT and generation (SPEC T-22): the text of one user turn, ready to encode.

    t = Template.CHATML                      # or detect(gguf.metadata["tokenizer.chat_template"])
    text = t.render_turn(system, user, first=True, think_off=True)
    t.stop_marker()                          # the text that ends an assistant turn

`render_turn` writes the conversation-start tokens when `first` (BOS and the system turn, for the
formats that have them), otherwise it first closes the previous assistant turn; then the user
turn and the opener of the assistant turn. Nothing is added by the tokenizer (`encode_raw`), so
the structural tokens, BOS included, are all here.

Where each format's strings come from (checked against the models' own Jinja templates as
published with their tokenizers, and against llama.cpp's built-in renderer, llama-chat.cpp):
- chatml (Qwen3, SmolLM2): exactly as SPEC T-22 writes it; `think_off` appends Qwen3's empty
  reasoning block, the same one Qwen3's template emits when thinking is disabled. Content is
  used verbatim, as in those templates.
- llama3: `<|begin_of_text|>` (the template's bos_token), then one `<|start_header_id|>role
  <|end_header_id|>\\n\\n` + content + `<|eot_id|>` block per message; the assistant opener
  is the bare header. Llama 3 has no reasoning switch: `think_off` is ignored.
- gemma (Gemma 1-3): `<bos>`, `<start_of_turn>user\\n` ... `<end_of_turn>\\n`, the assistant
  role is named `model`; there is no system role, so the system text is put at the start of
  the first user turn followed by a blank line (the Gemma 3 template's rule). No `think_off`.
- gemma4: `<bos>`; a system turn `<|turn>system\\n` ... `<turn|>\\n` when there is system text
  or thinking is on, carrying `<|think|>` first when thinking is on; `<|turn>user\\n` ...
  `<turn|>\\n`, then `<|turn>model\\n`, followed with thinking off by the empty thought channel
  `<|channel>thought\\n<channel|>` that Gemma 4's template emits to suppress reasoning.
The llama3, gemma and gemma4 templates strip surrounding whitespace from message content
(Jinja `trim`); so does `render_turn` for those formats.

`ChatTemplate` renders whole conversations the way the model file says to (issue 16 item 5):

    ct = ChatTemplate.from_gguf(f, tok)      # f.metadata["tokenizer.chat_template"], Jinja
    ct.render([{"role": "user", "content": "Hi"}])             # what the model is served
    ct.stop_strings()                        # ("<|im_end|>", "<|endoftext|>")

The Jinja source is rendered under the same rules as transformers' `apply_chat_template` (a
sandboxed environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, the tokenizer's special-token strings as
`bos_token`, `eos_token`, ...), so a model trained on our rendering is served identically by
transformers and by llama.cpp, default system prompts included. A file without a template gets
the built-in format of the `Template` enum: gemma for a Gemma architecture, else chatml.
"""
from __future__ import annotations

import datetime
import enum
import functools
import json
from collections.abc import Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.meta
import jinja2.utils

from ..errors import ChatTemplateError, InvalidArgument, InvalidArgumentType

__all__ = ["Template", "detect", "ChatTemplate"]


class Template(enum.Enum):
    """One of the chat formats of SPEC T-22; the value is its name."""

    CHATML = "chatml"
    LLAMA3 = "llama3"
    GEMMA = "gemma"
    GEMMA4 = "gemma4"

    def stop_marker(self) -> str:
        """The token text that ends an assistant turn (where generation stops)."""
        return _STOP[self]

    def render_turn(self, system: str | None, user: str, first: bool = True,
                    think_off: bool = False) -> str:
        """The text of one user turn followed by the opener of the assistant's reply."""
        where = f"Template.{self.name}.render_turn"
        if system is not None and not isinstance(system, str):
            raise InvalidArgumentType(f"{where}: system: expected a str or None, got "
                                      f"{type(system).__name__}")
        if not isinstance(user, str):
            raise InvalidArgumentType(f"{where}: user: expected a str, got {type(user).__name__}")
        return _RENDER[self](system, user, bool(first), bool(think_off))


def _chatml(system, user, first, think_off):
    head = ""
    if not first:
        head = "<|im_end|>\n"
    elif system is not None:
        head = f"<|im_start|>system\n{system}<|im_end|>\n"
    tail = "<think>\n\n</think>\n\n" if think_off else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{tail}"


def _llama3(system, user, first, think_off):
    head = "<|eot_id|>"
    if first:
        head = "<|begin_of_text|>"
        if system is not None:
            head += f"<|start_header_id|>system<|end_header_id|>\n\n{system.strip()}<|eot_id|>"
    return (f"{head}<|start_header_id|>user<|end_header_id|>\n\n{user.strip()}<|eot_id|>"
            f"<|start_header_id|>assistant<|end_header_id|>\n\n")


def _gemma(system, user, first, think_off):
    head = "<bos>" if first else "<end_of_turn>\n"
    prefix = f"{system.strip()}\n\n" if first and system is not None else ""
    return f"{head}<start_of_turn>user\n{prefix}{user.strip()}<end_of_turn>\n<start_of_turn>model\n"


def _gemma4(system, user, first, think_off):
    head = "<turn|>\n"   # closes the model turn that generation stopped inside
    if first:
        head = "<bos>"
        if system is not None or not think_off:
            think = "" if think_off else "<|think|>"
            head += f"<|turn>system\n{think}{(system or '').strip()}<turn|>\n"
    tail = "<|channel>thought\n<channel|>" if think_off else ""
    return f"{head}<|turn>user\n{user.strip()}<turn|>\n<|turn>model\n{tail}"


_STOP = {Template.CHATML: "<|im_end|>", Template.LLAMA3: "<|eot_id|>",
         Template.GEMMA: "<end_of_turn>", Template.GEMMA4: "<turn|>"}
_RENDER = {Template.CHATML: _chatml, Template.LLAMA3: _llama3, Template.GEMMA: _gemma,
           Template.GEMMA4: _gemma4}

# the format of a file that has no template, by general.architecture
_ARCH_FORMATS = {"gemma": Template.GEMMA, "gemma2": Template.GEMMA, "gemma3": Template.GEMMA}

# SPEC T-22 detection order: the first marker found in the template text decides
_MARKERS = (("<|im_start|>", Template.CHATML), ("<|start_header_id|>", Template.LLAMA3),
            ("<|turn>", Template.GEMMA4), ("<start_of_turn>", Template.GEMMA))


def detect(chat_template: str | None) -> Template | None:
    """The format of a GGUF `tokenizer.chat_template` string, or None when none of the SPEC's
    markers occurs in it (the finetune app then falls back to chatml)."""
    if chat_template is None:
        return None
    if not isinstance(chat_template, str):
        raise InvalidArgumentType(f"template.detect: chat_template: expected a str or None, got "
                                  f"{type(chat_template).__name__}")
    for marker, template in _MARKERS:
        if marker in chat_template:
            return template
    return None


# ---------------------------------------------------------------------------------------------
# ChatTemplate: the file's own Jinja template, or a built-in format

# GGUF keys of the special tokens a chat template may read, by the variable name the template
# sees (transformers passes its tokenizer's special-token strings under these names)
_SPECIAL_KEYS = (("bos_token", "tokenizer.ggml.bos_token_id"),
                 ("eos_token", "tokenizer.ggml.eos_token_id"),
                 ("unk_token", "tokenizer.ggml.unknown_token_id"),
                 ("sep_token", "tokenizer.ggml.seperator_token_id"),
                 ("pad_token", "tokenizer.ggml.padding_token_id"),
                 ("cls_token", "tokenizer.ggml.cls_token_id"),
                 ("mask_token", "tokenizer.ggml.mask_token_id"))
_REASONING = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    published templates; rendering only needs the body, so the tag renders it unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore attributes, so a template cannot reach interpreter
    internals through it (templates come from downloaded files)."""

    def __init__(*args, **kwargs):
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set the underscore attribute {name!r} on a namespace")


class _DictMaker:
    """`dict(...)` inside a template, without exposing the `dict` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_DictMaker(), namespace=_Namespace)
    template = env.from_string(source)
    names = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    return template, names


def _plain(value, where):
    """A deep copy of the caller's data made of JSON types only (the sandbox sees nothing
    else, and the template cannot change the caller's messages)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where}: expected JSON data (str, number, bool, None, list, "
                            f"dict), got {type(value).__name__}")


def _checked_messages(messages, where):
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"{where}: messages: expected a list of {{'role', 'content'}} "
                                f"dicts, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError(f"{where}: messages: expected at least one message, got an "
                                f"empty list")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{where}: messages[{k}]: expected a dict with 'role' and "
                                    f"'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"{where}: messages[{k}]['role']: expected a str, got "
                                    f"{type(m.get('role')).__name__}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatTemplateError(f"{where}: messages[{k}]['content']: expected a str, got "
                                    f"{type(content).__name__}")
        # keys holding None are dropped (APIs send content=None; templates test for presence)
        m = _plain({key: v for key, v in m.items() if v is not None}, f"{where}: messages[{k}]")
        reasoning = next((m[key] for key in _REASONING if m.get(key) is not None), None)
        if reasoning is not None:   # templates read reasoning under different names
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """How a model's conversations are written: its file's Jinja chat template, or (when the
    file has none) one of the built-in `Template` formats.

    `defaults` are template variables passed on every render unless overridden; `from_gguf`
    sets `enable_thinking=False` when the template reads that variable (Qwen3's think-off
    block) and `think_off` is left on, and never for a template that does not define it."""

    def __init__(self, source: str | None = None, *, builtin: Template | None = None,
                 special_tokens: Mapping | None = None, defaults: Mapping | None = None):
        where = "ChatTemplate"
        if source is not None and not isinstance(source, str):
            raise InvalidArgumentType(f"{where}: source: expected a Jinja str or None, got "
                                      f"{type(source).__name__}")
        if source is None and builtin is None:
            builtin = Template.CHATML
        if builtin is not None and not isinstance(builtin, Template):
            raise InvalidArgumentType(f"{where}: builtin: expected a Template, got "
                                      f"{type(builtin).__name__}")
        if source is not None and builtin is not None:
            raise InvalidArgument(f"{where}: give a Jinja source or a built-in Template, not both")
        self.source = source
        self.builtin = builtin
        self.special_tokens = {k: v for k, v in dict(special_tokens or {}).items() if v is not None}
        for k, v in self.special_tokens.items():
            if not isinstance(v, str):
                raise InvalidArgumentType(f"{where}: special_tokens[{k!r}]: expected a str, got "
                                          f"{type(v).__name__}")
        self.defaults = dict(defaults or {})
        self._compiled, self._names = None, frozenset()
        if source is not None:
            try:
                self._compiled, self._names = _compile(source)
            except jinja2.exceptions.TemplateError as e:
                raise ChatTemplateError(f"{where}: the chat template does not compile: "
                                        f"{type(e).__name__}: {e}") from None

    @classmethod
    def from_gguf(cls, gguf_file_or_metadata, tokenizer=None, *, think_off: bool = True
                  ) -> "ChatTemplate":
        """The template of a GGUF file (a `fu.gguf.read` result or its metadata): the Jinja
        `tokenizer.chat_template` when present, else the built-in format of the file's
        architecture (gemma for Gemma 1-3: base models such as Gemma-3-270M ship no template),
        else chatml. Special-token strings come from `tokenizer` when given, else from the
        file's token list."""
        meta = (gguf_file_or_metadata if isinstance(gguf_file_or_metadata, Mapping)
                else getattr(gguf_file_or_metadata, "metadata", None))
        if not isinstance(meta, Mapping):
            raise InvalidArgumentType("ChatTemplate.from_gguf: expected a GGUF file "
                                      "(fu.gguf.read) or "
                                      "its metadata mapping, got "
                                      f"{type(gguf_file_or_metadata).__name__}")
        source = meta.get("tokenizer.chat_template")
        if source is not None and not isinstance(source, str):
            raise ChatTemplateError(f"ChatTemplate.from_gguf: tokenizer.chat_template: expected "
                                    f"a str, got {type(source).__name__}")
        specials = {}
        tokens = meta.get("tokenizer.ggml.tokens")
        for name, key in _SPECIAL_KEYS:
            i = meta.get(key)
            if not isinstance(i, int) or isinstance(i, bool):
                continue
            if tokenizer is not None:
                if 0 <= i < tokenizer.vocab_size:
                    specials[name] = tokenizer.id_to_token(i)
            elif isinstance(tokens, list) and 0 <= i < len(tokens):
                specials[name] = tokens[i]
        if source is None:
            builtin = _ARCH_FORMATS.get(meta.get("general.architecture"), Template.CHATML)
            return cls(builtin=builtin, special_tokens=specials,
                       defaults={"enable_thinking": not think_off})
        out = cls(source, special_tokens=specials)
        if "enable_thinking" in out._names:
            out.defaults["enable_thinking"] = not think_off
        return out

    @property
    def kind(self) -> Template | None:
        """The built-in format this template writes (by SPEC T-22's markers), None if unknown."""
        return self.builtin if self.builtin is not None else detect(self.source)

    def uses(self, variable: str) -> bool:
        """Whether the Jinja source reads `variable` (False for built-in formats)."""
        return variable in self._names

    def render(self, messages, add_generation_prompt: bool = True, **variables) -> str:
        """The text of `messages` (dicts with 'role' and 'content'), ending with the opener of
        the assistant's reply when `add_generation_prompt`."""
        where = "ChatTemplate.render"
        chat = _checked_messages(messages, where)
        values = {**self.special_tokens, **self.defaults, **variables}
        if self._compiled is None:
            return _render_builtin(self.builtin, chat, bool(add_generation_prompt),
                                   values.get("enable_thinking", True) is False, where)
        try:
            return self._compiled.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=bool(add_generation_prompt),
                                         **_plain(values, f"{where}: variables"))
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{where}: the chat template raised: {e}") from None

    def stop_strings(self) -> tuple:
        """Where generation stops: the end-of-turn marker of the format (when known) and the
        text of the EOS token, without repeats."""
        out = []
        kind = self.kind
        if kind is not None:
            out.append(kind.stop_marker())
        eos = self.special_tokens.get("eos_token")
        if eos and eos not in out:
            out.append(eos)
        return tuple(out)

    def __repr__(self):
        what = f"builtin={self.builtin.value}" if self.builtin is not None else (
            f"jinja, {len(self.source)} chars, kind={getattr(self.kind, 'value', None)}")
        return f"ChatTemplate({what})"


def _text(m, where, k):
    content = m.get("content", "")
    if not isinstance(content, str):
        raise ChatTemplateError(f"{where}: messages[{k}]['content']: a built-in format takes "
                                f"str content, got {type(content).__name__}")
    return content


def _render_builtin(kind, chat, add_generation_prompt, think_off, where):
    """The `Template` formats over whole conversations; [system?, user] + generation prompt is
    exactly `render_turn(system, user, first=True, think_off)`."""
    texts = [(m["role"], _text(m, where, k)) for k, m in enumerate(chat)]
    # replies after the last user turn carry the think-off block the generation prompt
    # opened them with (as Qwen3's template renders its final turns), so a rendered
    # conversation starts with its own served prompt
    last_user = max((k for k, (r, _) in enumerate(texts) if r == "user"), default=-1)
    out = []
    if kind is Template.CHATML:
        block = "<think>\n\n</think>\n\n" if think_off else ""
        out += [f"<|im_start|>{r}\n{block if r == 'assistant' and k > last_user else ''}{c}"
                f"<|im_end|>\n" for k, (r, c) in enumerate(texts)]
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if think_off else ""))
    elif kind is Template.LLAMA3:
        out.append("<|begin_of_text|>")
        out += [f"<|start_header_id|>{r}<|end_header_id|>\n\n{c.strip()}<|eot_id|>"
                for r, c in texts]
        if add_generation_prompt:
            out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    elif kind is Template.GEMMA:
        out.append("<bos>")
        prefix = ""
        if texts and texts[0][0] == "system":
            prefix = texts[0][1].strip() + "\n\n"
            texts = texts[1:]
        for r, c in texts:
            role = "model" if r == "assistant" else r
            out.append(f"<start_of_turn>{role}\n{prefix}{c.strip()}<end_of_turn>\n")
            prefix = ""
        if add_generation_prompt:
            out.append("<start_of_turn>model\n")
    else:   # GEMMA4
        out.append("<bos>")
        system = None
        if texts and texts[0][0] == "system":
            system, texts = texts[0][1], texts[1:]
        if system is not None or not think_off:
            out.append(f"<|turn>system\n{'' if think_off else '<|think|>'}{(system or '').strip()}"
                       f"<turn|>\n")
        block = "<|channel>thought\n<channel|>" if think_off else ""
        for k, (r, c) in enumerate(texts, start=len(chat) - len(texts)):
            role = "model" if r == "assistant" else r
            head = block if r == "assistant" and k > last_user else ""
            out.append(f"<|turn>{role}\n{head}{c.strip()}<turn|>\n")
        if add_generation_prompt:
            out.append("<|turn>model\n" + ("<|channel>thought\n<channel|>" if think_off else ""))
    return "".join(out)
