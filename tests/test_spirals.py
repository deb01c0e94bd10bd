"""The spirals demo (SPEC D-1, examples/spirals.py) in its short form: data and model against
independent numpy references, training to 100 % accuracy, bit-exact resume for every optimizer
(in this process and in a new one at another thread count), the T-19 checkpoint directory and
its write order, the constant twin, the PNG, and the failure paths."""
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import fucina as fu
from examples import spirals as sp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["w1", "b1", "w2", "b2", "w3", "b3"]
MAGICS = {"sgd": b"FZS3", "adamw": b"FZA3", "muon": b"FZM3", "apollo": b"FZP3",
          "apollo_mini": b"FZP3", "groups": b"FZO3"}
RESUME_STEPS = 240  # checkpoint at 120: Apollo's projection (gap 100) is regenerated on both sides


def numpy_forward(w, x):
    """float64 reference of the MLP: tanh(x·w1ᵀ + b1) → tanh(·w2ᵀ + b2) → ·w3ᵀ + b3."""
    f = {k: v.astype(np.float64) for k, v in w.items()}
    h = np.tanh(x.astype(np.float64) @ f["w1"].T + f["b1"])
    h = np.tanh(h @ f["w2"].T + f["b2"])
    return h @ f["w3"].T + f["b3"]


def decode_png(data: bytes) -> np.ndarray:
    """An independent reader for the 8-bit RGB, filter-0 PNGs the demo writes: signature,
    chunk CRCs, IHDR fields, IDAT inflate, per-row filter bytes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, payload = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + payload) & 0xFFFFFFFF, kind
        chunks.append((kind, payload))
        pos += 12 + n
    assert pos == len(data)
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(p for k, p in chunks if k == b"IDAT"))
    rows = np.frombuffer(raw, np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


def recorder(monkeypatch):
    """Record the demo's checkpoint writes in order: (what, path)."""
    log = []
    for fname in ("begin_save", "write_file_atomic", "save_trainer_state"):
        real = getattr(sp, fname)

        def wrapped(path, *args, _real=real, _name=fname):
            log.append((_name, os.fspath(path)))
            return _real(path, *args)

        monkeypatch.setattr(sp, fname, wrapped)
    return log


# ---------------------------------------------------------------------------------------------
# data and model

def test_data_is_the_spec_spiral_with_repo_rng_noise():
    i = np.arange(200)
    t = i / 199
    theta = 3.5 * np.pi * t
    r = 0.15 + 0.85 * t
    with fu.ExecContext(threads=1) as ctx:
        data = sp.Data.make(ctx)
        noise = ctx.zeros((400, 2), ("n", "in"))
        fu.rng.normal_fill(1234, noise, 0.0, 0.02)
        noise = noise.numpy()
        x = data.x.numpy()
        labels = data.labels.numpy()
        assert data.x.tags == ("n", "in") and data.labels.dtype == "i64"
        del data
    assert labels.tolist() == [0, 1] * 200
    c0 = np.stack([r * np.sin(theta), r * np.cos(theta)], 1)
    np.testing.assert_array_equal(x[0::2], c0.astype(np.float32) + noise[0::2])
    np.testing.assert_array_equal(x[1::2], (-c0).astype(np.float32) + noise[1::2])
    assert 0.017 < noise.std() < 0.023 and abs(noise.mean()) < 0.004


def test_init_registry_and_forward():
    with fu.ExecContext(threads=1) as ctx:
        m = sp.Mlp(ctx, 42)
        w = m.arrays()
        for k, (name, bound) in enumerate([("w1", 2 ** -0.5), ("w2", 1 / 8), ("w3", 1 / 8)]):
            ref = ctx.zeros(w[name].shape, ("a", "b"))
            fu.rng.uniform_fill(fu.rng.at(42, k), ref, -bound, bound)
            np.testing.assert_array_equal(w[name], ref.numpy())
            assert np.abs(w[name]).max() <= np.float32(bound)
        for name in ("b1", "b2", "b3"):
            assert not w[name].any()
        assert {k: v.shape for k, v in w.items()} == {"w1": (64, 2), "b1": (64,), "w2": (64, 64),
                                                      "b2": (64,), "w3": (2, 64), "b3": (2,)}
        assert not np.array_equal(sp.Mlp(ctx, 7).arrays()["w2"], w["w2"])
        reg = m.registry()
        assert reg.names() == NAMES and all(reg.view(i).trainable for i in range(6))
        twin = sp.Mlp(ctx, 7, trainable=False)
        treg = twin.registry()
        assert treg.names() == NAMES and not any(treg.view(i).trainable for i in range(6))
        assert not twin.w1.requires_grad
        data = sp.Data.make(ctx)
        with ctx.exec_scope():
            logits = m.forward(data.x)
            assert logits.tags == ("n", "class")
            got = logits.numpy()
        np.testing.assert_allclose(got, numpy_forward(w, data.x_np), rtol=1e-5, atol=1e-5)
        del m, twin, reg, treg, data, logits


def test_registration_order_and_routing():
    """w1, w2 add_param; w3 as a fallback (Muon/Apollo keep the head out of the 2-D path);
    b1..b3 — checked on Muon, Apollo and the groups set."""
    rec = sp.recipes()
    with fu.ExecContext(threads=1) as ctx:
        m = sp.Mlp(ctx, 42)
        for name in ("muon", "apollo", "apollo_mini"):
            tr = rec[name](m)
            assert [s.name for s in tr.opt.slots] == ["w1", "w2"]
            assert [s.name for s in tr.opt.fallback.slots] == ["w3", "b1", "b2", "b3"]
            tr.close()
        tr = rec["groups"](m)
        decay, no_decay = tr.opt.members
        assert [s.name for s in decay.slots] == ["w1", "w2", "w3"] and decay.config.weight_decay == 0.01
        assert [s.name for s in no_decay.slots] == ["b1", "b2", "b3"]
        assert no_decay.config.weight_decay == 0.0 and tr.clip == 1.0
        tr.close()
        tr = rec["sgd"](m)
        assert [s.name for s in tr.opt.slots] == ["w1", "w2", "w3", "b1", "b2", "b3"]
        assert tr.opt.config.nesterov and tr.opt.config.momentum == 0.9 and tr.opt.config.lr == 0.1
        tr.close()
        del m


def test_groups_schedule_and_clip_every_step():
    """The groups run applies warmup_cosine_factor(step, total, 5 % of total, 0.05) to both
    members before each step and clips the global norm to 1.0 after each backward."""
    with fu.ExecContext(threads=1) as ctx:
        data, m = sp.Data.make(ctx), sp.Mlp(ctx, 42)
        tr = sp.recipes()["groups"](m)
        calls = []
        real = tr.opt.clip_grad_norm
        tr.opt.clip_grad_norm = lambda max_norm: calls.append(max_norm) or real(max_norm)
        logged = sp.train(ctx, m, data, tr, 0, 4, 200, log_every=2, out=lambda *a: None)
        assert [row[0] for row in logged] == [2, 4]
        assert calls == [1.0] * 4
        want = float(np.float32(0.02 * 0.4))  # SPEC T-12: step 3 of a 10-step warmup
        assert [o.config.lr for o in tr.opt.members] == [want, want]
        sp.train(ctx, m, data, tr, 4, 200, 200)
        factor = 0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * (199 - 10) / (200 - 10)))  # last step
        assert tr.opt.members[0].config.lr == float(np.float32(0.02 * factor))
        tr.close()
        del data, m, tr


# ---------------------------------------------------------------------------------------------
# the short demo

def test_short_demo_reaches_100_percent(tmp_path, monkeypatch):
    monkeypatch.setenv("FUCINA_DEBUG", "1")  # a leaked pool buffer makes ctx.close() raise
    writes = recorder(monkeypatch)
    lines = []
    png = tmp_path / "spirals.png"
    results = sp.run(steps=500, optimizers="adamw,muon,apollo", save=str(tmp_path / "ck"),
                     plot=str(png), threads=1, log_every=100, out=lines.append)
    assert [r.name for r in results] == ["adamw", "muon", "apollo"]
    with fu.ExecContext(threads=1) as ctx:
        data = sp.Data.make(ctx)
        x_np, labels_np = data.x_np, data.labels_np
        del data
    img = decode_png(png.read_bytes())
    assert img.shape == (320, 3 * 320 + 2 * 8, 3)
    assert (img[:, 320:328] == 255).all() and (img[:, 648:656] == 255).all()  # gutters
    grid = sp.plot_grid()
    for panel, r in enumerate(results):
        assert r.accuracy == 1.0, r
        assert r.max_delta == 0.0 and r.resumed_from == 250
        assert r.first_full is not None

        # T-19 directory: begin_save (drops the old sentinel), payloads, sentinel last
        ck = os.path.join(tmp_path, "ck", r.name, "checkpoint-step-250")
        assert r.checkpoint == ck
        assert sorted(os.listdir(ck)) == ["checksums.json", "model.safetensors", "optimizer.fucina",
                                          "trainer_state.json"]
        mine = [(w, os.path.basename(p)) for w, p in writes if p.startswith(ck)]
        assert mine == [("begin_save", "checkpoint-step-250"),
                        ("write_file_atomic", "model.safetensors"),
                        ("write_file_atomic", "optimizer.fucina"),
                        ("save_trainer_state", "checkpoint-step-250")]
        with open(os.path.join(ck, "trainer_state.json"), "rb") as f:
            assert f.read() == fu.io.format_trainer_state(fu.io.TrainerState(step=250, seed=42))
        tensors = load_file(os.path.join(ck, "model.safetensors"))
        assert sorted(tensors) == sorted(NAMES)
        assert all(v.dtype == np.float32 for v in tensors.values())
        with open(os.path.join(ck, "optimizer.fucina"), "rb") as f:
            assert f.read(16)[12:] == MAGICS[r.name]  # inside the FZC1 | u64 length envelope

        # the final weights: a model-only checkpoint; the constant twin's accuracy is theirs
        assert sorted(os.listdir(r.final)) == ["checksums.json", "model.safetensors",
                                               "trainer_state.json"]
        final = load_file(os.path.join(r.final, "model.safetensors"))
        assert np.mean(numpy_forward(final, x_np).argmax(1) == labels_np) == r.accuracy == 1.0

        # the picture: the twin's class-1 probability on the pixel grid, drawn as rendered
        logits = numpy_forward(final, grid)
        e = np.exp(logits - logits.max(1, keepdims=True))
        want = (e[:, 1] / e.sum(1)).reshape(320, 320)
        np.testing.assert_allclose(r.boundary, want, atol=1e-4)
        sub = img[:, panel * 328:panel * 328 + 320]
        np.testing.assert_array_equal(sub, sp.render_panel(r.boundary, x_np, labels_np))
        # each point in its class colour at its place (unless a later dot covers its centre)
        cx = (x_np[:, 0] / sp.PLOT_EXTENT + 1) / 2 * 320
        cy = (1 - x_np[:, 1] / sp.PLOT_EXTENT) / 2 * 320
        seen = 0
        for i in range(len(x_np)):
            px, py = int(cx[i]) + 0.5, int(cy[i]) + 0.5
            if (((cx[i + 1:] - px) ** 2 + (cy[i + 1:] - py) ** 2) > 3.3 ** 2).all():
                got = sub[int(cy[i]), int(cx[i])].astype(int)
                assert np.abs(got - sp.COLORS[labels_np[i]] * 0.8).max() <= 1, i
                seen += 1
        assert seen > 250
    assert any("adamw" in ln and "step   500/500" in ln and "ms/step" in ln for ln in lines)
    assert lines[-1].startswith("pool: 0 buffers outstanding after close")


@pytest.fixture(scope="module")
def saved_all(tmp_path_factory):
    """Every optimizer at 240 steps, one thread, checkpoints kept."""
    root = tmp_path_factory.mktemp("spirals")
    lines = []
    results = sp.run(steps=RESUME_STEPS, optimizers="all", save=str(root), threads=1,
                     log_every=RESUME_STEPS, out=lines.append)
    return root, results, lines


def test_resume_is_bit_exact_for_every_optimizer(saved_all):
    root, results, lines = saved_all
    assert [r.name for r in results] == list(sp.OPTIMIZERS)  # Muon and Apollo are in this tree
    for r in results:
        assert r.resumed_from == RESUME_STEPS // 2
        assert r.max_delta == 0.0, r.name
        with open(os.path.join(r.checkpoint, "optimizer.fucina"), "rb") as f:
            assert f.read(16)[12:] == MAGICS[r.name]  # inside the FZC1 | u64 length envelope
    assert sum("bit-exact @120" in ln for ln in lines) == len(sp.OPTIMIZERS)


def test_resume_in_a_new_process_at_two_threads(saved_all, tmp_path):
    """--load: the second half runs in a fresh interpreter with a 2-thread context and must land
    on the bytes the 1-thread process saved."""
    root, results, _ = saved_all
    proc = subprocess.run([sys.executable, "-m", "examples.spirals", "--steps", str(RESUME_STEPS),
                           "--optimizer", "all", "--load", str(root), "--save", str(tmp_path),
                           "--threads", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("bit-exact @120") == len(sp.OPTIMIZERS), proc.stdout
    for r in results:
        a = load_file(os.path.join(r.final, "model.safetensors"))
        b = load_file(os.path.join(tmp_path, r.name, "final", "model.safetensors"))
        for k in NAMES:
            assert a[k].tobytes() == b[k].tobytes()


def test_a_perturbed_checkpoint_is_caught(saved_all, tmp_path, monkeypatch):
    """One weight one ulp off in the halfway checkpoint: the resumed run cannot reproduce the
    saved final weights, and the demo says so with ResumeNotBitExact (and still returns every
    pool buffer: FUCINA_DEBUG turns a leak into an error)."""
    monkeypatch.setenv("FUCINA_DEBUG", "1")
    root, results, _ = saved_all
    src = os.path.join(root, "adamw")
    dst = tmp_path / "adamw"
    for sub in ("checkpoint-step-120", "final"):
        os.makedirs(dst / sub)
        for f in os.listdir(os.path.join(src, sub)):
            with open(os.path.join(src, sub, f), "rb") as fi:
                (dst / sub / f).write_bytes(fi.read())
    path = str(dst / "checkpoint-step-120" / "model.safetensors")
    tensors = load_file(path)
    tensors["w2"][3, 5] = np.nextafter(tensors["w2"][3, 5], np.float32(1))
    save_file(tensors, path)
    fu.io.write_manifest(dst / "checkpoint-step-120")  # a deliberate edit: re-seal checksums.json
    with pytest.raises(sp.ResumeNotBitExact, match=r"adamw.*max\|Δ\|"):
        sp.run(steps=RESUME_STEPS, optimizers="adamw", load=str(tmp_path),
               save=str(tmp_path / "out"), threads=1, out=lambda *a: None)
    assert issubclass(sp.ResumeNotBitExact, fu.FucinaError)


def test_load_one_checkpoint_directory(saved_all, tmp_path):
    """--load may name a checkpoint directory itself (then with one --optimizer); the resumed
    run is compared with the `final` directory next to it."""
    root, results, _ = saved_all
    ck = next(r.checkpoint for r in results if r.name == "muon")
    lines = []
    (r,) = sp.run(steps=RESUME_STEPS, optimizers="muon", load=ck, save=str(tmp_path), threads=2,
                  out=lines.append)
    assert r.max_delta == 0.0 and r.resumed_from == 120 and r.accuracy == next(
        q.accuracy for q in results if q.name == "muon")
    with pytest.raises(SystemExit, match="single --optimizer"):
        sp.run(steps=RESUME_STEPS, optimizers="muon,adamw", load=ck, threads=1,
               out=lambda *a: None)


def test_load_errors(tmp_path):
    with pytest.raises(fu.CheckpointError, match="checkpoint for 'adamw'"):
        sp.run(steps=20, optimizers="adamw", load=str(tmp_path), threads=1, out=lambda *a: None)
    with pytest.raises(SystemExit, match="--optimizer"):
        sp.run(steps=20, optimizers="adam", threads=1, out=lambda *a: None)
    with pytest.raises(SystemExit, match="--steps"):
        sp.run(steps=1, optimizers="adamw", threads=1, out=lambda *a: None)


def test_missing_optimizers_are_skipped_with_a_note(monkeypatch):
    full = sp.recipes()
    monkeypatch.setattr(sp, "recipes", lambda: {k: v for k, v in full.items()
                                                if k not in ("muon", "apollo", "apollo_mini")})
    lines = []
    results = sp.run(steps=4, optimizers="muon,adamw,apollo_mini", threads=1, out=lines.append)
    assert [r.name for r in results] == ["adamw"] and results[0].max_delta == 0.0
    assert any(ln.startswith("NOTE: optimizer 'muon' is skipped") for ln in lines)
    assert any(ln.startswith("NOTE: optimizer 'apollo_mini' is skipped") for ln in lines)


def test_cli_entry(tmp_path):
    assert sp.main(["--steps", "6", "--optimizer", "groups", "--threads", "1", "--save",
                    str(tmp_path), "--log-every", "3"]) == 0
    state = fu.io.load_trainer_state(tmp_path / "groups" / "checkpoint-step-3")
    assert (state.step, state.seed) == (3, 42)
    assert fu.io.load_trainer_state(tmp_path / "groups" / "final").step == 6
