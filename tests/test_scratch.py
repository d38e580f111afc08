"""Scratch folders (helpers.runtime.scratch): LAB_SCRATCH_DIR moves them off the system's temp directory (often a
tmpfs in RAM), and they still go when the process ends."""
import os
import subprocess
import sys
from pathlib import Path

from helpers.runtime.scratch import SCRATCH_ENV

MAKE = "from helpers.runtime.scratch import scratch_dir; import os; p = scratch_dir('lab-x-'); print(p, os.path.isdir(p))"


def _made(env: dict) -> tuple[Path, bool]:
    out = subprocess.run([sys.executable, "-c", MAKE], capture_output=True, text=True, check=True, env=env).stdout
    path, was_dir = out.split()
    return Path(path), was_dir == "True"


def test_scratch_dir_honours_the_environment_variable(tmp_path):
    parent = tmp_path / "not-yet" / "made"
    made, was_dir = _made(dict(os.environ, **{SCRATCH_ENV: str(parent)}))
    assert was_dir and made.parent == parent and made.name.startswith("lab-x-")
    assert parent.is_dir() and not made.exists()   # the folder went with the process; its parent stays


def test_scratch_dir_defaults_to_the_temp_directory(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != SCRATCH_ENV}
    made, was_dir = _made(dict(env, TMPDIR=str(tmp_path)))
    assert was_dir and made.parent == tmp_path and not made.exists()
