"""A live per-device memory panel for notebooks: what each device holds, by part, while the cell runs.

Per device (a row per ledger label: per pipeline stage, or per device):
- the parts the `MemoryLedger` counts: parameters, gradients, optimizer state, activations alive now — the only
  honest per-device numbers on the CPU rig, and the ones that explain a GPU's memory;
- on GPUs, beside them: PyTorch's allocated and reserved bytes (this process; the allocator's cache is the
  difference) and NVML's used memory (what nvidia-smi shows: every process, the CUDA context and the cache).
  GPUs are read in CUDA order (`nvitop.CudaDevice`, which honours CUDA_VISIBLE_DEVICES), and a reading NVML cannot
  give ("N/A") is shown as such, never an error.

Bars are drawn to a common scale: the largest total seen so far, so a change is visible even when the model uses a
small share of the card; the capacity stays in the text. With no frontend attached (nbval, a script, or
LAB_STATIC_WIDGETS=1) it prints a snapshot instead of starting a thread.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

import torch

from helpers.memory import MemoryLedger, fmt_bytes
from helpers.runtime.rig import Rig

STATIC_ENV = "LAB_STATIC_WIDGETS"
PARTS = ("params", "grads", "optimizer", "activations")
PART_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#8172B3", "activations": "#55A868"}
BAR_CHARS = {"params": "P", "grads": "G", "optimizer": "O", "activations": "A"}


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


@dataclass
class Reading:
    """One device at one moment."""

    label: str
    parts: dict[str, int]  # from the ledger; empty without one
    capacity: int
    allocated: int | None = None  # torch.cuda.memory_allocated (this process)
    reserved: int | None = None  # torch.cuda.memory_reserved (this process, allocator cache included)
    nvml: int | None = None  # NVML used (all processes, CUDA context included)

    @property
    def counted(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        """The largest of what is known: the ledger's parts, PyTorch's reservation, NVML's reading."""
        return max(self.counted, self.reserved or 0, self.nvml or 0)

    def text(self) -> str:
        bits = [f"{k} {fmt_bytes(v)}" for k, v in self.parts.items()]
        if self.allocated is not None:
            bits.append(f"allocated {fmt_bytes(self.allocated)}, reserved {fmt_bytes(self.reserved or 0)}, "
                        f"nvidia-smi {fmt_bytes(self.nvml) if self.nvml is not None else 'N/A'}")
        return f"{', '.join(bits)} / {fmt_bytes(self.capacity)}"


class MemoryMonitor:
    """Per-device memory by part, refreshed from a background thread until `stop()`."""

    def __init__(self, rig: Rig, ledger: MemoryLedger | None = None, interval_s: float = 0.2):
        if ledger is None and rig.is_cpu:
            raise ValueError("on the CPU rig the monitor draws the memory accounting: pass ledger=MemoryLedger(...)")
        self.rig, self.ledger, self.interval_s = rig, ledger, interval_s
        self.labels = list(ledger.labels) if ledger is not None else list(rig.labels)
        self.capacity = [rig.capacity_bytes[min(i, len(rig.capacity_bytes) - 1)] for i in range(len(self.labels))]
        self.cuda_index = [rig.devices[min(i, len(rig.devices) - 1)].index if rig.is_cuda else None
                           for i in range(len(self.labels))]
        self.peak = [0] * len(self.labels)
        self.scale = 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._html = None

    def readings(self) -> list[Reading]:
        """Every device now; also updates the peaks and the drawing scale."""
        out = []
        nvml = nvml_used(sorted({i for i in self.cuda_index if i is not None})) if self.rig.is_cuda else []
        nvml_by_index = dict(zip(sorted({i for i in self.cuda_index if i is not None}), nvml))
        for i, label in enumerate(self.labels):
            parts = self.ledger.current(label).as_dict() if self.ledger is not None else {}
            parts = {k: parts[k] for k in PARTS if k in parts}
            r = Reading(label, parts, self.capacity[i])
            idx = self.cuda_index[i]
            if idx is not None:
                r.allocated = torch.cuda.memory_allocated(idx)
                r.reserved = torch.cuda.memory_reserved(idx)
                r.nvml = nvml_by_index.get(idx)
            out.append(r)
        known = [self.ledger.device(lb).total for lb in self.labels] if self.ledger is not None else [0] * len(out)
        self.peak = [max(p, r.total, k) for p, r, k in zip(self.peak, out, known)]  # the ledger sees every peak
        self.scale = max(self.scale, *self.peak)
        return out

    def text(self) -> str:
        """A printable snapshot: a bar per device, one letter per part (P params, G grads, O optimizer,
        A activations), drawn to the common scale."""
        lines = []
        width = 40
        readings = self.readings()
        for r, peak in zip(readings, self.peak):
            bar = "".join(BAR_CHARS[k] * int(round(width * v / self.scale)) for k, v in r.parts.items())
            lines.append(f"{r.label:>16} [{bar[:width]:<{width}}] {r.text()} (peak {fmt_bytes(peak)})")
        lines.append(f"{'':>16}  scale: the full bar is {fmt_bytes(self.scale)} (the largest total so far); "
                     "P params, G grads, O optimizer, A activations")
        return "\n".join(lines)

    def _html_bars(self) -> str:
        rows = []
        for r, peak in zip(self.readings(), self.peak):
            segments = "".join(
                f'<div title="{k} {fmt_bytes(v)}" style="width:{100 * v / self.scale:.2f}%;'
                f'background:{PART_COLORS[k]};height:14px"></div>' for k, v in r.parts.items() if v)
            rows.append(f'<div style="display:flex;align-items:center;gap:8px;font-size:12px">'
                        f'<div style="width:120px;text-align:right">{r.label}</div>'
                        f'<div style="display:flex;width:360px;background:#eee">{segments}</div>'
                        f'<div>{r.text()} (peak {fmt_bytes(peak)})</div></div>')
        legend = " ".join(f'<span style="color:{c}">&#9632; {k}</span>' for k, c in PART_COLORS.items())
        rows.append(f'<div style="font-size:11px">{legend} &middot; full bar = {fmt_bytes(self.scale)}</div>')
        return "".join(rows)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._html.value = self._html_bars()

    def start(self) -> "MemoryMonitor":
        """Show the panel: live (a background thread) with a frontend, otherwise a printed snapshot."""
        if not frontend_attached():
            print(self.text())
            return self
        import ipywidgets as w
        from IPython.display import display

        self._html = w.HTML(self._html_bars())
        display(self._html)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="memory-monitor")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop refreshing; the panel keeps its last values (static mode prints the final state)."""
        if self._thread is None:
            print(self.text())
            return
        self._stop.set()
        self._thread.join()
        self._html.value = self._html_bars()
        self._thread = None
