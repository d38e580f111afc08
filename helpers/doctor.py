"""`python -m helpers.doctor`: the first command on a new machine. Every engine and strategy this rig supports, run
once against one device, and the links the engines really use, measured.

It prints, and with `--json PATH` writes:
1. the rig and its topology: GPUs, driver, CUDA, NCCL, `nvidia-smi topo -m`, peer access between every pair, NVLink
   state, the environment variables that change NCCL's behaviour, and the rig's advice;
2. what NCCL needs of the machine: /dev/shm's size (Docker's 64 MB default breaks it), IOMMU and PCIe ACS (which
   make GPU-to-GPU traffic hang or slow), and on two GPUs a copy between them checked byte for byte;
3. the links: the multi-process engines' point-to-point and all-reduce (NCCL, or gloo), and on GPUs the threaded
   engine's GPU-to-GPU copies and host transfers, over a size sweep, fitted as latency + bytes / bandwidth (the
   all-reduce fitted again over hidden-state sizes alone: the small-message latency tensor parallelism pays);
4. a one-step parity check of every engine and strategy (threads, processes, torch.distributed.pipelining; naive,
   GPipe, 1F1B; DDP, ZeRO-1, ZeRO-2, FSDP2; DP x PP) against one device: PASS, FAIL, or REFUSED with the reason
   this rig cannot run it; the CUDA-only paths (CUDA-event timelines, copy and compute streams, the NVML panel);
5. the take-home scripts (QLoRA's included), two steps each under torchrun, and the bench's calibration in its
   ranks;
6. each notebook's GPU sizes against this rig's memory.
Every section is guarded: whatever fails is a FAIL row with its reason, and the table is printed anyway. WARN says
what to change without failing. Exit status 1 if anything FAILed. On the CPU rig it runs the same checks there (CI
runs it), its ranks device-strict (`helpers.runtime.strict`): a tensor that would be on the wrong device under NCCL
fails there too.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from helpers.catalog import DATA_PARALLEL
from helpers.check import max_grad_diff
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.precision import Precision, max_relative_diff
from helpers.runtime.launch import run_command
from helpers.runtime.rig import FORCE_CPU_ENV, Rig, claim_cpu_device, detect_rig
from helpers.runtime.strict import STRICT_ENV
from helpers.training.support import Support, support

CFG = StackConfig(hidden=64, n_blocks=4, heads=2, seq_len=16, vocab=128)  # small: each check takes seconds
BATCH = 8
CUT = (3,)
TOLERANCE = 1e-5  # fp32: same loss, gradients within 1e-5
NCCL_ENV = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE", "NCCL_DEBUG",
            "CUDA_VISIBLE_DEVICES", "LAB_FORCE_CPU", "LAB_CPU_THREADS")


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN (works, but change something) | FAIL | REFUSED (this rig cannot run it)
    detail: str = ""
    seconds: float = 0.0


def guarded(name: str, fn: Callable[[], "Check | list[Check] | str"]) -> list[Check]:
    """Run one section or check; whatever it raises becomes a FAIL row with the reason, so the table still prints.
    `fn` returns its rows, or a PASS detail."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - a failing check is a result, not a crash
        return [Check(name, "FAIL", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}",
                      time.perf_counter() - t0)]
    if isinstance(out, str):
        return [Check(name, "PASS", out, time.perf_counter() - t0)]
    return out if isinstance(out, list) else [out]


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
    from helpers.simulate.hardware import fit_link

    from helpers.simulate.calibrate import fit_small_messages

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


# --- 4. parity checks ---------------------------------------------------------------------------------------------

def _reference(device: torch.device, precision: Precision) -> tuple[float, list[torch.Tensor]]:
    model = build_stack(CFG, device=device).to(precision.weights)
    x, y = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH)
    with precision.context(device):
        loss = lm_loss(model(x.to(device)), y.to(device))
    loss.backward()
    return loss.item(), [p.grad.detach().float().cpu() for p in model.parameters()]


def _compare(reference, loss: float, grads, precision: Precision) -> str:
    """fp32: gradients within 1e-5 of one device's; 16-bit: within the precision's relative tolerance."""
    ref_loss, ref_grads = reference
    if precision.compute == "fp32":
        diff, allowed, what = max_grad_diff(ref_grads, grads), TOLERANCE, "differ by"
    else:
        diff, allowed, what = max_relative_diff(ref_grads, grads), precision.tolerance, "differ (relative) by"
    if not (abs(loss - ref_loss) <= 1e-3 * abs(ref_loss) and diff <= allowed):
        raise AssertionError(f"loss {loss:.6f} vs one device {ref_loss:.6f}; gradients {what} {diff:.1e} "
                             f"(allowed {allowed:.0e}, {precision})")
    return f"loss diff {abs(loss - ref_loss):.1e}, grad diff {diff:.1e}"


def schedule_cut(schedule: str) -> tuple[int, ...]:
    """Where the checks cut CFG's six layers for `schedule`: in two (CUT), or in four stages for a schedule with two
    stages per device (the bench's cut: each device holds as many blocks whichever stages it gets)."""
    from helpers.bench import bench_cut

    return bench_cut(schedule, CFG.n_blocks + 2)


def schedule_label(schedule: str) -> str:
    return {"gpipe": "GPipe", "1f1b": "1F1B"}.get(schedule, schedule)


def _threads(rig: Rig, schedule: str, m: int, reference, precision: Precision = Precision()) -> str:
    from helpers.pipeline.schedules import layout_for
    from helpers.pipeline.stages import split_model
    from helpers.pipeline.threaded import ThreadedPipeline, stage_devices

    devices = stage_devices(rig.devices, layout_for(schedule, len(rig.devices)))
    split = split_model(build_stack(CFG).to(precision.weights), list(schedule_cut(schedule)), devices)
    x, y = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH)
    pipe = ThreadedPipeline(split, schedule, m, precision=precision)
    loss = pipe.step(x.to(rig.devices[0]), y.to(rig.devices[-1])).item()
    if rig.is_cuda:
        torch.cuda.synchronize()
    kinds = {e.kind for e in pipe.events()}
    return _compare(reference, loss, [p.grad.detach().float().cpu() for p in split.parameters()], precision) + \
        f"; timeline {sorted(kinds)}"


def _processes(rig: Rig, reference, compare_as: Precision | None = None, **fields) -> str:
    """`fields` as a TrainJob on processes against one device's `reference`, to the job's precision's tolerance
    (or `compare_as`'s: DDP's gradients sent in bf16 round them as bf16 autocast would)."""
    from helpers.training.job import TrainJob
    from helpers.training.loop import run_training

    job = TrainJob(CFG, batch=BATCH, timed_steps=1, return_grads=True, **fields)
    res = run_training(job, rig, oversubscribe=rig.is_cpu)
    return _compare(reference, res.loss, res.grads, compare_as or job.precision) + f"; step {res.step_s * 1e3:.1f} ms"


def _processes_together(rig: Rig, reference, jobs: list[dict]) -> str:
    """Several TrainJobs (`jobs`: their fields) in one launch, one after the other on the same ranks, as the bench
    runs them: each job's process groups are destroyed when it ends and the next job makes its own (on GPUs, NCCL
    communicators torn down and made again in the same processes); each against one device's `reference`."""
    from helpers.training.job import TrainJob
    from helpers.training.loop import run_trainings

    made = [TrainJob(CFG, batch=BATCH, timed_steps=1, return_grads=True, **fields) for fields in jobs]
    results = run_trainings(made, rig, oversubscribe=rig.is_cpu)
    return "; ".join(_compare(reference, res.loss, res.grads, job.precision) for job, res in zip(made, results))


def _hf(rig: Rig, strategy: str, engine: str, workdir: str) -> str:
    """A tied GPT-2 (embedding and head on different stages, right-padded batch) through `strategy` on `engine`,
    four Adam steps, against one device doing the same: the path a user's own Hugging Face model takes."""
    from helpers.models.hf import hf_config, save_hf_model
    from helpers.models.layered import Stage
    from helpers.training import train

    model = save_hf_model(hf_config("gpt2", 2, 64, 4, CFG.vocab, CFG.seq_len, tie_embeddings=True),
                          f"{workdir}/gpt2-tied")
    layers = model.meta_layers()
    model.materialize(layers, range(len(layers)), rig.devices[0])
    stage = Stage(layers)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3)
    x, y, mask = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab, padding="right").masked_batch(0, BATCH)
    x, y, mask = x.to(rig.devices[0]), y.to(rig.devices[0]), mask.to(rig.devices[0])
    for _ in range(4):
        opt.zero_grad()
        lm_loss(stage(x, model.context(x, mask)), y).backward()
        opt.step()
    out = train(model, strategy, engine, steps=4, batch=BATCH, seq_len=CFG.seq_len, microbatches=4, rig=rig,
                padding="right")
    diff = max((p.detach().cpu() - out.state[i][name]).abs().max().item()
               for i, layer in enumerate(layers) for name, p in layer.named_parameters())
    if not diff <= 1e-4:
        raise AssertionError(f"after 4 Adam steps the weights differ from one device's by {diff:.1e}")
    if not torch.equal(out.state[0]["tok.weight"], out.state[len(layers) - 1]["weight"]):
        raise AssertionError("the tied embedding and head copies drifted apart")
    return f"4 Adam steps, weights within {diff:.1e} of one device's, tied copies identical"


def _generation(rig: Rig, engine: str, workdir: str) -> str:
    """Greedy tokens of a small Llama (grouped-query attention, left-padded prompts) across the rig's devices, equal
    to Hugging Face's generate on one device: the layer split, pipelined requests, or tensor parallelism."""
    from helpers.inference.generate import LayerSplit, OneDevice, make_requests, same_tokens, stages_from_cuts
    from helpers.inference.pipelined import Pipelined
    from helpers.inference.tensor_parallel import run_tensor_parallel
    from helpers.models.hf import hf_config, save_hf_model

    model = save_hf_model(hf_config("llama", 4, 64, 4, CFG.vocab, 64, kv_heads=2), f"{workdir}/llama-{engine}")
    requests = make_requests(2, CFG.vocab, per_request=2, lengths=(3, 9), seed=1)
    reference = OneDevice(model, rig.devices[0]).generate(requests, 6).tokens
    if engine == "tensor parallel":
        tokens = run_tensor_parallel(model, requests, 6, rig, repeats=1, warmup=0).tokens
    else:
        cls = LayerSplit if engine == "layer split" else Pipelined
        tokens = cls(model, stages_from_cuts(model, [3]), rig.devices).generate(requests, 6).tokens
    if not same_tokens(tokens, reference):
        raise AssertionError("greedy tokens differ from generate on one device")
    return f"{sum(t.numel() for t in tokens)} tokens equal to generate on one device"


def _cuda_paths(rig: Rig) -> str:
    """The pieces that only exist on GPUs: CUDA-event spans, the memory panel's NVML and allocator readings."""
    from helpers.sizing.ledger import ledger_for
    from helpers.monitor import MemoryMonitor
    from helpers.timeline import Recorder

    device = rig.devices[0]
    rec = Recorder(0, device)
    a = torch.randn(1024, 1024, device=device)
    with rec.span("forward", 0):
        (a @ a).sum()
    (event,) = rec.events()
    if not event.duration > 0:
        raise AssertionError(f"a CUDA-event span measured {event.duration} s")
    model = build_stack(CFG, device=device)
    readings = MemoryMonitor(rig, ledger_for([model], [rig.labels[0]])).readings()
    return (f"CUDA-event span {event.duration * 1e6:.0f} us; panel: allocated {readings[0].allocated}, "
            f"nvidia-smi {readings[0].nvml if readings[0].nvml is not None else 'N/A'}")


def plan_checks(rig: Rig, workdir: str) -> list[tuple[str, Support, Callable[[], str]]]:
    """(name, whether this rig can run it, run) for every check (`workdir` holds the models the checks save)."""
    from helpers.inference.tensor_parallel import tensor_parallel_support
    from helpers.pipeline.schedules import SCHEDULES
    refs: dict[Precision, tuple] = {}

    def reference(precision: Precision = Precision()):
        if precision not in refs:
            refs[precision] = _reference(rig.devices[0], precision)
        return refs[precision]

    bf16, fp16, bf16_weights = Precision(autocast="bf16"), Precision(autocast="fp16"), Precision(dtype="bf16")

    pipe = dict(pp=2, boundaries=CUT)
    by_strategy = [
        ("threads: naive split", "naive", "threads", lambda: _threads(rig, "gpipe", 1, reference())),
        ("threads: GPipe m=4", "gpipe", "threads", lambda: _threads(rig, "gpipe", 4, reference())),
        ("threads: 1F1B m=4", "1f1b", "threads", lambda: _threads(rig, "1f1b", 4, reference())),
        ("processes: naive split", "naive", "processes",
         lambda: _processes(rig, reference(), microbatches=1, **pipe)),
        ("processes: GPipe m=4, blocking sends", "gpipe", "processes",
         lambda: _processes(rig, reference(), microbatches=4, overlap=False, **pipe)),
        ("processes: GPipe m=4", "gpipe", "processes", lambda: _processes(rig, reference(), microbatches=4, **pipe)),
        ("processes: 1F1B m=4", "1f1b", "processes",
         lambda: _processes(rig, reference(), schedule="1f1b", microbatches=4, **pipe)),
        ("torch: GPipe m=4", "gpipe", "torch",
         lambda: _processes(rig, reference(), microbatches=4, engine="torch", **pipe)),
        ("torch: 1F1B m=4", "1f1b", "torch",
         lambda: _processes(rig, reference(), schedule="1f1b", microbatches=4, engine="torch", **pipe)),
        # every schedule beyond 1F1B on every engine (two stages per device, split backwards, copy streams)
        *[(f"{engine}: {schedule_label(s)} m=4", s, engine, (lambda s=s, engine=engine: _threads(
            rig, s, 4, reference()) if engine == "threads" else _processes(
            rig, reference(), schedule=s, microbatches=4, pp=2, boundaries=schedule_cut(s),
            engine="torch" if engine == "torch" else "ours")))
          for s in SCHEDULES if s not in ("gpipe", "1f1b") for engine in ("threads", "processes", "torch")],
        *[(f"processes: {s}", s, "processes",
           (lambda s=s: _processes(rig, reference(), dp=2, data_parallel=s, optimizer="adam")))
          for s in DATA_PARALLEL],
        ("processes: 1F1B, DDP, 1F1B in one launch (each job's groups destroyed as it ends)", "1f1b", "processes",
         lambda: _processes_together(rig, reference(), [dict(schedule="1f1b", microbatches=4, **pipe),
                                                        dict(dp=2, data_parallel="ddp"),
                                                        dict(schedule="1f1b", microbatches=4, **pipe)])),
        ("processes: DP x PP 2 x 2, 1F1B", "dp_x_pp", "processes",
         lambda: _processes(rig, reference(), dp=2, schedule="1f1b", microbatches=2, **pipe)),
        ("torch: DP x PP 2 x 2, 1F1B", "dp_x_pp", "torch",
         lambda: _processes(rig, reference(), dp=2, schedule="1f1b", microbatches=2, engine="torch", **pipe)),
        ("threads: 1F1B m=4, bf16 weights", "1f1b", "threads",
         lambda: _threads(rig, "1f1b", 4, reference(bf16_weights), bf16_weights)),
        ("processes: 1F1B m=4, bf16 autocast", "1f1b", "processes",
         lambda: _processes(rig, reference(bf16), schedule="1f1b", microbatches=4, autocast="bf16", **pipe)),
        ("processes: 1F1B m=4, fp16 autocast + loss scaling", "1f1b", "processes",
         lambda: _processes(rig, reference(fp16), schedule="1f1b", microbatches=4, autocast="fp16", **pipe)),
        ("processes: ddp, gradients sent in bf16", "ddp", "processes",
         lambda: _processes(rig, reference(), bf16, dp=2, wire="bf16", optimizer="adam")),
        ("processes: ddp, fp16 autocast + loss scaling", "ddp", "processes",
         lambda: _processes(rig, reference(fp16), dp=2, autocast="fp16", optimizer="adam")),
        ("processes: fsdp2, bf16 MixedPrecisionPolicy", "fsdp2", "processes",
         lambda: _processes(rig, reference(bf16), dp=2, data_parallel="fsdp2", autocast="bf16")),
        *[(f"Hugging Face tied GPT-2, padded: {strategy} on {engine}", strategy, engine,
           (lambda strategy=strategy, engine=engine: _hf(rig, strategy, engine, workdir)))
          for strategy, engine in (("1f1b", "threads"), ("1f1b", "processes"), ("gpipe", "torch"),
                                   ("fsdp2", "processes"))],
        *[(f"generation: {engine}", "naive", "threads", (lambda engine=engine: _generation(rig, engine, workdir)))
          for engine in ("layer split", "pipelined requests")],
    ]
    checks = [(name, support(rig, strategy, engine, ranks=4 if strategy == "dp_x_pp" else 2), fn)
              for name, strategy, engine, fn in by_strategy]
    checks.append(("generation: tensor parallel", tensor_parallel_support(rig),
                   lambda: _generation(rig, "tensor parallel", workdir)))
    return checks


def run_check(name: str, verdict: Support, fn: Callable[[], str]) -> Check:
    if not verdict.ok:
        return Check(name, "REFUSED", verdict.reason)
    (check,) = guarded(name, fn)
    return check


def parity_checks(rig: Rig, workdir: str, progress: bool = True,
                  wanted: Callable[[str], bool] = lambda name: True) -> list[Check]:
    checks = []
    for name, verdict, fn in plan_checks(rig, workdir):
        if not wanted(name):
            continue
        checks.append(run_check(name, verdict, fn))
        if progress:
            print(f"  {checks[-1].status:<8} {name}", flush=True)
    if rig.is_cuda:
        if wanted("CUDA paths: event timing, memory panel"):
            checks += guarded("CUDA paths: event timing, memory panel", lambda: _cuda_paths(rig))
    else:
        checks.append(Check("CUDA paths: event timing, copy streams, memory panel", "REFUSED",
                            "no CUDA on this rig: the CPU rig times with the wall clock and counts memory itself"))
    return checks


# --- 5. the take-home scripts, the bench's calibration and a launch of its jobs ------------------------------------

REPO = Path(__file__).resolve().parent.parent
SCRIPT_RUNS = (("train_naive_split.py", 0, ()), ("train_pipeline.py", 2, ("--schedule", "1f1b")),
               ("train_ddp.py", 2, ()), ("train_fsdp2.py", 2, ()), ("train_dp_x_pp.py", 4, ("--pp", "2")),
               ("finetune_lora.py", 2, ("--method", "qlora", "--lora-rank", "4", "--checkpointing")))
LINEAR_BLOCKS = {"finetune_lora.py"}  # scripts that need nn.Linear in the blocks (GPT-2's are Conv1D): a Llama
SCRIPT_TIMEOUT_S = 300  # two steps of a tiny model take 5-15 s: anything near this is a hang
SCRIPT_FLAGS = ("--steps", "2", "--batch", "4", "--seq-len", "16", "--microbatches", "2", "--lr", "1e-3")


def script_check(rig: Rig, script: str, nproc: int, extra: tuple[str, ...], model_dir: str) -> Check:
    """One take-home script, two steps, as a user starts it (torchrun; on the CPU rig with LAB_FORCE_CPU=1). More
    ranks than GPUs: the script's own refusal, before NCCL, is the expected answer."""
    name = f"script: {script}" + (f" on {nproc} ranks" if nproc else "")
    launcher = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--nproc-per-node", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]), TMPDIR=os.path.dirname(model_dir))  # torchrun's temp folders, removed with ours
    if rig.is_cpu:
        env[FORCE_CPU_ENV] = "1"
    cmd = [*launcher, str(REPO / "scripts" / script), "--model", model_dir, *SCRIPT_FLAGS, *extra]
    t0 = time.perf_counter()
    try:
        proc = run_command(cmd, timeout_s=SCRIPT_TIMEOUT_S, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as hung:
        return Check(name, "FAIL", f"no answer in {SCRIPT_TIMEOUT_S} s (its ranks were stopped); it printed:\n"
                     f"{(hung.stdout or '')[-1000:]}\n{(hung.stderr or '')[-2000:]}", time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    losses = [json.loads(line)["loss"] for line in proc.stdout.splitlines() if line.startswith('{"step"')]
    if proc.returncode == 0 and len(losses) == 2 and all(math.isfinite(v) for v in losses):
        said = next((line for line in proc.stdout.splitlines() if line.startswith("naive split:")), "")
        return Check(name, "PASS", f"losses {losses[0]:.4f} -> {losses[1]:.4f}" + (f"; {said}" if said else ""),
                     seconds)
    refusal = next((line for line in proc.stderr.splitlines() if "NCCL needs one GPU per process" in line), None)
    if refusal:
        return Check(name, "REFUSED", refusal.split("): ", 1)[-1], seconds)
    return Check(name, "FAIL", f"exit code {proc.returncode}, losses {losses}\n{proc.stderr[-2000:]}", seconds)


def script_checks(rig: Rig, workdir: str, wanted: Callable[[str], bool] = lambda name: True) -> list[Check]:
    from helpers.models.hf import hf_config, save_hf_model

    runs = [run for run in SCRIPT_RUNS if wanted(f"script: {run[0]}")]
    if not runs:
        return []
    models = {"gpt2": save_hf_model(hf_config("gpt2", 2, 32, 4, 64, 16, tie_embeddings=True), f"{workdir}/gpt2"),
              "llama": save_hf_model(hf_config("llama", 2, 32, 4, 64, 16, kv_heads=2), f"{workdir}/llama")}
    return [c for script, nproc, extra in runs
            for c in guarded(f"script: {script}", lambda a=(script, nproc, extra): script_check(
                rig, *a, models["llama" if a[0] in LINEAR_BLOCKS else "gpt2"].path))]


def calibration_check(rig: Rig) -> str:
    """The bench's calibration in its two ranks (busy-core slowdown, the collectives FSDP2 and ZeRO use, what posting
    a receive costs while both compute): under NCCL it raised on a host tensor and the bench lost its whole run."""
    from helpers.simulate.calibrate import process_calibration

    x, y = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH)
    out = process_calibration(rig, build_stack(CFG), x, y, lm_loss, sizes=[2**12, 2**16], rounds=1, repeats=1)
    return (f"busy-core slowdown {out['ratios'][0]:.2f}x; collectives measured: "
            f"{', '.join(out['collectives']) or 'none'}; a receive posted while both compute: "
            f"{out['receive_post_s'] * 1e3:.2f} ms")


BENCH_LAUNCH = "bench: a launch of its jobs"


def bench_launch_check(rig: Rig) -> Check | str:
    """One launch of the bench's two-rank jobs as the bench runs it (`launch_jobs` with its timer: our 1F1B and DDP,
    then the whole model timed on both ranks at once and a receive's post timed, in the same processes): on GPUs
    the timer's model and micro-batches and the probe's buffers live on each rank's device, which no other check
    runs. The jobs are the bench's own (`two_rank_jobs` of its quick run), those this rig can run."""
    from helpers.bench.rows import default_config, launch_jobs, two_rank_jobs
    from helpers.simulate.calibrate import WholeModelTimer

    config = default_config("quick", rig)
    keys = [k for k in two_rank_jobs(config, rig) if k[:2] in (("1f1b", "ours"), ("ddp", "dp")) and k[-1] != "bf16"]
    if not keys:
        return Check(BENCH_LAUNCH, "REFUSED", "none of the bench's two-rank jobs runs on this rig", 0.0)
    x, y = SyntheticTokens(config.batch, config.cfg.seq_len, config.cfg.vocab).batch(0, config.batch)
    device = rig.devices[0]
    timer = WholeModelTimer(build_stack(config.cfg).to(device), x.to(device), y.to(device), lm_loss)
    results = launch_jobs(keys, config, rig, timer)
    posts = {k: timer.receive_post_s(k) for k in keys}
    if any((posts[k] is not None) != (k[1] != "dp") for k in keys):
        raise AssertionError(f"receive posts timed for the wrong jobs: {posts}")
    return "; ".join(f"{k[0]} step {res.step_s * 1e3:.1f} ms" + (f", a receive posted in {posts[k] * 1e3:.2f} ms"
                                                                  if posts[k] is not None else "")
                     for k, res in zip(keys, results))


# --- 6. each notebook's GPU sizes ----------------------------------------------------------------------------------

def notebook_plan_checks(rig: Rig, wanted: Callable[[str], bool] = lambda name: True) -> list[Check]:
    """Each notebook's plan at its GPU sizes (`helpers.gpu_sizes`, as every notebook declares it and
    data/gpu_plans.json records it for all of them): against this rig's GPUs, or on the CPU rig against two RTX
    3090s and one. FAIL names the notebook, the device and what to lower."""
    from helpers.gpu_sizes import notebook_plans

    targets = [rig] if rig.is_cuda else ["two_gpus", "one_gpu"]
    plans = [notebook_plans(target) for target in targets]
    checks = []
    for per_target in zip(*plans):
        name = f"notebook {per_target[0].notebook}: GPU sizes"
        if not wanted(name):
            continue
        said = "; ".join(f"{p.describe()} of {p.budget / 2**30:.1f} GiB allowed" for p in per_target)
        bad = [p for p in per_target if not p.fits]
        if bad:
            said += "; over: lower " + bad[0].knobs
        checks.append(Check(name, "FAIL" if bad else "PASS", said))
    return checks


# --- the command --------------------------------------------------------------------------------------------------

def report(rig: Rig, sizes: list[int], repeats: int, progress: bool = True, only: tuple[str, ...] = ()) -> dict:
    """Every section, each guarded: a failure is a FAIL row and the rest still runs. `only`: just the checks whose
    name contains one of these words (to recheck one thing after a fix)."""
    import tempfile

    from helpers.training.support import support_rows

    def say(what: str) -> None:
        if progress:
            print(what, flush=True)

    say(rig.describe())
    result: dict = {"topology": {"rig": rig.describe(), "advice": list(rig.advice)}, "links": [], "checks": []}
    checks: list[Check] = []

    def into_topology() -> str:
        result["topology"] = topology(rig)
        return "read"

    def wanted(name: str) -> bool:
        return not only or any(word.lower() in name.lower() for word in only)

    checks += [c for c in guarded("topology", into_topology) if c.status == "FAIL"]
    say("system ...")
    checks += system_checks(rig)
    if wanted("links: point-to-point and all-reduce"):
        say("links ...")

        def into_links() -> list[Check]:
            result["links"] = links(rig, sizes, repeats)
            return []

        checks += guarded("links: point-to-point and all-reduce", into_links)
    with tempfile.TemporaryDirectory(prefix="lab-doctor-") as workdir:
        say("parity checks (one training step against one device):")
        checks += parity_checks(rig, workdir, progress, wanted)
        say("take-home scripts (two steps each) and the bench's calibration ...")
        checks += script_checks(rig, workdir, wanted)
    if wanted("bench: calibration in its ranks"):
        checks += guarded("bench: calibration in its ranks", lambda: calibration_check(rig))
    if wanted(BENCH_LAUNCH):
        checks += guarded(BENCH_LAUNCH, lambda: bench_launch_check(rig))
    say("notebooks' GPU sizes ...")
    checks += guarded("notebooks: GPU sizes", lambda: notebook_plan_checks(rig, wanted))
    result["checks"] = [asdict(c) for c in checks if wanted(c.name) or c.status == "FAIL"]
    result["support"] = support_rows({"this rig": rig})
    return result


def print_report(result: dict) -> None:
    from helpers.report import table

    topo = result["topology"]
    print(f"\n{topo['rig']}\ntorch {topo['torch']}, Python {topo['python']}, {topo['platform']}")
    for key in ("cuda", "nccl", "driver"):
        if topo.get(key):
            print(f"{key}: {topo[key]}")
    for key in ("peer_access", "environment"):
        if topo.get(key):
            print(f"{key}: {topo[key]}")
    for key in ("topo", "nvlink"):
        if topo.get(key):
            print(f"{key}:\n{topo[key]}")
    for line in topo["advice"]:
        print("advice:", line)
    if result["links"]:
        print("\nlinks (fitted: time = latency + bytes / bandwidth):")
        print(table([{k: v for k, v in row.items() if k != "samples"} for row in result["links"]]))
    print("\nchecks:")
    print(table([{"check": c["name"], "status": c["status"], "seconds": c["seconds"],
                  "detail": c["detail"].splitlines()[0][:110] if c["detail"] else ""} for c in result["checks"]]))
    for c in result["checks"]:
        if c["status"] in ("FAIL", "WARN"):
            print(f"\n{c['status']} {c['name']}:\n{c['detail']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the whole report as JSON")
    parser.add_argument("--cpu", action="store_true", help="check the CPU rig even on a GPU machine")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per message size in the link sweep")
    parser.add_argument("--gpu-suite", action="store_true",
                        help="instead of the checks: every notebook's training step at its GPU sizes on one GPU, "
                             "measured peak beside plan (about 10 minutes; on the CPU rig at small sizes)")
    parser.add_argument("--only", default="", help="comma-separated words: run only the checks whose names contain "
                                                   "one of them, e.g. --only script,fsdp2 after fixing something")
    ns = parser.parse_args(argv)
    rig = detect_rig(force_cpu=ns.cpu or None)
    if rig.is_cpu:
        claim_cpu_device(rig)
        os.environ.setdefault(STRICT_ENV, "1")  # ranks and scripts fail here where they would under NCCL
    if ns.gpu_suite:
        from helpers.gpu_sizes.suite import gpu_suite
        from helpers.report import table

        rows = gpu_suite(rig.devices[0])
        print(table(rows))
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    sizes = [2**k for k in range(12, 25, 2)] if rig.is_cpu else [2**k for k in range(12, 29, 2)]
    result = report(rig, sizes, ns.repeats, only=tuple(w.strip() for w in ns.only.split(",") if w.strip()))
    print_report(result)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {ns.json}")
    failed = sum(c["status"] == "FAIL" for c in result["checks"])
    counts = {s: sum(c["status"] == s for c in result["checks"]) for s in ("PASS", "WARN", "FAIL", "REFUSED")}
    print(f"\ndoctor: {counts['PASS']} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL, {counts['REFUSED']} "
          "REFUSED (reasons above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
