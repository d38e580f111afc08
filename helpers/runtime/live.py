"""The memory panel's channel from ranks: each rank of `helpers.runtime.launch.run` tells a watching panel what it
holds while it runs, not only in its result.

Off unless a panel asks. `MemoryMonitor(rig, ranks=True).start()` calls `watch(folder)`; from then on each `run()`
asks `new_run(world)` for a folder of its own (None when nobody watches, and then nothing below happens in the ranks)
and hands it to its ranks. In a rank, `reporting(folder, rank, device)` (around the worker, in `run_rank`) starts a
daemon thread that every `interval_s` rewrites one small JSON file, `rank{N}.json`: the parts of what the worker
`publish`ed (a `MemoryLedger`, or any source with `labels`, `parts(label)` and `peak_parts(label)`), on GPUs PyTorch's
allocated and reserved bytes, and the rank's status. Each report is written aside and renamed over the last one, so a
reader never sees half of it, and a rank never waits for a reader: with nobody reading, the writes are all it costs.
When the worker returns or raises, the rank writes its final report ("finished" or "failed", with its peaks) before
its result goes back to the caller (who then stops the ranks). Ranks that run several jobs in one launch
(`run_trainings`: LoRA then QLoRA) publish once per job: each earlier job's last report stays in the file, under
its own title, so a panel keeps a row per job and rank.

A rank that dies without a final report (killed, crashed in native code) is recognised by its lock: the rank holds an
exclusive `flock` on `rank{N}.lock` for its whole life and the kernel drops it when the process ends, so a reader
tells "stopped" from "running" without trusting process ids (which are reused, and stay taken by a zombie).

Standard library only at import: torch is looked up in the rank only when a report is made.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

DEFAULT_INTERVAL_S = 0.2
RUN_FILE = "run.json"
FINAL = ("finished", "failed")  # statuses a rank writes itself, last


# --- the caller's side: which panel watches, one folder per run ------------------------------------------------------

_lock = threading.Lock()
_root: Path | None = None  # the folder of the panel that watches now (the newest started)
_interval_s = DEFAULT_INTERVAL_S
_runs = 0


def watch(folder: str | Path, interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Ranks started from now on report into `folder`. A panel started later takes over (a notebook cell run again
    after an interrupt starts a new panel without stopping the old one)."""
    global _root, _interval_s
    with _lock:
        _root, _interval_s = Path(folder), interval_s


def unwatch(folder: str | Path) -> None:
    """The panel of `folder` stops watching (a newer panel keeps its own)."""
    global _root
    with _lock:
        if _root == Path(folder):
            _root = None


def new_run(world: int) -> str | None:
    """Called by `run()` before it starts ranks: a fresh folder for their reports, or None when no panel watches."""
    global _runs
    with _lock:
        if _root is None:
            return None
        _runs += 1
        folder, interval_s = _root / f"run{_runs:04d}", _interval_s
    try:
        folder.mkdir()
        _write_json(folder / RUN_FILE, {"world": world, "interval_s": interval_s, "started": time.time()})
    except OSError:  # the panel was stopped meanwhile: run without it
        return None
    return str(folder)


def end_run(folder: str | None) -> None:
    """Called by `run()` once every rank is gone: ranks that never reported are then known to have stopped."""
    if folder is None:
        return
    try:
        meta = json.loads((Path(folder) / RUN_FILE).read_text())
        _write_json(Path(folder) / RUN_FILE, {**meta, "ended": time.time()})
    except (OSError, ValueError):
        pass


def _write_json(path: Path, data: dict) -> None:
    """Write aside, then rename over: a reader sees the old report or the new one, never half of one."""
    aside = path.with_name(path.name + ".part")
    aside.write_text(json.dumps(data))
    os.replace(aside, path)


# --- inside a rank ----------------------------------------------------------------------------------------------------

def _total_parts(source: Any, peak: bool) -> dict[str, int]:
    """A rank is one device: the parts summed over the source's labels."""
    out: dict[str, int] = {}
    for label in source.labels:
        parts = source.peak_parts(label) if peak else source.parts(label)
        for k, v in parts.items():
            out[k] = out.get(k, 0) + int(v)
    return out


class _Reporter:
    """The rank's reporting thread and its files."""

    def __init__(self, folder: Path, rank: int, device: Any):
        meta = json.loads((folder / RUN_FILE).read_text())
        self.folder, self.rank, self.device = folder, rank, device
        self.interval_s = float(meta.get("interval_s", DEFAULT_INTERVAL_S))
        self.path = folder / f"rank{rank}.json"
        self.source: Any = None
        self.title: str | None = None
        self.earlier: list[dict] = []  # the last report of each job this rank ran before the current one
        self._hold_lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="memory-report")

    def _hold_lock(self) -> None:
        """Lock a file under a private name, then give it its public one: a reader that finds `rank{N}.lock` finds it
        held, and may take it only once this process is gone (the kernel drops the lock with the process)."""
        import fcntl

        private = self.folder / f".rank{self.rank}.lock.{os.getpid()}"
        self._lock_file = open(private, "w")  # noqa: SIM115 - held for the rank's whole life, on purpose
        fcntl.flock(self._lock_file, fcntl.LOCK_EX)
        os.replace(private, self.folder / f"rank{self.rank}.lock")

    def _cuda(self) -> dict | None:
        torch = sys.modules.get("torch")
        if torch is None or getattr(self.device, "type", None) != "cuda" or not torch.cuda.is_available():
            return None
        return {"index": self.device.index, "allocated": torch.cuda.memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device),
                "max_allocated": torch.cuda.max_memory_allocated(self.device)}

    def publish(self, source: Any, title: str | None) -> None:
        """A new job's source: the current one's last report is kept (finished) before it is replaced, and CUDA's peak
        starts again, so a later job's row never shows an earlier job's peak."""
        if self.source is not None and source is not self.source:
            last = self.snapshot("finished")
            del last["earlier"]
            self.earlier.append(last)
            if self._cuda() is not None:
                sys.modules["torch"].cuda.reset_peak_memory_stats(self.device)
        self.source, self.title = source, title

    def snapshot(self, status: str) -> dict:
        report: dict[str, Any] = {"rank": self.rank, "status": status, "title": self.title, "parts": {},
                                  "peak_parts": {}, "earlier": list(self.earlier)}
        if self.source is not None:
            torch = sys.modules.get("torch")
            with torch.no_grad() if torch is not None else nullcontext():  # reading a DTensor shard records nothing
                report["parts"] = _total_parts(self.source, peak=False)
                report["peak_parts"] = _total_parts(self.source, peak=True)
        report["cuda"] = self._cuda()
        return report

    def write(self, status: str) -> None:
        """One report; a failure (the panel stopped and its folder is gone, a dictionary the worker was resizing
        while it was read) skips it: the rank is never disturbed by its reporting."""
        try:
            _write_json(self.path, self.snapshot(status))
        except Exception:  # noqa: BLE001 - see the docstring
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write("running")

    def start(self) -> None:
        self.write("running")
        self._thread.start()

    def finish(self, status: str) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 1.0)
        self.write(status)


_reporter: _Reporter | None = None


@contextmanager
def reporting(folder: str | None, rank: int, device: Any = None) -> Iterator[None]:
    """Around a rank's worker: report every `interval_s` while it runs, and its final state before its result goes
    back. With no folder (no panel watches) it does nothing at all."""
    global _reporter
    if folder is None:
        yield
        return
    try:
        _reporter = _Reporter(Path(folder), rank, device)
        _reporter.start()
    except Exception:  # noqa: BLE001 - e.g. the panel stopped before this rank started: run without reporting
        _reporter = None
    status = "failed"
    try:
        yield
        status = "finished"
    finally:
        if _reporter is not None:
            _reporter.finish(status)
            _reporter = None


def publish(source: Any, title: str | None = None) -> None:
    """Inside a rank: from now on, report what `source` holds (a `MemoryLedger`, or anything with `labels`,
    `parts(label)` and `peak_parts(label)`), under `title` (e.g. the strategy's name); a later call starts the
    rank's next job (its own row), the earlier job's report kept. Does nothing when no panel watches, so workers call
    it unconditionally."""
    if _reporter is not None:
        _reporter.publish(source, title)


# --- the reader (the panel) -------------------------------------------------------------------------------------------

@dataclass
class RankReport:
    """The latest word from one rank of one run. `status`: starting (no report yet), running, finished, failed, or
    stopped (the rank ended without a final report: killed, crashed, or stopped with the others after a failure).
    `job`: which of the jobs the rank ran in this run (0, 1, ... in their order: one launch of several jobs)."""

    run: int
    rank: int
    world: int
    status: str
    title: str | None = None
    parts: dict[str, int] = field(default_factory=dict)
    peak_parts: dict[str, int] = field(default_factory=dict)
    cuda: dict | None = None
    job: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        """Rows in run order, then job, then rank."""
        return self.run, self.job, self.rank


def _lock_held(path: Path) -> bool:
    """True while the rank that locked `path` lives."""
    import fcntl

    try:
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


def _read_rank(folder: Path, run: int, rank: int, world: int, ended: bool) -> list[RankReport]:
    """The rank's reports: one per job it ran (the earlier ones finished), none when unreadable right now."""
    path, lock = folder / f"rank{rank}.json", folder / f"rank{rank}.lock"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:  # not reporting yet; once the run is over, never will
        return [RankReport(run, rank, world, "stopped" if ended else "starting")]
    except (OSError, ValueError):
        return []  # unreadable now: keep the last report
    reports = [RankReport(run, rank, world, d["status"], d.get("title"), d.get("parts") or {},
                          d.get("peak_parts") or {}, d.get("cuda"), job)
               for job, d in enumerate([*data.get("earlier", []), data])]
    if reports[-1].status == "running" and not _lock_held(lock):
        reports[-1].status = "stopped"
    return reports


def read_reports(folder: str | Path) -> list[RankReport]:
    """Every rank of every run reported into `folder`, in run and rank order. A report that cannot be read right now
    is left out (the caller keeps the last one it saw)."""
    out = []
    for run_dir in sorted(Path(folder).glob("run*")):
        try:
            meta = json.loads((run_dir / RUN_FILE).read_text())
            run = int(run_dir.name[3:])
        except (OSError, ValueError):
            continue
        for rank in range(int(meta["world"])):
            out += _read_rank(run_dir, run, rank, int(meta["world"]), "ended" in meta)
    return sorted(out, key=lambda r: r.key)
