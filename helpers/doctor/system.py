"""The rig and the machine under it (the doctor's sections 1-3): what the engines will see (GPUs, driver, NCCL,
topology, peer access), what NCCL needs of the machine (/dev/shm, IOMMU and PCIe ACS, copies between GPUs checked
byte for byte), and the links the engines really use, measured and fitted."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import replace

import torch

from helpers.doctor.checks import Check, guarded
from helpers.runtime.rig import Rig

NCCL_ENV = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE", "NCCL_DEBUG",
            "CUDA_VISIBLE_DEVICES", "LAB_FORCE_CPU", "LAB_CPU_THREADS")


# --- 1. rig and topology ------------------------------------------------------------------------------------------

def _command(args: list[str]) -> str | None:
    """A command's output, or None where the command does not exist or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def topology(rig: Rig) -> dict:
    """What the machine is, as the engines will see it."""
    info = {"rig": rig.describe(), "kind": rig.kind, "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__, "advice": list(rig.advice),
            "environment": {k: os.environ[k] for k in NCCL_ENV if k in os.environ}}
    if not torch.cuda.is_available():
        return info
    n = torch.cuda.device_count()
    info.update({
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
        "gpus": [{"index": i, "name": torch.cuda.get_device_name(i),
                  "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
                  "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))} for i in range(n)],
        "peer_access": {f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j))
                        for i in range(n) for j in range(n) if i != j},
        "driver": _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "topo": _command(["nvidia-smi", "topo", "-m"]),
        "nvlink": _command(["nvidia-smi", "nvlink", "-s"]) or "no NVLink reported",
    })
    return info


# --- 2. what NCCL needs of the machine --------------------------------------------------------------------------

SHM_NEEDED = 1024**3  # PyTorch's CI runs its NCCL tutorials in Docker with --shm-size=2gb since Docker's 64 MB default
# made NCCL segfault in ncclShmOpen (github.com/pytorch/tutorials/pull/2475); 1 GiB is the floor checked here
SHM_FIX = "in Docker: docker run --shm-size=2g (or --ipc=host); elsewhere: mount /dev/shm larger"


def nccl_between_gpus(rig: Rig) -> bool:
    """Whether this rig's multi-process engines talk through NCCL between two GPUs (where /dev/shm, IOMMU and ACS
    matter)."""
    return rig.kind == "two_gpus"


def shm_check(rig: Rig, path: str = "/dev/shm") -> Check:
    """NCCL between GPUs without P2P (two GeForce cards) moves data through shared memory in /dev/shm."""
    name = "system: /dev/shm for NCCL"
    try:
        stat = os.statvfs(path)
    except OSError:
        return Check(name, "REFUSED", f"{path} does not exist here (not Linux): NCCL runs on Linux only")
    return shm_verdict(rig, stat.f_frsize * stat.f_blocks, path)


def shm_verdict(rig: Rig, size: int, path: str = "/dev/shm") -> Check:
    """PASS, or FAIL with the fix, for a /dev/shm of `size` bytes on `rig`."""
    name, said = "system: /dev/shm for NCCL", f"{path} is {size / 2**20:.0f} MiB"
    if not nccl_between_gpus(rig):
        return Check(name, "PASS", f"{said}; not used on this rig ({rig.backend}, no NCCL between GPUs)")
    if size < SHM_NEEDED:
        return Check(name, "FAIL", f"{said}, under {SHM_NEEDED / 2**30:.0f} GiB: NCCL between two GPUs without "
                                   f"P2P passes data through it and crashes or hangs when it is full; {SHM_FIX}")
    return Check(name, "PASS", said)


def _iommu_state() -> str:
    """'off', 'passthrough' or 'on' (the kernel translates every device access), from sysfs and the boot line."""
    groups = os.listdir("/sys/kernel/iommu_groups") if os.path.isdir("/sys/kernel/iommu_groups") else []
    if not groups:
        return "off"
    try:
        cmdline = open("/proc/cmdline").read()
    except OSError:
        cmdline = ""
    return "passthrough" if "iommu=pt" in cmdline else "on"


def iommu_acs_check(rig: Rig) -> Check:
    """NCCL's troubleshooting guide: with the IOMMU translating, or PCIe ACS redirecting peer traffic through the
    root complex, GPU-to-GPU (P2P) transfers hang or crawl. It matters only where peer access is on."""
    name = "system: IOMMU and PCIe ACS"
    iommu = _iommu_state()
    lspci = _command(["lspci", "-vvv"])
    acs = "unknown (lspci -vvv unavailable or not root)" if lspci is None else \
        ("enabled on some bridge" if "SrcValid+" in lspci else "not enabled")
    said = f"IOMMU {iommu}; ACS {acs}"
    if nccl_between_gpus(rig) and rig.peer_access and (iommu == "on" or acs == "enabled on some bridge"):
        return Check(name, "WARN", f"{said}, with peer access on: P2P transfers can hang or slow down. Set "
                                   "NCCL_P2P_DISABLE=1, or boot with iommu=pt and disable ACS in the BIOS")
    return Check(name, "PASS", said + ("" if nccl_between_gpus(rig) else "; no GPU-to-GPU traffic on this rig"))


def p2p_check(rig: Rig, nbytes: int = 64 * 2**20) -> Check:
    """Two GPUs: peer access both ways, and a copy each way checked byte for byte (early GeForce drivers reported P2P
    that corrupted data); the threaded engine's boundary copies go this way."""
    name = "system: GPU-to-GPU copies"
    if rig.kind != "two_gpus":
        return Check(name, "REFUSED", "needs two GPUs")
    a, b = rig.devices
    access = {f"{x}->{y}": bool(torch.cuda.can_device_access_peer(x.index, y.index)) for x, y in ((a, b), (b, a))}
    for src, dst in ((a, b), (b, a)):
        data = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=src)
        if not torch.equal(data.to(dst).to(src), data):
            return Check(name, "FAIL", f"a copy {src} -> {dst} came back different (peer access {access}): set "
                                       "NCCL_P2P_DISABLE=1 and update the driver; the threaded engine cannot be "
                                       "trusted on this machine")
    advice = "" if all(access.values()) else " (no peer access: copies go through host memory; set " \
                                             "NCCL_P2P_DISABLE=1 so NCCL does not probe P2P)"
    return Check(name, "PASS", f"peer access {access}; {nbytes / 2**20:.0f} MiB each way, identical{advice}")


def system_checks(rig: Rig) -> list[Check]:
    return [c for check in (shm_check, iommu_acs_check, p2p_check)
            for c in guarded(check.__name__, lambda check=check: check(rig))]


# --- 3. links ----------------------------------------------------------------------------------------------------

SMALL_MESSAGE_BYTES = 256 * 1024  # a hidden state: rows x hidden x 2 bytes is a few KiB to a few hundred KiB


def links(rig: Rig, sizes: list[int], repeats: int) -> list[dict]:
    """Each link the engines use, fitted as latency + bytes / bandwidth from the sweep; the all-reduce fitted again
    over the hidden-state sizes alone (<= 256 KiB), whose latency is what tensor parallelism pays twice per layer."""
    from helpers.pipeline.comm import link_benchmark
    from helpers.simulate.calibrate import fit_small_messages
    from helpers.hardware import fit_link

    samples = link_benchmark(rig, sizes, repeats)
    small = [s for s in samples if "all-reduce" in s.path and s.bytes <= SMALL_MESSAGE_BYTES]
    if len({s.bytes for s in small}) >= 2:
        samples = samples + [replace(s, path=f"{s.path}, hidden-state sizes") for s in small]
    out = []
    for path in dict.fromkeys(s.path for s in samples):
        pts = [s for s in samples if s.path == path]
        fit = fit_small_messages if path.endswith("hidden-state sizes") else fit_link
        link = fit([s.bytes for s in pts], [s.seconds for s in pts], path)
        out.append({"path": path, "latency_us": link.latency_s * 1e6, "GB/s": link.bandwidth / 1e9,
                    "largest message GB/s": pts[-1].gb_per_s,
                    "samples": [{"bytes": s.bytes, "seconds": s.seconds} for s in pts]})
    return out


