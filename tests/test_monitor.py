import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.sizing.ledger import ledger_for
from helpers.monitor import MemoryMonitor, frontend_attached
from helpers.runtime import live
from helpers.runtime.launch import WorkerError, run
from helpers.runtime.rig import cpu_rig
from tests import workers as bad

REPO = Path(__file__).resolve().parent.parent


def test_a_frontend_is_a_jupyter_kernel_unless_static_drawing_is_asked(monkeypatch):
    """What decides between a live panel (a thread redrawing) and printed snapshots (nbval, scripts, this suite)."""
    class ZMQInteractiveShell:  # the shell class of a Jupyter kernel, by name as frontend_attached reads it
        pass

    class TerminalInteractiveShell:  # plain IPython in a terminal: nothing displays widgets
        pass

    shell = ZMQInteractiveShell()
    monkeypatch.setitem(sys.modules, "IPython", type(sys)("IPython"))
    sys.modules["IPython"].get_ipython = lambda: shell
    monkeypatch.delenv("LAB_STATIC_WIDGETS", raising=False)
    assert frontend_attached()
    for forced in ("1", "true", "yes"):
        monkeypatch.setenv("LAB_STATIC_WIDGETS", forced)
        assert not frontend_attached()
    monkeypatch.delenv("LAB_STATIC_WIDGETS")
    shell = TerminalInteractiveShell()
    assert not frontend_attached()
    monkeypatch.delitem(sys.modules, "IPython")
    assert not frontend_attached()


def test_static_snapshot_draws_the_ledger(capsys):
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    ledger = ledger_for([a, b], ["cpu:0", "cpu:1"])
    monitor = MemoryMonitor(cpu_rig(budget_gib=1.0), ledger).start()
    x = torch.randn(8, 64, requires_grad=True)
    with ledger.track_activations("cpu:1"):
        b(a(x)).sum().backward()
    monitor.stop()
    out = capsys.readouterr().out
    assert "cpu:0" in out and "cpu:1" in out and "/ 1.00 GiB" in out and "P params" in out
    r0, r1 = monitor.readings()
    assert r0.label == "cpu:0" and r0.capacity == 2**30
    assert r0.parts == r1.parts == {"params": (64 * 64 + 64) * 4, "grads": (64 * 64 + 64) * 4, "optimizer": 0,
                                    "activations": 0}  # activations freed after backward
    assert monitor.peak[1] > r1.counted  # activations counted at their peak
    assert monitor.scale == max(monitor.peak)  # bars drawn to the largest total, not to the 1 GiB capacity


def test_cpu_monitor_needs_a_ledger():
    with pytest.raises(ValueError, match="pass ledger="):
        MemoryMonitor(cpu_rig())


def test_gpu_readings_tolerate_nvml_without_a_reading(monkeypatch):
    """NVML may answer 'N/A' for a GPU (nvitop returns the string): the panel shows N/A instead of failing."""
    import nvitop

    from helpers.monitor import Reading, nvml_used

    class NoReading:  # what nvitop gives for a GPU whose memory NVML cannot read
        def __init__(self, index):
            self.index = index

        def memory_used(self):
            return "N/A" if self.index == 1 else 123

    monkeypatch.setattr(nvitop, "CudaDevice", NoReading)
    assert nvml_used([0, 1]) == [123, None]
    r = Reading("cuda:1", {"params": 10}, 100, allocated=10, reserved=20, nvml=None)
    assert "nvidia-smi N/A" in r.text() and r.total == 20


# --- the rank channel (helpers.runtime.live) and the panel's rank rows --------------------------------------------

class _Counter:
    """A memory source whose one part the test sets by hand."""

    labels = ["device"]

    def __init__(self):
        self.now = self.most = 0

    def parts(self, label):
        return {"activations": self.now}

    def peak_parts(self, label):
        return {"activations": self.most}


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_no_panel_no_reports():
    """Without a panel, run() gets no folder and a rank starts no reporting thread: the bench's ranks pay nothing."""
    assert live.new_run(2) is None
    before = {t.name for t in threading.enumerate()}
    with live.reporting(None, 0):
        live.publish(_Counter())  # a worker publishes unconditionally: a no-op here
        assert {t.name for t in threading.enumerate()} == before


def test_reports_follow_the_source_and_end_with_its_peak(tmp_path):
    """In-process: the reporter rewrites its file as the source changes; the final report carries the peak; a
    panel whose folder is removed mid-run disturbs nothing."""
    live.watch(tmp_path, interval_s=0.02)
    try:
        folder = live.new_run(1)
    finally:
        live.unwatch(tmp_path)
    assert live.new_run(1) is None  # nobody watches any more
    source = _Counter()
    with live.reporting(folder, 0):
        _wait_for(lambda: [r.status for r in live.read_reports(tmp_path)] == ["running"])
        live.publish(source, title="counting")
        for n in (100, 300):
            source.now = source.most = n
            _wait_for(lambda: live.read_reports(tmp_path)[0].parts == {"activations": n})
        source.now = 0
    (report,) = live.read_reports(tmp_path)
    assert (report.status, report.title, report.parts, report.peak_parts) == \
        ("finished", "counting", {"activations": 0}, {"activations": 300})
    with pytest.raises(RuntimeError):
        with live.reporting(live.new_run(1) or _new_run_in(tmp_path / "gone"), 1):
            shutil.rmtree(tmp_path / "gone")  # the panel stopped: the rank goes on, and its own error is its own
            raise RuntimeError("the worker's error")


def test_each_job_of_one_launch_keeps_its_own_report(tmp_path):
    """Ranks that run several jobs in one launch (finetune_each: LoRA, then QLoRA) publish once per job: the first
    job's last report stays beside the second's, so a panel keeps a row per job (the second used to replace it)."""
    folder = _new_run_in(tmp_path / "panel")
    lora, qlora = _Counter(), _Counter()
    with live.reporting(folder, 0):
        live.publish(lora, title="fsdp2 lora")
        lora.now = lora.most = 100
        live.publish(qlora, title="fsdp2 qlora")
        qlora.now = qlora.most = 40
    reports = live.read_reports(tmp_path / "panel")
    assert [(r.job, r.title, r.status, r.peak_parts) for r in reports] == \
        [(0, "fsdp2 lora", "finished", {"activations": 100}), (1, "fsdp2 qlora", "finished", {"activations": 40})]
    assert len({r.key for r in reports}) == 2


def _new_run_in(root):
    root.mkdir()
    live.watch(root, interval_s=0.02)
    try:
        return live.new_run(1)
    finally:
        live.unwatch(root)


def test_a_killed_reporter_reads_as_stopped(tmp_path):
    """A rank killed mid-run leaves a 'running' report behind; its lock, dropped by the kernel, says it stopped.
    (The channel is standard library only, so a plain interpreter stands in for the rank.)"""
    folder = _new_run_in(tmp_path / "panel")
    code = ("import sys, time; from helpers.runtime import live\n"
            "with live.reporting(sys.argv[1], 0):\n    time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, folder], env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        _wait_for(lambda: [r.status for r in live.read_reports(tmp_path / "panel")] == ["running"])
    finally:
        child.kill()
        child.wait()
    assert [r.status for r in live.read_reports(tmp_path / "panel")] == ["stopped"]


def _poll_while(thread, monitor, shown: Path):
    """Every reading the panel makes while `thread` runs: (label, status, activations) per row. The largest
    activations shown for a running rank go to `shown/rank{N}`, where the rank waits for them before growing again."""
    seen = []
    while thread.is_alive():
        readings = monitor.readings()
        seen += [(r.label, r.status, r.parts.get("activations")) for r in readings]
        for r in readings:
            if r.status == "running" and r.parts.get("activations"):
                rank = r.label.rsplit(":", 1)[1]
                (shown / "next").write_text(str(r.parts["activations"]))
                os.replace(shown / "next", shown / f"rank{rank}")  # whole, never half-written
        time.sleep(0.05)
    return seen


def test_panel_sees_ranks_ledgers_grow_while_they_run(capsys, tmp_path):
    """Two ranks publish ledgers whose activations grow step by step: the panel, reading all the while, sees each
    rank grow while it runs, the ranks finish and return undisturbed, and each row ends at the rank's peak. A rank
    grows only once the panel has shown its size (no fixed pause that two busy cores may outrun)."""
    rig = cpu_rig()
    monitor = MemoryMonitor(rig, ranks=True).start()
    out, steps = {}, 4
    job = threading.Thread(target=lambda: out.update(
        r=run(bad.growing_ledger, steps, 0.0, None, str(tmp_path), rig=rig, timeout=120)))
    job.start()
    seen = _poll_while(job, monitor, tmp_path)
    job.join()
    monitor.stop()
    assert out["r"][0] == out["r"][1] > 0
    for label in ("growing · cpu:0", "growing · cpu:1"):
        running = [a for lb, status, a in seen if lb == label and status == "running" and a]
        assert len(set(running)) == steps and running == sorted(running), running  # every size, growing, mid-run
        assert running[-1] == out["r"][0]
    final = monitor.readings()
    assert [(r.label, r.status) for r in final] == [("growing · cpu:0", "finished"), ("growing · cpu:1", "finished")]
    assert all(r.parts["activations"] == out["r"][0] for r in final)  # the row keeps the rank's peak
    printed = capsys.readouterr().out
    assert "nothing to draw yet" in printed and "finished, at its peak" in printed
    assert not any(t.name == "memory-monitor" for t in threading.enumerate())


@pytest.mark.full
def test_a_rank_that_dies_leaves_the_panel_usable(capsys):
    rig = cpu_rig()
    monitor = MemoryMonitor(rig, ranks=True).start()
    with pytest.raises(WorkerError, match="rank 1 exited with code 3"):
        run(bad.growing_ledger, 20, 0.2, die_on_rank=1, rig=rig, timeout=60)
    statuses = {r.label: r.status for r in monitor.readings()}
    assert statuses["growing · cpu:1"] == "stopped"
    assert "stopped" in monitor._html_bars()  # what the live panel's thread draws next
    monitor.stop()
    assert "growing · cpu:1" in capsys.readouterr().out
    assert live.new_run(2) is None  # the stopped panel no longer watches


def test_split_memory_rows_in_the_panel():
    """Any source with labels, parts and peak_parts draws: parts the panel does not know (a total) are left out."""
    class Split:
        labels = ["cpu:0", "cpu:1"]

        def parts(self, label):
            return {"params": 10, "kv_cache": 5 if label == "cpu:1" else 0, "total": 99}

        def peak_parts(self, label):
            return {"params": 10, "kv_cache": 7}

    monitor = MemoryMonitor(cpu_rig(), Split())
    r0, r1 = monitor.readings()
    assert r1.parts == {"params": 10, "kv_cache": 5} and monitor.peak == [17, 17]
    assert "K kv_cache" in monitor.text() and "(peak 17 B: kv_cache 7 B)" in monitor.text()


# --- where memory is the lesson, the notebook shows the panel ------------------------------------------------------

MEMORY_LESSONS = ("00", "03", "06", "07", "09", "12")
NOTEBOOKS = REPO / "notebooks"


def _starts_the_panel(path):
    code = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    starts = any(re.search(r"MemoryMonitor\((.|\n)*?\)\s*\.start\(\)", c) for c in code)
    return starts and any(".stop()" in c for c in code)


def test_notebooks_where_memory_is_the_lesson_start_the_panel():
    lessons = [p for n in MEMORY_LESSONS for p in NOTEBOOKS.glob(f"{n}_*.ipynb")]
    assert len(lessons) == len(MEMORY_LESSONS)
    missing = [p.name for p in lessons if not _starts_the_panel(p)]
    assert not missing, f"memory is the lesson, but no `MemoryMonitor(...).start()` ... `.stop()`: {missing}"


def test_readme_names_the_notebooks_with_the_panel():
    """README says which notebooks show the live memory panel; it must be exactly those that start it."""
    said = re.search(r"live memory panel[^|]{0,600}?in notebooks ((?:\d\d, )*\d\d(?:,? and \d\d)?)",
                     (REPO / "README.md").read_text())
    assert said, "README: say which notebooks show the live memory panel ('... in notebooks 00, 03, ...')"
    claimed = set(re.findall(r"\d\d", said.group(1)))
    shown = {p.name[:2] for p in NOTEBOOKS.glob("*.ipynb") if _starts_the_panel(p)}
    assert claimed == shown, f"README names {sorted(claimed)}, the notebooks starting the panel are {sorted(shown)}"
