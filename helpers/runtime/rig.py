"""Which rig are we on? Two GPUs, one GPU, or a CPU with virtual devices.

Every technique in the course runs unchanged on three rigs. On CPU a *virtual device* is one thread (or one
process) limited to one intra-op thread, so a 2-core laptop really behaves like two devices.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence, TypeVar

import torch

from helpers.units import GiB

T = TypeVar("T")

DEFAULT_CPU_BUDGET_GIB = 2.0
FORCE_CPU_ENV = "LAB_FORCE_CPU"
CPU_BUDGET_ENV = "LAB_CPU_BUDGET_GIB"
CPU_THREADS_ENV = "LAB_CPU_THREADS"
PIN_CORES_ENV = "LAB_PIN_CORES"  # 0: leave CPU virtual devices unpinned (`pin_to_device_cores`)
KEEP_FREED_ENV = "LAB_KEEP_FREED_MEMORY"  # 0: leave glibc's allocator at its defaults (notebook 06 compares both)

RigKind = Literal["two_gpus", "one_gpu", "cpu"]


@dataclass(frozen=True)
class Rig:
    """What a notebook needs to know about the machine it runs on."""

    kind: RigKind
    devices: tuple[torch.device, ...]  # one per (virtual) device; the one-GPU rig lists cuda:0 twice
    names: tuple[str, ...]
    capacity_bytes: tuple[int, ...]  # real memory on GPUs; a budget for the memory accounting on CPU
    backend: str  # torch.distributed backend for one rank per device
    max_ranks: int  # how many ranks the rig hosts without sharing a core or a GPU
    peer_access: bool | None = None  # can GPU 0 read GPU 1 directly (P2P / NVLink)? None off two-GPU rigs
    advice: tuple[str, ...] = field(default=())
    threads_per_device: int = 1  # intra-op threads of one CPU virtual device (the one-device baseline gets as many)

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.kind != "cpu"

    @property
    def labels(self) -> tuple[str, ...]:
        """Short per-device names for tables and the memory ledger."""
        if self.kind == "one_gpu":
            return tuple(f"cuda:0/stage{i}" for i in range(len(self.devices)))
        return tuple(f"cpu:{i}" if self.is_cpu else str(d) for i, d in enumerate(self.devices))

    def describe(self) -> str:
        """One printable line: which rig this run is on."""
        if self.is_cpu:
            budget = self.capacity_bytes[0] / GiB
            threads = "one thread" if self.threads_per_device == 1 else f"{self.threads_per_device} threads"
            return (f"CPU rig: {len(self.devices)} virtual devices ({threads} each) on {usable_cores()} cores, "
                    f"memory budget {budget:.1f} GiB per virtual device")
        mem = ", ".join(f"{n} {c / GiB:.1f} GiB" for n, c in zip(self.names, self.capacity_bytes))
        if self.kind == "one_gpu":
            return f"one-GPU rig: both stages on cuda:0 ({mem})"
        p2p = {True: "peer access yes", False: "peer access no (copies go through host memory)",
               None: "peer access unknown"}[self.peer_access]
        return f"two-GPU rig: {mem}; {p2p}"

    def device(self, index: int) -> torch.device:
        """The torch device of (virtual) device `index`, with a clear error when the rig has no such device."""
        if not 0 <= index < len(self.devices):
            raise ValueError(f"device {index} asked for, but this {self.kind} rig has devices "
                             f"0..{len(self.devices) - 1}")
        return self.devices[index]


def usable_cores() -> int:
    """Cores this process may run on (a container or `taskset` can give fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def cpu_threads_per_device(n_devices: int = 2, threads: int | None = None) -> int:
    """Threads of one virtual device: the cores shared equally by the devices (floor(cores / 2) for two), so a
    speed-up still means "two devices instead of one" and a many-core laptop is not left idle. LAB_CPU_THREADS or
    `threads` overrides."""
    if threads is None and os.environ.get(CPU_THREADS_ENV, "").strip():
        threads = int(os.environ[CPU_THREADS_ENV])
    if threads is None:
        return max(1, usable_cores() // n_devices)
    if threads < 1:
        raise ValueError(f"a virtual device needs at least one thread, got {threads}")
    return threads


def cpu_rig(n_devices: int = 2, budget_gib: float | None = None, threads: int | None = None) -> Rig:
    """The CPU rig: `n_devices` virtual devices with `threads` intra-op threads each and a memory budget."""
    if n_devices < 1:
        raise ValueError(f"a rig needs at least one device, got {n_devices}")
    if budget_gib is None:
        budget_gib = float(os.environ.get(CPU_BUDGET_ENV, DEFAULT_CPU_BUDGET_GIB))
    if not budget_gib > 0:
        raise ValueError(f"the CPU memory budget must be a positive number of GiB, got {budget_gib}")
    budget = int(budget_gib * GiB)
    per_device = cpu_threads_per_device(n_devices, threads)
    cpu = torch.device("cpu")
    return Rig(kind="cpu", devices=(cpu,) * n_devices, names=tuple(f"cpu:{i} (virtual)" for i in range(n_devices)),
               capacity_bytes=(budget,) * n_devices, backend="gloo",
               max_ranks=max(1, usable_cores() // per_device), threads_per_device=per_device)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 1024**2  # glibc's ceiling on 64-bit: larger blocks are always mapped afresh
_NEVER_TRIM = 2**31 - 1


def keep_freed_memory() -> bool:
    """Make this process keep the memory it frees for its next tensors, as PyTorch's CUDA caching allocator does on
    a GPU, instead of handing it back to the operating system. glibc's malloc (Linux) maps each block of 128 KiB or
    more afresh (its threshold then adapts) and returns the top of its heap once enough is free, so the next step's
    activations page-fault their memory in again, slowing the steps that fault and not the calibration timed between
    them (docs/bench.md, `keep_freed_memory`). Blocks up to 32 MiB (glibc's limit) now come from a heap that is never
    trimmed; PyTorch's CPU tuning guide recommends an allocator that reuses memory (jemalloc, TCMalloc) for the same
    reason. Returns False, changing nothing, without glibc."""
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))


def device_thread(fn: Callable[[], T], device: torch.device | None = None, index: int = 0,
                  world: int = 1) -> Callable[[], T]:
    """`fn` made to run in a new thread as one virtual device: with this process's intra-op thread count (one per
    virtual device on the CPU rig). A new thread's OpenMP starts with as many threads as cores until
    `torch.set_num_threads` is called in it (docs/bench.md, `device_thread`), so two such "devices" at once could
    run four threads on two cores. Every thread that computes as a device starts here: the threaded pipelines' stages (training and
    inference) and the calibration's runs together. A thread that computes on CPU `device`, device `index` of
    `world`, also gets that device's cores (`pin_to_device_cores`), as a rank does; a GPU's host thread is never
    pinned."""
    threads = torch.get_num_threads()
    cores = _usable_core_ids()  # the caller's: a new thread inherits them, and pinning reads them before it pins

    def run() -> T:
        torch.set_num_threads(threads)
        if device is not None and device.type == "cpu":
            pin_to_device_cores(index, world, threads, cores)
        return fn()

    return run


def run_together(work: Sequence[Callable[[], object]]) -> list[float]:
    """Each of `work` in a thread of its own, as CPU virtual devices, all released at once; the seconds each took
    (what the simulator's and the speed bench's calibrations time on both devices at once)."""
    return [wall for wall, _ in run_together_with_cpu(work)]


def run_together_with_cpu(work: Sequence[Callable[[], object]]) -> list[tuple[float, float]]:
    """`run_together`, each work's (wall seconds, its thread's CPU seconds): the difference is what the thread
    waited (on the CPU rig, for the interpreter lock the device threads of one process share)."""
    took = [(0.0, 0.0)] * len(work)
    start = threading.Barrier(len(work))

    def timed(i: int) -> None:
        start.wait()
        t0, c0 = time.perf_counter(), time.thread_time()
        work[i]()
        took[i] = (time.perf_counter() - t0, time.thread_time() - c0)

    cpu, n = torch.device("cpu"), len(work)
    threads = [threading.Thread(target=device_thread(lambda i=i: timed(i), cpu, i, n)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took


def _usable_core_ids() -> list[int]:
    """The cores this thread may run on, in order ([] where the system cannot pin: macOS, Windows)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []


def pin_to_device_cores(index: int, world: int, threads_per_device: int, cores: Sequence[int] | None = None) -> bool:
    """Pin the calling thread to the cores of virtual device `index` of `world` devices: `threads_per_device` of
    `cores` (default: those it may use now) of its own, as a GPU is a device of its own; threads it starts later
    inherit them. Only where there are several devices and they fit the cores (more ranks than cores share them as
    the scheduler pleases) and the system can pin (Linux); LAB_PIN_CORES=0 leaves every device to the scheduler.
    Cores are taken in the system's numbering: where it numbers a physical core's two hyperthreads next to each
    other, two one-thread devices share a physical core. Returns whether it pinned.

    A rank pins its main thread once it has joined the group (`helpers.runtime.launch.init_rank`): the default
    group's gloo threads, started meanwhile, stay free to run on whichever core is idle, as a GPU's communication does
    not take its compute (pinned, an all-reduce thread queues behind the backward on one core); the groups a job
    makes later (its mesh) start theirs on the rank's core. Unpinned, a rank migrates and wakes late from its
    all-reduces, and runs differ more (docs/bench.md, `pin_to_device_cores`)."""
    cores = list(cores) if cores is not None else _usable_core_ids()
    if os.environ.get(PIN_CORES_ENV, "1").strip() == "0" or world < 2 or world * threads_per_device > len(cores):
        return False
    os.sched_setaffinity(0, set(cores[index * threads_per_device:(index + 1) * threads_per_device]))
    return True


def claim_cpu_device(rig: Rig) -> None:
    """Make the calling process one of the CPU rig's virtual devices: that device's intra-op threads (the baseline
    every ratio uses), and an allocator that keeps freed memory, as a GPU's does (`keep_freed_memory`), unless
    LAB_KEEP_FREED_MEMORY=0 asks for glibc's defaults."""
    torch.set_num_threads(rig.threads_per_device)
    if os.environ.get(KEEP_FREED_ENV, "1").strip() != "0":
        keep_freed_memory()


def is_geforce(name: str) -> bool:
    """GeForce cards (RTX 3090, 4090, ...) ship without PCIe peer-to-peer on the stock driver."""
    return "geforce" in name.lower() or name.upper().startswith("NVIDIA RTX 30") or "RTX 40" in name.upper()


def p2p_advice(names: tuple[str, ...], peer_access: bool) -> tuple[str, ...]:
    """What a two-GPU owner should set, given the card names and whether peer access works."""
    if not any(is_geforce(n) for n in names):
        return ()
    if peer_access:
        return ("Peer access works on these GeForce cards: with a 3090 that means an NVLink bridge. On 4090s, "
                "early drivers reported P2P that corrupted data; if DDP hangs or losses diverge, set "
                "NCCL_P2P_DISABLE=1.",)
    return ("GeForce cards have no PCIe peer-to-peer on the stock driver, so GPU-to-GPU copies go through host "
            "memory. Set NCCL_P2P_DISABLE=1 before the process group starts so NCCL does not probe P2P (it can "
            "hang or fall back slowly); expect ~11 GB/s one way between the cards.",)


def _cuda_rig() -> Rig:
    count = torch.cuda.device_count()
    names = tuple(torch.cuda.get_device_name(i) for i in range(min(count, 2)))
    capacities = tuple(torch.cuda.get_device_properties(i).total_memory for i in range(min(count, 2)))
    if count == 1:
        dev = torch.device("cuda:0")
        return Rig(kind="one_gpu", devices=(dev, dev), names=(names[0], names[0]),
                   capacity_bytes=(capacities[0] // 2,) * 2, backend="gloo", max_ranks=2,
                   advice=("One GPU: both stages share cuda:0 and its memory (each gets half in the accounting). "
                           "Two ranks on one GPU use gloo, since NCCL refuses two ranks on the same device.",))
    peer = bool(torch.cuda.can_device_access_peer(0, 1))
    return Rig(kind="two_gpus", devices=(torch.device("cuda:0"), torch.device("cuda:1")), names=names,
               capacity_bytes=capacities, backend="nccl", max_ranks=count, peer_access=peer,
               advice=p2p_advice(names, peer))


def detect_rig(force_cpu: bool | None = None, cpu_budget_gib: float | None = None) -> Rig:
    """Detect the rig. `force_cpu=True` (or LAB_FORCE_CPU=1) gives the CPU rig even where GPUs exist."""
    if force_cpu is None:
        force_cpu = os.environ.get(FORCE_CPU_ENV, "").strip().lower() in {"1", "true", "yes"}
    if force_cpu or not torch.cuda.is_available():
        return cpu_rig(2, cpu_budget_gib)
    return _cuda_rig()
