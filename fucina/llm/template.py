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
"""
from __future__ import annotations

import enum

__all__ = ["Template", "detect"]


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
            raise TypeError(f"{where}: system: expected a str or None, got {type(system).__name__}")
        if not isinstance(user, str):
            raise TypeError(f"{where}: user: expected a str, got {type(user).__name__}")
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

# SPEC T-22 detection order: the first marker found in the template text decides
_MARKERS = (("<|im_start|>", Template.CHATML), ("<|start_header_id|>", Template.LLAMA3),
            ("<|turn>", Template.GEMMA4), ("<start_of_turn>", Template.GEMMA))


def detect(chat_template: str | None) -> Template | None:
    """The format of a GGUF `tokenizer.chat_template` string, or None when none of the SPEC's
    markers occurs in it (the finetune app then falls back to chatml)."""
    if chat_template is None:
        return None
    if not isinstance(chat_template, str):
        raise TypeError(f"template.detect: chat_template: expected a str or None, got "
                        f"{type(chat_template).__name__}")
    for marker, template in _MARKERS:
        if marker in chat_template:
            return template
    return None
