"""The doctor on this rig: every check PASS or REFUSED with a reason, every section guarded, and README's support
matrix is the real one."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.doctor import guarded, shm_verdict
from helpers.doctor.speeds import SPEEDS, speed_check
from helpers.doctor.long_runs import ASYNC, CPU_TO_GPU, KILLED, NOTEBOOK_13, OFFLOAD, RESERVE, SAVE_TO, SYNC
from helpers.runtime.rig import detect_rig
from helpers.training.support import reference_rigs, support_markdown

REPO = Path(__file__).resolve().parent.parent
LONG_RUNS_PASS = (OFFLOAD, SYNC, ASYNC, KILLED, SAVE_TO, NOTEBOOK_13)
CPU_REFUSED = ("CUDA paths: event timing, memory panel", "system: GPU-to-GPU copies", CPU_TO_GPU,  # need a GPU
               RESERVE)


@pytest.mark.full
def test_doctor_passes_or_refuses_with_a_reason(tmp_path):
    out = tmp_path / "doctor.json"
    proc = subprocess.run([sys.executable, "-m", "helpers.doctor", "--json", str(out), "--repeats", "2"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert set(statuses.values()) <= {"PASS", "REFUSED"}
    assert all(c["detail"] for c in report["checks"] if c["status"] == "REFUSED"), "a refusal says why"
    for name in ("threads: 1F1B m=4", "processes: 1F1B m=4", "torch: 1F1B m=4", "processes: fsdp2",
                 "processes: DP x PP 2 x 2, 1F1B", "system: /dev/shm for NCCL", "script: train_naive_split.py",
                 "script: train_fsdp2.py on 2 ranks", "script: train_dp_x_pp.py on 4 ranks",
                 "script: finetune_lora.py on 2 ranks", "bench: calibration in its ranks",
                 "bench: a launch of its jobs", "notebook 05: GPU sizes", "notebook 11: GPU sizes",
                 "notebook 06b: GPU sizes", "threads: zbv m=4", "processes: dualpipev m=4", "torch: interleaved m=4",
                 "processes: ddp, gradients sent in bf16", SPEEDS, *LONG_RUNS_PASS):
        assert statuses[name] == "PASS", name
    if detect_rig().is_cpu:  # a check that turns REFUSED here fails: the CPU rig refuses only what needs a GPU
        refused = {n for n, s in statuses.items() if s == "REFUSED"}
        assert refused == set(CPU_REFUSED), f"refused {sorted(refused)}, expected {CPU_REFUSED}"
    paths = {link["path"] for link in report["links"]}
    assert any("point-to-point" in p for p in paths) and any("all-reduce" in p for p in paths)
    assert all(link["GB/s"] > 0 and link["latency_us"] >= 0 for link in report["links"])


def test_a_failing_section_is_a_fail_row_not_a_crash():
    """One NCCL failure in the link benchmark killed the doctor before its table; every section is now guarded."""
    def broken():
        raise RuntimeError("NCCL error: unhandled system error")

    (row,) = guarded("links: point-to-point and all-reduce", broken)
    assert row.status == "FAIL" and "unhandled system error" in row.detail
    assert guarded("fine", lambda: "measured")[0].status == "PASS"


def test_docker_default_shm_fails_with_the_fix_on_two_gpus():
    rigs = reference_rigs()
    small = shm_verdict(rigs["two GPUs"], 64 * 2**20)
    assert small.status == "FAIL" and "--shm-size" in small.detail
    assert shm_verdict(rigs["two GPUs"], 8 * 2**30).status == "PASS"
    assert shm_verdict(rigs["CPU (2 cores)"], 64 * 2**20).status == "PASS"  # gloo does not use it


def test_readme_shows_the_support_matrix_the_code_enforces():
    readme = (REPO / "README.md").read_text()
    assert support_markdown() in readme, "regenerate it: python -m helpers.training.support"


def test_the_doctor_runs_every_schedule_on_every_engine(tmp_path):
    """Interleaved 1F1B, ZB-H1, ZB-V and DualPipeV (two-chunk stages, split backwards, copy streams) first ran on
    GPUs inside a notebook: the doctor now runs every schedule of helpers.pipeline.schedules on threads, processes
    and torch.distributed.pipelining, so a schedule added there is checked on GPUs at the next doctor run."""
    from helpers.doctor import plan_checks, schedule_label
    from helpers.pipeline.schedules import SCHEDULES
    from helpers.runtime.rig import cpu_rig

    names = {name for name, _, _ in plan_checks(cpu_rig(), str(tmp_path))}
    missing = [f"{engine}: {schedule_label(s)} m=4" for s in SCHEDULES for engine in ("threads", "processes", "torch")
               if f"{engine}: {schedule_label(s)} m=4" not in names]
    assert not missing, missing


@pytest.mark.parametrize("kind, seconds, status, says", [
    ("cpu", (0.1, 0.2), "PASS", "emulated with slowdown (1.0, 2.0)"),
    ("cpu", (0.1, 0.11), "FAIL", "did not stretch"),  # the emulation did not show: device 1 as fast as device 0
    ("two_gpus", (0.1, 0.16), "PASS", "unequal: split by speed"),
    ("two_gpus", (0.1, 0.101), "PASS", "equal within 10%")])
def test_the_doctor_times_each_device_and_names_the_split(monkeypatch, kind, seconds, status, says):
    """Each device's speed from the same timed forward + backward (given here: the measurement itself is
    tests/test_unequal.py's), and the split by speed beside the one for equal devices: the slower device never gets
    more layers; the CPU rig's emulated pair fails where device 1 does not measure slower."""
    import re
    from dataclasses import replace

    import helpers.unequal
    from helpers.models import StackConfig
    from helpers.runtime.rig import cpu_rig

    rig = replace(cpu_rig(), kind=kind)
    monkeypatch.setattr(helpers.unequal, "measure_speeds",
                        lambda *a, **k: helpers.unequal.DeviceSpeeds(rig.labels, seconds, a[6] if len(a) > 6 else ()))
    small = StackConfig(vocab=64, hidden=32, n_blocks=6, seq_len=8, heads=2)
    check = speed_check(rig, say=lambda line: None, cfg=small)
    assert check.name == SPEEDS and check.status == status and says in check.detail, check.detail
    by_speed, equal = (int(first) for first in re.search(r"by speed (\d+) \| \d+, for equal devices (\d+)",
                                                         check.detail).groups())
    assert by_speed >= equal, "device 1, the slower, holds the layers from the cut on: never more by speed"


def test_every_take_home_script_has_a_doctor_run():
    """The doctor runs each script of scripts/ (its helpers, _*.py, aside) two steps on this rig: a script added
    there and not to SCRIPT_RUNS fails here."""
    from pathlib import Path

    from helpers.doctor.scripts import REPO, SCRIPT_RUNS

    scripts = {p.name for p in Path(REPO, "scripts").glob("*.py") if not p.name.startswith("_")}
    assert {script for script, *_ in SCRIPT_RUNS} == scripts
