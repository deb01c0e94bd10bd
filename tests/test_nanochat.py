"""examples/nanochat (issue 18 item 7): the GPT from scratch on the standard library's source —
bf16 matrices with f32 masters under Muon, AdamW for embedding and head; the loss falls, the
curves are a PNG, and a resumed run ends on the same bytes."""
import numpy as np

from examples import nanochat as nc

CFG = nc.TINY["cfg"]


def quiet(_):
    pass


def test_loss_falls_and_the_plot_is_a_png(tmp_path):
    r = nc.run(CFG, 40, 0.25, eval_every=20, plot=str(tmp_path / "loss.png"), sample=0, out=quiet)
    first = np.mean([l for _, l in r["train"][:5]])
    last = np.mean([l for _, l in r["train"][-5:]])
    assert last < first - 1.0, (first, last)     # ln 256 = 5.55 at the start
    assert r["held_out"][-1][1] < 4.0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_is_bit_exact(tmp_path):
    straight = nc.run(CFG, 12, 0.25, eval_every=0, sample=0, out=quiet)
    nc.run(CFG, 6, 0.25, eval_every=0, sample=0, save=str(tmp_path / "half"), out=quiet)
    resumed = nc.run(CFG, 12, 0.25, eval_every=0, sample=0, load=str(tmp_path / "half"),
                     out=quiet)
    assert resumed["step"] == 12
    assert [l for _, l in resumed["train"]] == [l for _, l in straight["train"][6:]]
    for name, w in straight["weights"].items():
        assert np.array_equal(w, resumed["weights"][name]), name
