"""Byte accounting per device, measured: parameters, gradients, optimizer state and activations saved for backward.

On CPU virtual devices this accounting is the only honest number (the process shares one heap), so it is what the
course shows there; on CUDA it sits beside `torch.cuda.max_memory_allocated`.
Activations are counted with `torch.autograd.graph.saved_tensors_hooks`: exactly what autograd keeps for backward,
each storage once, parameters excluded, freed when the graph is freed.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from helpers.units import MiB

def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held on this device: for a sharded DTensor (FSDP2), the local shard only; for a tensor subclass that
    holds other tensors (a 4-bit NF4 weight: its codes, block scales and lookup table), what those hold, not
    numel x the dtype it computes in."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(tensor_bytes(p) for p in params)


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(tensor_bytes(p.grad) for p in params if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes of optimizer state (Adam's two moments, momentum buffers, step counters) for `params` (default all)."""
    wanted = None if params is None else {id(p) for p in params}
    total = 0
    for p, state in optimizer.state.items():
        if wanted is not None and id(p) not in wanted:
            continue
        total += sum(tensor_bytes(v) for v in state.values() if torch.is_tensor(v))
    return total


@dataclass
class DeviceMemory:
    """Bytes on one device. `activations` is the peak of saved activations over the measured step."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        """Upper bound of the peak: all four at once (gradients usually appear as activations are freed)."""
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}

    def parts(self) -> dict[str, int]:
        """The four parts by name, without the total."""
        return asdict(self)


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Identity of a tensor's storage: its address, or None for tensors without a plain storage (DTensor wrappers).
    A meta tensor's storage has no memory, so its address is 0 for every one of them; there the identity of the
    storage object itself (`_cdata`, the address of PyTorch's StorageImpl, shared by every view) tells them apart,
    which is what lets the ledger count a model's activations on the meta device (helpers.gpu_sizes)."""
    try:
        storage = t.untyped_storage()
        return storage._cdata if t.is_meta else storage.data_ptr()
    except RuntimeError:  # a wrapper subclass (DTensor, NF4Tensor) has no storage of its own
        return None


class _Saved:
    """What autograd stores instead of the tensor; releases its bytes from the ledger when autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class MemoryLedger:
    """Per-device memory accounting for a model split over (virtual) devices.

    `assign(label, module)` says which parameters live on which device; `track_activations(label)` counts what
    autograd saves while code runs on that device (thread-safe: each worker thread enters its own context).
    """

    def __init__(self, labels: Iterable[str]):
        self.labels = list(labels)
        if not self.labels:
            raise ValueError("a memory ledger needs at least one device label")
        self._params: dict[str, list[torch.Tensor]] = {lb: [] for lb in self.labels}
        self._param_storages: set[int] = set()
        self._lock = threading.Lock()
        self._live: dict[str, int] = dict.fromkeys(self.labels, 0)
        self._peak: dict[str, int] = dict.fromkeys(self.labels, 0)
        self._largest: dict[str, int] = dict.fromkeys(self.labels, 0)
        self._refs: dict[tuple[str, int], list[int]] = {}  # (label, storage ptr) -> [count, bytes]
        self.optimizer: torch.optim.Optimizer | None = None

    def _check(self, label: str) -> None:
        if label not in self._live:
            raise KeyError(f"unknown device {label!r}; this ledger has {self.labels}")

    def assign(self, label: str, module: nn.Module) -> None:
        self._check(label)
        params = list(module.parameters())
        self._params[label].extend(params)
        self._param_storages.update(_storage_ptr(p.to_local() if hasattr(p, "to_local") else p) for p in params)

    def _pack(self, label: str, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t  # a weight autograd keeps (FSDP2's gathered weights included) is not an activation
        ptr = _storage_ptr(t)
        if ptr is None or ptr in self._param_storages:
            return t
        key = (label, ptr)
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                self._refs[key] = [1, t.untyped_storage().nbytes()]
                self._live[label] += self._refs[key][1]
                self._peak[label] = max(self._peak[label], self._live[label])
                self._largest[label] = max(self._largest[label], self._refs[key][1])
            else:
                entry[0] += 1
        # an output its own node saves would hold that node through its grad_fn, a cycle the garbage collector cannot
        # see: a graph kept (retain_graph, or never run backward) would never be freed. A detached view holds none.
        saved = _Saved(t.detach() if t.grad_fn is not None else t)
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: tuple[str, int]) -> None:
        with self._lock:
            entry = self._refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                self._live[key[0]] -= entry[1]
                del self._refs[key]

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    @contextmanager
    def track_activations(self, label: str) -> Iterator[None]:
        """Count tensors autograd saves inside this block as activations of device `label`."""
        self._check(label)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(label, t), self._unpack):
            yield

    def trackers(self) -> list:
        """One `track_activations` factory per label, in label order (what the stage executors take)."""
        return [lambda lb=lb: self.track_activations(lb) for lb in self.labels]

    def reset_peaks(self) -> None:
        with self._lock:
            self._peak = dict(self._live)

    def live_activations(self, label: str) -> int:
        return self._live[label]

    def largest_saved(self, label: str) -> int:
        """Bytes of the largest single storage saved on `label` so far: backward's gradient with respect to it is
        as large, which makes it the biggest transient of a backward pass (helpers.gpu_sizes plans with it)."""
        return self._largest[label]

    def device(self, label: str, now: bool = False) -> DeviceMemory:
        """What `label` holds by part: activations at their peak, or (`now`) those alive now."""
        params = self._params[label]
        opt = optimizer_state_bytes(self.optimizer, params) if self.optimizer is not None else 0
        return DeviceMemory(param_bytes(params), grad_bytes(params), opt, (self._live if now else self._peak)[label])

    def report(self) -> dict[str, DeviceMemory]:
        return {lb: self.device(lb) for lb in self.labels}

    # what the memory panel reads (`helpers.monitor`): parts by name, now and at the peak
    def parts(self, label: str) -> dict[str, int]:
        return self.device(label, now=True).parts()

    def peak_parts(self, label: str) -> dict[str, int]:
        return self.device(label).parts()


def ledger_for(modules: Iterable[nn.Module], labels: Iterable[str],
               optimizer: torch.optim.Optimizer | None = None) -> MemoryLedger:
    """A ledger with module i's parameters on device labels[i]."""
    modules, labels = list(modules), list(labels)
    if len(modules) != len(labels):
        raise ValueError(f"{len(modules)} modules for {len(labels)} device labels")
    ledger = MemoryLedger(labels)
    for module, label in zip(modules, labels):
        ledger.assign(label, module)
    ledger.optimizer = optimizer
    return ledger


def measure_step_memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn,
                        optimizer: torch.optim.Optimizer) -> DeviceMemory:
    """Params, grads, optimizer state and peak saved activations of one training step on one device."""
    ledger = ledger_for([model], ["device"], optimizer)
    with ledger.track_activations("device"):
        loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return ledger.device("device")


def cuda_peak_bytes(device: torch.device) -> int | None:
    """`torch.cuda.max_memory_allocated` where CUDA exists, else None (never touches CUDA on CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(device)


def max_batch(static_bytes: int, activation_bytes_per_sample: float, budget_bytes: int) -> int:
    """Largest batch whose training state plus saved activations fits `budget_bytes` (activations grow linearly
    with the batch, as measured in notebook 00)."""
    if not budget_bytes > 0:
        raise ValueError(f"the memory budget must be positive, got {budget_bytes}")
    if static_bytes >= budget_bytes:
        return 0
    return int((budget_bytes - static_bytes) // activation_bytes_per_sample)


def batch_budget(report: dict[str, DeviceMemory], batch: int, budget_bytes: int) -> dict:
    """From one measured step at `batch`: the fullest device's training state, its saved activations per sample,
    and the largest batch that keeps it within `budget_bytes`."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    state = max(m.params + m.grads + m.optimizer for m in report.values())
    per_sample = max(m.activations for m in report.values()) / batch
    return {"state": state, "per_sample": per_sample, "largest_batch": max_batch(state, per_sample, budget_bytes)}


def stacked_bars(names: list[str], parts, ax=None, figsize=(7, 3.2), ylabel: str = "MiB", title: str = "",
                 capacities=(), legend_outside: bool = False, title_size=None):
    """One stacked bar per name, the one bar chart of the planners and the ledger: `parts` are (label, one value per
    name, bar style) bottom up; `capacities` (one per name, in the bars' unit) draw a black line at each device's
    capacity, so an over-full bar rises above it. Returns the axes and the bars' tops."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    bottom = [0.0] * len(names)
    for label, values, style in parts:
        ax.bar(names, values, bottom=bottom, label=label, **style)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, capacity in enumerate(capacities):
        ax.hlines(capacity, i - 0.45, i + 0.45, color="black", linewidth=2, label="capacity" if i == 0 else None)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
    ax.legend(fontsize=8, **({"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if legend_outside else {}))
    return ax, bottom


def plot_memory_bars(memory: dict[str, DeviceMemory], ax=None, title: str = "per-device memory, measured"):
    """Stacked bars of params / grads / optimizer / activations, one bar per named setup."""
    names = list(memory)
    parts = [(part, [getattr(memory[n], part) / MiB for n in names], {})
             for part in ("params", "grads", "optimizer", "activations")]
    return stacked_bars(names, parts, ax, title=title)[0]
