"""The `fucina` command: one console script, a subcommand per application.

    fucina finetune ...      LoRA fine-tuning of a GGUF model (fucina/cli/finetune.py)
    fucina export ...        merge adapters into a GGUF and/or transcode it (export.py)
    fucina chat MODEL.gguf   a streamed chat with the model, or one answer (chat.py)
    fucina info MODEL.gguf   what a GGUF file holds (info.py)
    fucina prewarm ...       compile the kernels of a workload ahead of time (prewarm.py)
    fucina es-finetune ...   gradient-free fine-tuning by evolution strategies (es_finetune.py)

`python -m fucina ...` is the same command. Each subcommand's module has a `main(argv)` that
returns the exit status; the module is imported only when its subcommand runs, so `fucina
--help` and a short command start fast.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module under fucina.cli, one-line summary)
COMMANDS = {
    "finetune": ("finetune", "LoRA fine-tuning of a GGUF model on a JSONL data set"),
    "export": ("export", "merge LoRA adapters into a GGUF and/or transcode its weights"),
    "chat": ("chat", "talk to a GGUF model: a streamed multi-turn REPL or one --prompt"),
    "info": ("info", "what a GGUF file holds: architecture, sizes, tensor types, tokenizer"),
    "prewarm": ("prewarm", "compile the kernels of a workload ahead of time"),
    "es-finetune": ("es_finetune", "gradient-free fine-tuning by evolution strategies (also on Ray)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return ("usage: fucina COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`fucina COMMAND --help` describes one command.")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)  # no command: an error
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"fucina: unknown command {name!r}; expected one of {', '.join(COMMANDS)}\n\n"
              f"{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")
    return module.main(rest) or 0
