"""A live per-device memory panel for notebooks: what each device holds, by part, while the cell runs.

A row per device, from two kinds of source:
- in this process, a `MemoryLedger` (a row per label: per pipeline stage, or per device) or any source with `labels`,
  `parts(label)` and `peak_parts(label)` (`LayerSplit.memory(rig.labels)`: weights and KV cache per device while a
  model generates): the parts the course counts, parameters, gradients, optimizer state, activations alive now, KV
  cache — the only honest per-device numbers on the CPU rig, and the ones that explain a GPU's memory;
- with `ranks=True`, every rank that `helpers.runtime.launch.run` starts while the panel is on: a row per rank (and
  per job, when the ranks run several in one launch), labelled with the job's title (the strategy, where the worker
  `publish`es one) and the rig's label for that rank, fed by the rank itself while it runs
  (`helpers.runtime.live`). A finished rank's row keeps its peak; a rank that dies says so, and the panel goes on.
On GPUs each row also shows PyTorch's allocated and reserved bytes (of the process that holds them: this one, or the
rank; the allocator's cache is the difference) and NVML's used memory (what nvidia-smi shows: every process, the CUDA
context and the cache). GPUs are read in CUDA order (`nvitop.CudaDevice`, which honours CUDA_VISIBLE_DEVICES), and a
reading NVML cannot give ("N/A") is shown as such, never an error.

Bars are drawn to a common scale: the largest total seen so far, so a change is visible even when the model uses a
small share of the card; the capacity stays in the text. With no frontend attached (nbval, a script, or
LAB_STATIC_WIDGETS=1) it prints a snapshot at `start()` and another at `stop()` instead of starting a thread.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from helpers.units import fmt_bytes
from helpers.runtime import live
from helpers.runtime.rig import Rig

STATIC_ENV = "LAB_STATIC_WIDGETS"
PARTS = ("params", "grads", "optimizer", "activations", "kv_cache")
PART_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#8172B3", "activations": "#55A868",
               "kv_cache": "#C44E52"}
BAR_CHARS = {"params": "P", "grads": "G", "optimizer": "O", "activations": "A", "kv_cache": "K"}
RANK_STATUS = {
    "starting": "starting",
    "running": "running",
    "finished": "finished, at its peak",
    "failed": "failed, at its peak",
    "stopped": "stopped without a final report (killed, crashed, or stopped after another rank failed); last report",
}


class MemorySource(Protocol):
    """What the panel draws in this process: a `MemoryLedger`, or anything that says what each label holds."""

    labels: Sequence[str]

    def parts(self, label: str) -> dict[str, int]: ...  # bytes by part, now

    def peak_parts(self, label: str) -> dict[str, int]: ...  # bytes by part at the peak so far (an upper bound)


def frontend_attached() -> bool:
    """True inside a live Jupyter kernel that a person is looking at; False under nbval, scripts or when forced."""
    if os.environ.get(STATIC_ENV, "").strip() in {"1", "true", "yes"}:
        return False
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def nvml_used(cuda_indices: list[int]) -> list:
    """NVML's used bytes per GPU, in CUDA order; None where NVML has no reading. Only call where CUDA exists."""
    logging.getLogger("nvitop").setLevel(logging.CRITICAL)
    try:
        from nvitop import CudaDevice

        devices = [CudaDevice(i) for i in cuda_indices]
    except Exception:  # noqa: BLE001 - no NVML (e.g. WSL without the library): show N/A, do not fail the cell
        return [None] * len(cuda_indices)
    out = []
    for d in devices:
        value = d.memory_used()
        out.append(int(value) if isinstance(value, (int, float)) else None)  # nvitop returns 'N/A' when unknown
    return out


def _ordered(parts: dict[str, int]) -> dict[str, int]:
    """The parts the panel knows, in its order (a source's other entries, such as a total, are left out)."""
    return {k: int(parts[k]) for k in PARTS if k in parts}


@dataclass
class Reading:
    """One device (or rank) at one moment."""

    label: str
    parts: dict[str, int]  # from the source; empty without one
    capacity: int
    allocated: int | None = None  # torch.cuda.memory_allocated (of the process that holds the memory)
    reserved: int | None = None  # torch.cuda.memory_reserved (that process, allocator cache included)
    nvml: int | None = None  # NVML used (all processes, CUDA context included)
    peak_parts: dict[str, int] = field(default_factory=dict)  # the parts at the peak, where the source knows them
    status: str | None = None  # ranks only: see RANK_STATUS

    @property
    def counted(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        """The largest of what is known: the source's parts, PyTorch's reservation, NVML's reading."""
        return max(self.counted, self.reserved or 0, self.nvml or 0)

    def text(self) -> str:
        bits = [f"{k} {fmt_bytes(v)}" for k, v in self.parts.items()] or ["nothing published yet"]
        if self.allocated is not None:
            bits.append(f"allocated {fmt_bytes(self.allocated)}, reserved {fmt_bytes(self.reserved or 0)}, "
                        f"nvidia-smi {fmt_bytes(self.nvml) if self.nvml is not None else 'N/A'}")
        status = f"{RANK_STATUS.get(self.status, self.status)}: " if self.status else ""
        return f"{status}{', '.join(bits)} / {fmt_bytes(self.capacity)}"

    def caption(self, peak: int) -> str:
        """`text()` and the row's peak, with the parts that were larger at the peak than now (e.g. the activations of
        the last forward)."""
        grown = [f"{k} {fmt_bytes(v)}" for k, v in self.peak_parts.items() if v > self.parts.get(k, 0)]
        return f"{self.text()} (peak {fmt_bytes(peak)}{': ' + ', '.join(grown) if grown else ''})"


class MemoryMonitor:
    """Per-device (and per-rank) memory by part, refreshed from a background thread until `stop()`.

    `ledger`: a `MemoryLedger` or another `MemorySource` in this process; `ranks=True`: also a row per rank of every
    `helpers.runtime.launch.run` started between `start()` and `stop()`. On the CPU rig one of the two is needed."""

    def __init__(self, rig: Rig, ledger: MemorySource | None = None, interval_s: float = 0.2, ranks: bool = False):
        if ledger is None and rig.is_cpu and not ranks:
            raise ValueError("on the CPU rig the monitor draws the memory accounting: pass ledger=MemoryLedger(...) "
                             "(or another source, such as LayerSplit.memory(rig.labels)), or ranks=True to watch the "
                             "ranks that helpers.runtime.launch.run starts")
        self.rig, self.source, self.interval_s, self.ranks = rig, ledger, interval_s, ranks
        self.labels = list(ledger.labels) if ledger is not None else [] if ranks else list(rig.labels)
        self.capacity = [rig.capacity_bytes[min(i, len(rig.capacity_bytes) - 1)] for i in range(len(self.labels))]
        self.cuda_index = [rig.devices[min(i, len(rig.devices) - 1)].index if rig.is_cuda else None
                           for i in range(len(self.labels))]
        self.peak: list[int] = []  # per row of the last readings, in their order
        self.scale = 1
        self._peaks: dict = {}  # row key -> the most seen
        self._reports: dict[tuple[int, int, int], live.RankReport] = {}  # the last word of every rank's job
        self._folder: str | None = None
        self._cleanup = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._html = None

    # --- readings -----------------------------------------------------------------------------------------------

    def _local(self) -> list[tuple[object, Reading, int, int | None]]:
        out = []
        for i, label in enumerate(self.labels):
            parts = _ordered(self.source.parts(label)) if self.source is not None else {}
            peak = _ordered(self.source.peak_parts(label)) if self.source is not None else {}
            r = Reading(label, parts, self.capacity[i], peak_parts=peak)
            idx = self.cuda_index[i]
            if idx is not None:
                r.allocated = torch.cuda.memory_allocated(idx)
                r.reserved = torch.cuda.memory_reserved(idx)
            out.append((("local", label), r, sum(peak.values()), idx))
        return out

    def _rank_readings(self) -> list[tuple[object, Reading, int, int | None]]:
        if self._folder is not None:
            for report in live.read_reports(self._folder):
                self._reports[report.key] = report
        out = []
        caps, labels = self.rig.capacity_bytes, self.rig.labels
        for key in sorted(self._reports):
            rep = self._reports[key]
            where = labels[rep.rank] if rep.rank < len(labels) else f"rank {rep.rank}"
            parts, peak = _ordered(rep.parts), _ordered(rep.peak_parts)
            if rep.status in live.FINAL:  # the rank has gone: its row keeps the most it held
                parts = peak or parts
            r = Reading(f"{rep.title or f'run {rep.run}'} · {where}", parts, caps[min(rep.rank, len(caps) - 1)],
                        peak_parts=peak, status=rep.status)
            known = sum(peak.values())
            if rep.cuda:
                r.allocated, r.reserved = rep.cuda["allocated"], rep.cuda["reserved"]
                known = max(known, rep.cuda["max_allocated"])
            out.append((("rank", key), r, known, rep.cuda["index"] if rep.cuda else None))
        return out

    def readings(self) -> list[Reading]:
        """Every row now; also updates the peaks and the drawing scale."""
        with self._lock:
            rows = self._local() + (self._rank_readings() if self.ranks else [])
            gpus = sorted({gpu for *_, gpu in rows if gpu is not None}) if self.rig.is_cuda else []
            used = dict(zip(gpus, nvml_used(gpus))) if gpus else {}  # one NVML query for every row's GPU
            for key, r, known, gpu in rows:  # the source sees every peak, the panel only its own moments
                r.nvml = used.get(gpu)
                self._peaks[key] = max(self._peaks.get(key, 0), r.total, known)
            self.peak = [self._peaks[key] for key, *_ in rows]
            self.scale = max([self.scale, *self.peak])
            return [r for _, r, *_ in rows]

    # --- drawing ------------------------------------------------------------------------------------------------

    def text(self) -> str:
        """A printable snapshot: a bar per row, one letter per part (P params, G grads, O optimizer, A activations,
        K KV cache), drawn to the common scale."""
        width = 40
        readings = self.readings()
        name = max([16, *(len(r.label) for r in readings)])
        lines = []
        for r, peak in zip(readings, self.peak):
            bar = "".join(BAR_CHARS[k] * int(round(width * v / self.scale)) for k, v in r.parts.items())
            lines.append(f"{r.label:>{name}} [{bar[:width]:<{width}}] {r.caption(peak)}")
        if not readings:
            return "memory panel: nothing to draw yet (a row per rank of each run started while it is on)"
        seen = [k for k in PARTS if any(k in r.parts for r in readings)] or list(PARTS[:4])
        lines.append(f"{'':>{name}}  scale: the full bar is {fmt_bytes(self.scale)} (the largest total so far); "
                     + ", ".join(f"{BAR_CHARS[k]} {k}" for k in seen))
        return "\n".join(lines)

    def _html_bars(self) -> str:
        readings = self.readings()
        rows = []
        for r, peak in zip(readings, self.peak):
            segments = "".join(
                f'<div title="{k} {fmt_bytes(v)}" style="width:{100 * v / self.scale:.2f}%;'
                f'background:{PART_COLORS[k]};height:14px"></div>' for k, v in r.parts.items() if v)
            rows.append(f'<div class="lab-memory-row" style="display:flex;align-items:center;gap:8px;font-size:12px">'
                        f'<div class="lab-memory-label" style="flex:none;width:150px;text-align:right;'
                        f'white-space:nowrap">{r.label}</div>'
                        f'<div style="display:flex;flex:none;width:360px;background:#eee">{segments}</div>'
                        f'<div style="flex:1">{r.caption(peak)}</div></div>')
        if not readings and self.ranks:
            rows.append('<div style="font-size:12px">waiting for the ranks: a row per rank of each run started '
                        'while the panel is on</div>')
        seen = [k for k in PARTS if any(k in r.parts for r in readings)] or list(PARTS[:4])
        legend = " ".join(f'<span style="color:{PART_COLORS[k]}">&#9632; {k}</span>' for k in seen)
        rows.append(f'<div style="font-size:11px">{legend} &middot; full bar = {fmt_bytes(self.scale)}</div>')
        return f'<div class="lab-memory-panel">{"".join(rows)}</div>'  # the classes: tests/test_browser.py

    # --- life -----------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._html.value = self._html_bars()
            except Exception as exc:  # noqa: BLE001 - a panel must never break the cell it watches
                self._html.value = f"memory panel stopped refreshing: {type(exc).__name__}: {exc}"
                return

    def _watch_ranks(self) -> None:
        """Ranks started from now on report into a folder of this panel's (removed at stop, or when the panel is
        garbage-collected without a stop: an interrupted cell)."""
        self._folder = tempfile.mkdtemp(prefix="lab-memory-")
        live.watch(self._folder, self.interval_s)
        self._cleanup = weakref.finalize(self, _forget, self._folder)

    def start(self) -> "MemoryMonitor":
        """Show the panel: live (a background thread) with a frontend, otherwise a printed snapshot."""
        if self.ranks:
            self._watch_ranks()
        if not frontend_attached():
            print(self.text())
            return self
        import ipywidgets as w
        from IPython.display import display

        self._html = w.HTML(self._html_bars())
        display(self._html)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="memory-monitor")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop refreshing; the panel keeps its last values (static mode prints the final state: per rank, its
        peak)."""
        if self._thread is None:
            print(self.text())
        else:
            self._stop.set()
            self._thread.join()
            self._html.value = self._html_bars()
            self._thread = None
        if self._cleanup is not None:
            self._cleanup()  # stop watching, remove the reports (their last word stays in this panel)
            self._cleanup, self._folder = None, None


def _forget(folder: str) -> None:
    live.unwatch(folder)
    shutil.rmtree(folder, ignore_errors=True)
