"""Bad-input battery for the `fucina` command (issue 20 item 6, the CLI part), run as a user
runs it: `python -m fucina ...` in a subprocess. Every subcommand with wrong, missing or
malformed arguments and with nonexistent or corrupt files: the exit status (2 for a refused
argument or input; export and prewarm document 1 for a failed run), one clear line on stderr
naming the command (argparse's usage lines come before its `error:` line), no traceback, and
nothing written."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fucina
from fucina.cli.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-inputs")
    tiny = Path(build_tiny_model(d / "tiny.gguf", seed=4, dtype="f16"))
    (d / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    (d / "empty.gguf").write_bytes(b"")
    (d / "cut.gguf").write_bytes(tiny.read_bytes()[:5000])
    (d / "hdr.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (d / "dir").mkdir()
    (d / "bad.jsonl").write_text('{"instruction": "a"\n')
    (d / "notjson.jsonl").write_text("not json\n")
    (d / "nokeys.jsonl").write_text('{"q": "a", "a": "b"}\n')
    return d


def _listing(d):
    return sorted((str(p.relative_to(d)), p.stat().st_size if p.is_file() else -1) for p in d.rglob("*"))


P = {"tiny": "tiny.gguf", "junk": "junk.gguf", "empty": "empty.gguf", "cut": "cut.gguf",
     "hdr": "hdr.gguf", "missing": "missing.gguf", "dir": "dir", "bad": "bad.jsonl",
     "notjson": "notjson.jsonl", "nokeys": "nokeys.jsonl"}

# (id, argv with {name} for an input file and {out} for a path in the output directory,
#  exit status, what the last stderr line starts with, what it must also contain)
ARG = "error: "  # argparse's line: "fucina CMD: error: ..."
CASES = [
    ("no command", [], 2, "`fucina COMMAND --help`", ""),
    ("unknown command", ["bogus"], 2, "`fucina COMMAND --help`", ""),
    # info
    ("info no model", ["info"], 2, "fucina info: " + ARG, "MODEL.gguf"),
    ("info missing file", ["info", "{missing}"], 2, "fucina info: ", "No such file"),
    ("info empty file", ["info", "{empty}"], 2, "fucina info: ", "empty file"),
    ("info junk file", ["info", "{junk}"], 2, "fucina info: ", "bad magic"),
    ("info truncated file", ["info", "{cut}"], 2, "fucina info: ", "truncated"),
    ("info header only", ["info", "{hdr}"], 2, "fucina info: ", "truncated"),
    ("info directory", ["info", "{dir}"], 2, "fucina info: ", "Is a directory"),
    ("info unknown flag", ["info", "--bogus", "{tiny}"], 2, "fucina info: " + ARG, "--bogus"),
    ("info two models", ["info", "{tiny}", "{tiny}"], 2, "fucina info: " + ARG, "unrecognized"),
    # chat
    ("chat no model", ["chat"], 2, "fucina chat: " + ARG, "MODEL.gguf"),
    ("chat missing file", ["chat", "{missing}", "--prompt", "hi"],
     2, "fucina chat: GGUFError", "No such file"),
    ("chat junk file", ["chat", "{junk}", "--prompt", "hi"],
     2, "fucina chat: GGUFError", "bad magic"),
    ("chat empty file", ["chat", "{empty}", "--prompt", "hi"],
     2, "fucina chat: GGUFError", "empty file"),
    ("chat truncated file", ["chat", "{cut}", "--prompt", "hi"],
     2, "fucina chat: GGUFError", "truncated"),
    ("chat directory", ["chat", "{dir}", "--prompt", "hi"],
     2, "fucina chat: GGUFError", "Is a directory"),
    ("chat max-new not int", ["chat", "{tiny}", "--prompt", "hi", "--max-new", "abc"],
     2, "fucina chat: " + ARG, "--max-new"),
    ("chat max-new 0", ["chat", "{tiny}", "--prompt", "hi", "--max-new", "0"],
     2, "fucina chat: " + ARG, "--max-new"),
    ("chat max-new negative", ["chat", "{tiny}", "--prompt", "hi", "--max-new", "-1"],
     2, "fucina chat: " + ARG, "--max-new"),
    ("chat temperature negative", ["chat", "{tiny}", "--prompt", "hi", "--temperature", "-1"],
     2, "fucina chat: InvalidSamplingSettings", "temperature"),
    ("chat temperature nan", ["chat", "{tiny}", "--prompt", "hi", "--temperature", "nan"],
     2, "fucina chat: InvalidSamplingSettings", "temperature"),
    ("chat top-p 2", ["chat", "{tiny}", "--prompt", "hi", "--top-p", "2"],
     2, "fucina chat: InvalidSamplingSettings", "top_p"),
    ("chat top-k negative", ["chat", "{tiny}", "--prompt", "hi", "--top-k", "-3"],
     2, "fucina chat: InvalidSamplingSettings", "top_k"),
    ("chat min-p negative", ["chat", "{tiny}", "--prompt", "hi", "--min-p", "-1"],
     2, "fucina chat: InvalidSamplingSettings", "min_p"),
    ("chat repetition penalty 0", ["chat", "{tiny}", "--prompt", "hi", "--repetition-penalty", "0"],
     2, "fucina chat: InvalidSamplingSettings", "repetition_penalty"),
    ("chat seed not int", ["chat", "{tiny}", "--prompt", "hi", "--seed", "x"],
     2, "fucina chat: " + ARG, "--seed"),
    ("chat threads 0", ["chat", "{tiny}", "--prompt", "hi", "--threads", "0"],
     2, "fucina chat: " + ARG, "--threads"),
    ("chat kv dtype", ["chat", "{tiny}", "--prompt", "hi", "--kv-dtype", "f64"],
     2, "fucina chat: " + ARG, "--kv-dtype"),
    ("chat adapters missing", ["chat", "{tiny}", "--prompt", "hi", "--adapters", "{missing}"],
     2, "fucina chat: AdaptersMismatch", "missing.gguf"),
    ("chat adapters empty dir", ["chat", "{tiny}", "--prompt", "hi", "--adapters", "{dir}"],
     2, "fucina chat: AdaptersMismatch", "adapters.safetensors"),
    ("chat alpha without adapters", ["chat", "{tiny}", "--prompt", "hi", "--alpha", "2"],
     2, "fucina chat: " + ARG, "--adapters"),
    # export
    ("export no input", ["export"], 2, "fucina export: " + ARG, "--from-gguf"),
    ("export no output", ["export", "--from-gguf", "{tiny}"], 2, "fucina export: " + ARG, "--out"),
    ("export out and lora-gguf", ["export", "--from-gguf", "{tiny}", "--out", "{out}/a.gguf", "--lora-gguf", "{out}/b.gguf"],
     2, "fucina export: " + ARG, "exactly one"),
    ("export lora-gguf without adapters", ["export", "--from-gguf", "{tiny}", "--lora-gguf", "{out}/b.gguf"],
     2, "fucina export: " + ARG, "--adapters"),
    ("export unknown dtype", ["export", "--from-gguf", "{tiny}", "--out", "{out}/o.gguf", "--dtype", "q3_x"],
     2, "fucina export: " + ARG, "--dtype"),
    ("export out is a directory", ["export", "--from-gguf", "{tiny}", "--out", "{out}"],
     2, "fucina export: " + ARG, "is a directory"),
    ("export missing input", ["export", "--from-gguf", "{missing}", "--out", "{out}/o.gguf"],
     1, "fucina export: GGUFError", "No such file"),
    ("export junk input", ["export", "--from-gguf", "{junk}", "--out", "{out}/o.gguf"],
     1, "fucina export: GGUFError", "bad magic"),
    ("export truncated input", ["export", "--from-gguf", "{cut}", "--out", "{out}/o.gguf"],
     1, "fucina export: GGUFError", "truncated"),
    ("export alpha alone", ["export", "--from-gguf", "{tiny}", "--out", "{out}/o.gguf", "--alpha", "2"],
     1, "fucina export: InvalidExportOption", "--alpha"),
    ("export alpha nan", ["export", "--from-gguf", "{tiny}", "--out", "{out}/o.gguf", "--adapters", "{dir}", "--alpha", "nan"],
     1, "fucina export: InvalidExportOption", "--alpha"),
    ("export adapters missing", ["export", "--from-gguf", "{tiny}", "--out", "{out}/o.gguf", "--adapters", "{missing}", "--alpha", "2"],
     1, "fucina export: FileNotFoundError", "missing.gguf"),
    ("export adapters junk", ["export", "--from-gguf", "{tiny}", "--out", "{out}/o.gguf", "--adapters", "{junk}", "--alpha", "2"],
     1, "fucina export: CheckpointMagicMismatch", "--adapters"),
    # prewarm
    ("prewarm unknown workload", ["prewarm", "--workload", "nope", "--no-bench"],
     1, "prewarm: no manifest for workload 'nope'", ""),
    ("prewarm missing manifest", ["prewarm", "--manifest", "{missing}", "--no-bench"],
     1, "prewarm: cannot read a manifest", "missing.gguf"),
    ("prewarm junk manifest", ["prewarm", "--manifest", "{junk}", "--no-bench"],
     1, "prewarm: ", "not a JSON key line"),
    ("prewarm jobs 0", ["prewarm", "--jobs", "0", "--no-bench"],
     2, "fucina prewarm: " + ARG, "--jobs"),
    ("prewarm jobs not int", ["prewarm", "--jobs", "x"], 2, "fucina prewarm: " + ARG, "--jobs"),
    ("prewarm record unknown", ["prewarm", "--record", "nope"],
     1, "prewarm: unknown workload 'nope'", ""),
    # finetune
    ("finetune steps not int", ["finetune", "--tiny", "--steps", "x"],
     2, "fucina finetune: " + ARG, "--steps"),
    ("finetune steps negative", ["finetune", "--tiny", "--steps", "-1"],
     2, "fucina finetune: ", "--steps"),
    ("finetune accum 0", ["finetune", "--tiny", "--accum-steps", "0"],
     2, "fucina finetune: ", "--accum-steps"),
    ("finetune lr negative", ["finetune", "--tiny", "--lr", "-1"], 2, "fucina finetune: ", "--lr"),
    ("finetune lr nan", ["finetune", "--tiny", "--lr", "nan"], 2, "fucina finetune: ", "--lr"),
    ("finetune alpha nan", ["finetune", "--tiny", "--alpha", "nan"],
     2, "fucina finetune: ", "--alpha"),
    ("finetune rank 0", ["finetune", "--tiny", "--rank", "0"], 2, "fucina finetune: ", "--rank"),
    ("finetune seq-max 0", ["finetune", "--tiny", "--seq-max", "0"],
     2, "fucina finetune: ", "--seq-max"),
    ("finetune threads 0", ["finetune", "--tiny", "--threads", "0"],
     2, "fucina finetune: ", "--threads"),
    ("finetune warmup negative", ["finetune", "--tiny", "--warmup", "-1"],
     2, "fucina finetune: ", "--warmup"),
    ("finetune eval split 2", ["finetune", "--tiny", "--eval-split", "2"],
     2, "fucina finetune: ", "--eval-split"),
    ("finetune eval data and split", ["finetune", "--tiny", "--eval-split", "0.5", "--eval-data", "{missing}"],
     2, "fucina finetune: " + ARG, "--eval-data"),
    ("finetune tiny and model", ["finetune", "--tiny", "--model", "{tiny}"],
     2, "fucina finetune: ", "--tiny"),
    ("finetune ask without export", ["finetune", "--tiny", "--ask", "why"],
     2, "fucina finetune: ", "--export"),
    ("finetune state dtype", ["finetune", "--tiny", "--state-dtype", "f16"],
     2, "fucina finetune: " + ARG, "--state-dtype"),
    ("finetune export dtype", ["finetune", "--tiny", "--export-dtype", "q3"],
     2, "fucina finetune: " + ARG, "--export-dtype"),
    ("finetune progress", ["finetune", "--tiny", "--progress", "x"],
     2, "fucina finetune: " + ARG, "--progress"),
    ("finetune missing model", ["finetune", "--model", "{missing}"],
     2, "fucina finetune: ", "no such file"),
    ("finetune junk model", ["finetune", "--model", "{junk}"],
     2, "fucina finetune: GGUFError", "bad magic"),
    ("finetune truncated model", ["finetune", "--model", "{cut}"],
     2, "fucina finetune: GGUFError", "truncated"),
    ("finetune missing data", ["finetune", "--tiny", "--data", "{missing}"],
     2, "fucina finetune: FileNotFoundError", "missing.gguf"),
    ("finetune malformed data", ["finetune", "--tiny", "--data", "{bad}"],
     2, "fucina finetune: MalformedJsonl", "bad.jsonl:1"),
    ("finetune non-json data", ["finetune", "--tiny", "--data", "{notjson}"],
     2, "fucina finetune: MalformedJsonl", "notjson.jsonl:1"),
    ("finetune load missing", ["finetune", "--tiny", "--load", "{missing}"],
     2, "fucina finetune: InvalidTrainerState", "trainer_state.json"),
    ("finetune load empty dir", ["finetune", "--tiny", "--load", "{dir}"],
     2, "fucina finetune: InvalidTrainerState", "trainer_state.json"),
    # es-finetune
    ("es population 0", ["es-finetune", "--tiny", "--population", "0"],
     2, "fucina es-finetune: InvalidConfig", "population"),
    ("es population not int", ["es-finetune", "--tiny", "--population", "x"],
     2, "fucina es-finetune: " + ARG, "--population"),
    ("es iterations negative", ["es-finetune", "--tiny", "--iterations", "-1"],
     2, "fucina es-finetune: InvalidConfig", "--iterations"),
    ("es sigma negative", ["es-finetune", "--tiny", "--sigma", "-1"],
     2, "fucina es-finetune: InvalidConfig", "sigma"),
    ("es sigma nan", ["es-finetune", "--tiny", "--sigma", "nan"],
     2, "fucina es-finetune: InvalidConfig", "sigma"),
    ("es alpha nan", ["es-finetune", "--tiny", "--alpha", "nan"],
     2, "fucina es-finetune: InvalidConfig", "alpha"),
    ("es mode", ["es-finetune", "--tiny", "--mode", "half"],
     2, "fucina es-finetune: " + ARG, "--mode"),
    ("es reward", ["es-finetune", "--tiny", "--reward", "x"],
     2, "fucina es-finetune: " + ARG, "--reward"),
    ("es batch 0", ["es-finetune", "--tiny", "--batch", "0"],
     2, "fucina es-finetune: InvalidConfig", "--batch"),
    ("es rank 0", ["es-finetune", "--tiny", "--rank", "0"],
     2, "fucina es-finetune: InvalidConfig", "--rank"),
    ("es actors 0", ["es-finetune", "--tiny", "--actors", "0"],
     2, "fucina es-finetune: InvalidConfig", "--actors"),
    ("es threads 0", ["es-finetune", "--tiny", "--threads", "0"],
     2, "fucina es-finetune: InvalidArgument", "threads"),
    ("es anchor lambda with l2", ["es-finetune", "--tiny", "--anchor-decay", "l2", "--anchor-lambda", "-1"],
     2, "fucina es-finetune: InvalidConfig", "anchor_lambda"),
    ("es missing model", ["es-finetune", "--model", "{missing}"],
     2, "fucina es-finetune: ", "no such file"),
    ("es junk model", ["es-finetune", "--model", "{junk}"],
     2, "fucina es-finetune: GGUFError", "bad magic"),
    ("es missing data", ["es-finetune", "--tiny", "--data", "{missing}"],
     2, "fucina es-finetune: FileNotFoundError", "missing.gguf"),
    ("es malformed data", ["es-finetune", "--tiny", "--data", "{bad}"],
     2, "fucina es-finetune: MalformedJsonl", "bad.jsonl:1"),
    ("es load missing", ["es-finetune", "--tiny", "--load", "{missing}"],
     2, "fucina es-finetune: InvalidTrainerState", "trainer_state.json"),
]

SAVES = ("finetune", "es-finetune")  # runs that would write a checkpoint: --save into {out}


@pytest.mark.parametrize("argv,status,starts,names", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_arguments(inputs, tmp_path, argv, status, starts, names):
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.format(out=out, **{k: inputs / v for k, v in P.items()}) for a in argv]
    if argv and argv[0] in SAVES:
        argv += ["--save", str(out / "save")]
    before = _listing(inputs)
    root = str(Path(fucina.__file__).parents[1])  # the subprocess runs this checkout's fucina
    env = {**os.environ, "SCRATCH": str(out),
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "fucina", *argv], capture_output=True, text=True,
                       timeout=300, cwd=out, env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == status, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(starts), p.stderr[-2000:]
    assert names in lines[-1], (names, lines[-1])
    if not (starts.startswith("`") or ARG in starts):
        assert len(lines) == 1, p.stderr[-2000:]  # one line, not a report
    assert list(out.iterdir()) == [], list(out.rglob("*"))  # nothing written
    assert _listing(inputs) == before


def test_case_count():
    assert len(CASES) >= 80 and len({c[0] for c in CASES}) == len(CASES)
