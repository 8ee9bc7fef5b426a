"""A command's output directory (quantize, make-draft, export): refused if it holds anything, written
beside itself and renamed into place, so that a failed or interrupted write leaves nothing that loads as a
model or a head, and never mixes new files with an old directory's.

    check_new_dir(out)          # early, before the slow work: a clear error while it is cheap
    with new_dir(out) as tmp:   # write into tmp; renamed to out when the block ends without an error
        save_file(..., tmp / "model.safetensors")
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


@contextmanager
def new_dir(out: Path) -> Iterator[Path]:
    out = Path(out)
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
        out.rmdir()  # empty (checked above)
    os.replace(partial, out)
