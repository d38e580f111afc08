"""Scratch folders that live as long as the process that made them: the models a notebook saves, the scripts it
writes, a default working directory of `train` or `finetune`. Removed when the process exits (a notebook's kernel
shuts down, a script ends), so neither a notebook nor the test suite leaves folders in the system's temp directory.

`LAB_SCRATCH_DIR` puts them in another folder (made if missing): the system's temp directory is often a tmpfs, held
in RAM and by default half its size, too small for notebook 13's checkpoints on GPUs (TMPDIR would move every
program's temp files)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

SCRATCH_ENV = "LAB_SCRATCH_DIR"


_MADE: list[str] = []


def scratch_dir(prefix: str = "lab-") -> str:
    """A new empty folder in `LAB_SCRATCH_DIR` if set, else in the system's temp directory (its path, as
    `tempfile.mkdtemp` gives it), removed with everything in it when this process exits."""
    parent = os.environ.get(SCRATCH_ENV) or None
    if parent:
        os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    _MADE.append(path)
    return path


@atexit.register
def remove_scratch_dirs() -> None:
    """Remove every folder `scratch_dir` made in this process (at exit; the test suite calls it before it checks
    that nothing was left behind)."""
    while _MADE:
        shutil.rmtree(_MADE.pop(), ignore_errors=True)
