"""`fucina es-finetune` (SPEC D-4, issue 19): rewards, lora and full modes, bit-exact resume, and
the same bytes with and without Ray."""
import subprocess
import sys

import pytest

import fucina as fu
from fucina.cli import es_finetune as ef
from fucina.cli.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=9))


def opts(model, save, **kw):
    base = dict(model=model, save=str(save), iterations=2, population=4, batch=2, max_new=4,
                reward="acc", threads=1)
    base.update(kw)
    return ef.Options(**base)


def quiet(_):
    pass


def test_unigram_f1_and_format():
    assert ef.words("Ahoy! The capital, PARIS") == [b"ahoy", b"the", b"capital", b"paris"]
    assert ef.unigram_f1("Paris paris rome", "paris is paris") == pytest.approx(2 * (2 / 3) * (2 / 3) / (4 / 3))
    assert ef.unigram_f1("", "x") == 0.0 and ef.unigram_f1("a", "b") == 0.0
    assert ef.format_score("  Ahoy! fine, matey.\n", "Ahoy!", "matey.") == 1.0
    assert ef.format_score("Ahoy! fine", "Ahoy!", "matey.") == 0.5
    assert ef.rule_reward("Ahoy! a b matey.", "a b", "Ahoy!", "matey.") == pytest.approx(
        2 * 0.5 * 1.0 / 1.5 + 0.1)
    assert ef.words("x" * 100) == [b"x" * 64]


@pytest.mark.parametrize("reward,norm", [("rule", "z_score"), ("acc", "z_score"),
                                         ("nll", "centered_ranks")])
def test_each_reward_trains_and_saves(tiny, tmp_path, reward, norm):
    r = ef.run(opts(tiny, tmp_path / "s", reward=reward, norm=norm), out=quiet)
    assert r.iterations == 2 and len(r.rewards) == 2
    assert (tmp_path / "s" / "adapters.safetensors").is_file()
    state = fu.io.load_trainer_state(str(tmp_path / "s"))
    assert state.es_iteration == 2 and state.es_population == 4 and state.lora_rank == 8


def test_resume_is_bit_exact(tiny, tmp_path):
    ef.run(opts(tiny, tmp_path / "full", iterations=4, antithetic=True), out=quiet)
    ef.run(opts(tiny, tmp_path / "half", iterations=2, antithetic=True), out=quiet)
    ef.run(opts(tiny, tmp_path / "rest", iterations=4, antithetic=True,
                load=str(tmp_path / "half")), out=quiet)
    a = (tmp_path / "full" / "adapters.safetensors").read_bytes()
    b = (tmp_path / "rest" / "adapters.safetensors").read_bytes()
    assert a == b
    assert (tmp_path / "half" / "adapters.safetensors").read_bytes() != a


def test_full_mode_on_a_dense_file_and_refused_on_a_quantized_one(tiny, tmp_path):
    r = ef.run(opts(tiny, tmp_path / "f", mode="full", anchor_decay="l2", anchor_lambda=1.0),
               out=quiet)
    assert r.iterations == 2
    assert (tmp_path / "f" / "model.safetensors").is_file()
    q8 = str(build_tiny_model(tmp_path / "q8.gguf", seed=9, dtype="q8_0"))
    with pytest.raises(fu.QuantizedWeightsUnsupported, match="--dtype f16"):
        ef.run(opts(q8, tmp_path / "g", mode="full"), out=quiet)


def test_adapters_load_where_finetune_adapters_load(tiny, tmp_path):
    ef.run(opts(tiny, tmp_path / "s"), out=quiet)
    ctx = fu.ExecContext(threads=1)
    model = fu.llm.decoder.Model.from_gguf(ctx, tiny)
    tr = fu.llm.decoder.Trainer(model, fu.llm.decoder.Targets(), fu.lora.LoraConfig(8, 16), 0)
    tr.load_adapters(str(tmp_path / "s" / "adapters.safetensors"))


def test_ray_gives_the_same_bytes(tiny, tmp_path):
    pytest.importorskip("ray")
    ef.run(opts(tiny, tmp_path / "a", antithetic=True), out=quiet)
    ef.run(opts(tiny, tmp_path / "b", antithetic=True, ray="local", actors=2), out=quiet)
    import ray
    ray.shutdown()
    assert ((tmp_path / "a" / "adapters.safetensors").read_bytes()
            == (tmp_path / "b" / "adapters.safetensors").read_bytes())


def test_command_line(tiny, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "fucina", "es-finetune", *a],
                                    capture_output=True, text=True, timeout=300)
    p = run("--help")
    assert p.returncode == 0 and "--reward" in p.stdout and "--ray" in p.stdout
    p = run("--mode", "bogus")
    assert p.returncode == 2 and "invalid choice" in p.stderr
    p = run("--model", tiny, "--iterations", "0", "--save", str(tmp_path / "x"))
    assert p.returncode == 2 and "--iterations: expected >= 1, got 0" in p.stderr
    p = run("--model", tiny, "--iterations", "1", "--population", "2", "--batch", "1",
            "--reward", "nll", "--save", str(tmp_path / "y"))
    assert p.returncode == 0, p.stderr
    assert "iter    1/1  reward mean" in p.stdout and "saved" in p.stdout


def test_llama_architecture(tmp_path):
    llama = str(build_tiny_model(tmp_path / "llama.gguf", seed=9, arch="llama"))
    for mode in ("lora", "full"):
        r = ef.run(opts(llama, tmp_path / mode, mode=mode, reward="rule"), out=quiet)
        assert r.iterations == 2
