"""A live per-device memory panel for notebooks: one bar per device, used / capacity.

On GPUs the numbers come from NVML through nvitop (what nvidia-smi shows, other processes included); on the CPU rig
from a `MemoryLedger` (the only honest per-device number there). With no frontend attached (nbval, a script, or
LAB_STATIC_WIDGETS=1) it prints one static snapshot instead of starting a thread.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable

from helpers.memory import MemoryLedger, fmt_bytes
from helpers.runtime.rig import Rig

STATIC_ENV = "LAB_STATIC_WIDGETS"
UsageFn = Callable[[], list[int]]


def nvml_usage(indices: list[int]) -> UsageFn:
    """Used bytes per GPU from NVML via nvitop. Only call where CUDA is available (nvitop logs loudly otherwise)."""
    logging.getLogger("nvitop").setLevel(logging.CRITICAL)
    from nvitop import Device

    devices = [Device(i) for i in indices]
    return lambda: [int(d.memory_used()) for d in devices]


def ledger_usage(ledger: MemoryLedger) -> UsageFn:
    return lambda: [ledger.current_bytes(lb) for lb in ledger.labels]


def frontend_attached() -> bool:
    """True inside a live Jupyter kernel that a person is looking at; False under nbval, scripts or when forced."""
    if os.environ.get(STATIC_ENV, "").strip() in {"1", "true", "yes"}:
        return False
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class MemoryMonitor:
    """Bars of used / capacity per device, refreshed from a background thread until `stop()`."""

    def __init__(self, rig: Rig, ledger: MemoryLedger | None = None, interval_s: float = 0.2):
        if rig.kind == "two_gpus":
            self.usage = nvml_usage([0, 1])
            self.labels = [f"cuda:{i} {n}" for i, n in enumerate(rig.names)]
        elif rig.kind == "one_gpu":
            self.usage = nvml_usage([0])
            self.labels = [f"cuda:0 {rig.names[0]}"]
        else:
            if ledger is None:
                raise ValueError("on the CPU rig the monitor draws the memory accounting: pass ledger=MemoryLedger(...)")
            self.usage = ledger_usage(ledger)
            self.labels = list(ledger.labels)
            self.known_peaks = lambda: [ledger.device(lb).total for lb in ledger.labels]
        self.capacity = list(rig.capacity_bytes[:len(self.labels)])
        if rig.kind == "one_gpu":
            self.capacity = [sum(rig.capacity_bytes)]
        self.interval_s = interval_s
        if not hasattr(self, "known_peaks"):
            self.known_peaks = lambda: [0] * len(self.labels)  # NVML has no peak: the samples give it
        self.peak = [0] * len(self.labels)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bars = None

    def snapshot(self) -> list[tuple[str, int, int]]:
        """[(device, used bytes, capacity bytes)] now; also updates the peaks."""
        used = self.usage()
        self.peak = [max(p, u, k) for p, u, k in zip(self.peak, used, self.known_peaks())]
        return list(zip(self.labels, used, self.capacity))

    def text(self) -> str:
        lines = []
        for (label, used, cap), peak in zip(self.snapshot(), self.peak):
            frac = used / cap if cap else 0.0
            bar = "#" * int(round(30 * min(frac, 1.0)))
            lines.append(f"{label:>22} [{bar:<30}] {fmt_bytes(used)} / {fmt_bytes(cap)} (peak {fmt_bytes(peak)})")
        return "\n".join(lines)

    def _build(self):
        import ipywidgets as w

        self._bars = [w.FloatProgress(min=0.0, max=1.0, description=lb[:12], layout=w.Layout(width="60%"))
                      for lb in self.labels]
        self._texts = [w.Label() for _ in self.labels]
        return w.VBox([w.HBox([b, t]) for b, t in zip(self._bars, self._texts)])

    def _refresh(self) -> None:
        for (label, used, cap), peak, bar, txt in zip(self.snapshot(), self.peak, self._bars, self._texts):
            bar.value = min(used / cap, 1.0) if cap else 0.0
            bar.bar_style = "danger" if cap and used > cap else ""
            txt.value = f"{fmt_bytes(used)} / {fmt_bytes(cap)} (peak {fmt_bytes(peak)})"

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._refresh()

    def start(self) -> "MemoryMonitor":
        """Show the panel. Live (background thread) with a frontend, otherwise a printed snapshot."""
        if not frontend_attached():
            print(self.text())
            return self
        from IPython.display import display

        display(self._build())
        self._refresh()
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
        self._refresh()
        self._thread = None
