"""examples/es_spirals (SPEC D-2): ES from scratch reaches its target; the evaluation mode,
checkpoint resume and exit status behave as documented."""
import pytest

from examples import es_spirals as demo


def quiet(lines):
    return lines.append


def test_short_run_reaches_its_target():
    lines = []
    out = demo.run(log=quiet(lines))
    assert out["accuracy"] >= demo.SHORT["target"]
    assert out["iterations"] == demo.SHORT["iterations"]
    assert any(line.startswith("iter   1500  accuracy") for line in lines)  # progress every 500
    assert lines[-1].startswith("PASS")


def test_team_and_threads_train_the_same_bits():
    runs = [demo.run(iterations=40, target=0.0, mode=mode, log=quiet([])) for mode in ("team", "threads")]
    assert runs[0]["mode"] == "team" and runs[1]["mode"] == "threads"
    assert (runs[0]["accuracy"], runs[0]["ce"]) == (runs[1]["accuracy"], runs[1]["ce"])


def test_resume_from_checkpoint_is_bit_exact(tmp_path):
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    a = demo.run(iterations=50, target=0.0, mode="team", save=straight, log=quiet([]))
    demo.run(iterations=20, target=0.0, mode="team", save=first, log=quiet([]))
    lines = []
    b = demo.run(iterations=30, target=0.0, mode="team", load=first, save=resumed, log=quiet(lines))
    assert "resumed" in lines[0] and "iteration 20" in lines[0]
    assert (a["accuracy"], a["ce"]) == (b["accuracy"], b["ce"])
    assert (straight / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()


def test_target_decides_the_exit_status(capsys):
    assert demo.main(["--iterations", "3", "--target", "0.99", "--mode", "team"]) == 1
    assert "FAIL: es-spirals" in capsys.readouterr().out
    assert demo.main(["--iterations", "3", "--target", "0.0", "--mode", "threads", "--workers", "2"]) == 0
    with pytest.raises(demo.FromScratchTrainingFailed):
        demo.run(iterations=2, target=1.01, mode="team", log=quiet([]))


@pytest.mark.slow
def test_full_run_reaches_090():
    out = demo.run(**demo.FULL, log=quiet([]))
    assert out["accuracy"] >= 0.90
