"""A command's output directory (quantize, make-draft, export): refused if it holds anything, written
beside itself and renamed into place, so that a failed or interrupted write leaves nothing that loads as a
model or a head, and never mixes new files with an old directory's.

    check_new_dir(out)          # early, before the slow work: a clear error while it is cheap
    with new_dir(out) as tmp:   # write into tmp; renamed to out when the block ends without an error
        save_file(..., tmp / "model.safetensors")

new_dir(out, replace=True) replaces whatever `out` holds instead (a draft model saved again).

sync_replace(tmp, path) puts one written file in place durably (a training shard, a checkpoint): a file a
resumed run trusts by its name alone must not be left empty or cut short by a crash of the machine.
write_atomic(path, text) does it for a text file.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specdec.config import ConfigError


def check_new_dir(out: Path) -> None:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; give a new one")


def sync_replace(tmp: Path, path: Path) -> None:
    """Rename the written file tmp to path, its bytes on disk first and the rename after."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(Path(path).parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """path's new text, whole or not at all (a report rewritten from itself, a file beside an export): written
    beside it, then renamed over it."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(text)
    sync_replace(tmp, Path(path))


@contextmanager
def new_dir(out: Path, replace: bool = False) -> Iterator[Path]:
    out = Path(out)
    if not replace:
        check_new_dir(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a leftover of an earlier failed write
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out) if replace else out.rmdir()  # (without replace: empty, checked above)
    os.replace(partial, out)
