"""The paths a long run takes, each once on this rig (the doctor's "long run" rows): FSDP2's CPU offload up to its
end-of-run gather, a synchronous and an asynchronous DCP save loaded back, a take-home script killed and restarted by
torchrun, its `--save-to` folder loaded by transformers, a checkpoint written on the CPU loaded on the GPU,
notebook 13's deterministic resume, and what a GPU holds beyond PyTorch's allocator once NCCL has run (its
communicators' buffers, the CUDA context, the allocator's slack) against the planners' runtime reserve. Tiny models,
two or three steps between saves: seconds each."""
from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from helpers.doctor.checks import Check, guarded
from helpers.doctor.engines import BATCH, CFG
from helpers.doctor.scripts import REPO, SCRIPT_TIMEOUT_S, printed_steps, script_check, script_env
from helpers.models import SyntheticTokens, build_stack, lm_loss
from helpers.runtime.launch import run_command
from helpers.runtime.rig import Rig, cpu_rig
from helpers.training.checkpoint import KILL_ENV, Checkpointer, CheckpointSpec, complete_steps, step_folder

OFFLOAD = "long run: FSDP2 CPU offload, its end gather through the device"
SYNC, ASYNC = "long run: DCP save and load", "long run: DCP async save and load"
KILLED = "long run: a script killed and restarted by torchrun resumes"
SAVE_TO = "long run: --save-to loads with from_pretrained"
CPU_TO_GPU = "long run: a checkpoint written on the CPU loads on the GPU"
NOTEBOOK_13 = "long run: notebook 13's deterministic resume"
RESERVE = "long run: NCCL's buffers and the allocator's slack within the reserve"
EXACT = 0.0  # the loss difference a resume may show, on every rig: a checkpointing run on CUDA is deterministic
# (helpers.training.checkpoint.exact_on), as notebook 13 says; a CPU checkpoint loaded on a GPU is the exception


def beyond_allocator() -> dict[str, int]:
    """A rank's worker (one per GPU): NCCL's first collectives and one training step of the doctor's stack, then
    what the GPU holds outside PyTorch's caching allocator (CUDA context, NCCL's communicator buffers, cuBLAS,
    anything else on the GPU, a desktop included: `mem_get_info` is device-wide) and the allocator's slack (reserved
    beyond the step's allocated peak): what the planners' runtime reserve must cover."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x)
    dist.all_gather([torch.empty_like(x) for _ in range(dist.get_world_size())], x)
    model = build_stack(CFG, device=device)
    inputs, targets = (t.to(device) for t in SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH))
    torch.cuda.reset_peak_memory_stats(device)
    lm_loss(model(inputs), targets).backward()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"outside": total - free - reserved, "slack": reserved - torch.cuda.max_memory_allocated(device)}


def reserve_check(rig: Rig) -> Check:
    """RESERVE on every GPU of the rig (one rank each, NCCL): PASS within the runtime reserve the planners add per
    GPU (one CUDA context plus the allocator margin, data/inference.json), WARN with the excess otherwise."""
    from helpers.runtime.launch import run
    from helpers.sizing.gpus import runtime_reserve_bytes
    from helpers.units import fmt_bytes

    t0, planned = time.perf_counter(), runtime_reserve_bytes(1)
    ranks = run(beyond_allocator, nranks=len(rig.devices), rig=rig, timeout=SCRIPT_TIMEOUT_S)
    worst = max(r["outside"] + r["slack"] for r in ranks)
    said = "; ".join(f"cuda:{i} outside the allocator {fmt_bytes(r['outside'])}, slack {fmt_bytes(r['slack'])}"
                     for i, r in enumerate(ranks))
    if worst > planned:
        return Check(RESERVE, "WARN", f"{said}: {fmt_bytes(worst - planned)} beyond the planners' reserve of "
                                      f"{fmt_bytes(planned)} per GPU; plan with that much less memory per GPU "
                                      "(--gpus 'RTX 3090=...')", time.perf_counter() - t0)
    return Check(RESERVE, "PASS", f"{said}: within the planners' reserve of {fmt_bytes(planned)} per GPU",
                 time.perf_counter() - t0)


def _differs(a: list[float], b: list[float], tolerance: float, what: str) -> float:
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    if diff > tolerance:
        raise AssertionError(f"{what}: losses {a} against {b} (|difference| {diff:.3g} > {tolerance})")
    return diff


# --- in this process: DCP through helpers.training.checkpoint's Checkpointer ---------------------------------------

def _train(device: torch.device, spec: CheckpointSpec, seed: int, last: int,
           load: Path | None = None) -> tuple[list[float], Checkpointer, int]:
    """CFG's stack (weights from `seed`) with Adam on `device`, trained up to step `last`: from the start, saving
    when due, or from the checkpoint `load`."""
    model = build_stack(CFG, seed=seed, device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(spec, model, [optimizer])
    start = ckpt.load(load) if load is not None else 0
    data, losses = SyntheticTokens(BATCH * last, CFG.seq_len, CFG.vocab), []
    for step in range(start, last):
        x, y = (t.to(device) for t in data.batch(step, BATCH))
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if load is None:
            ckpt.after_step(step + 1, last)
    ckpt.close()
    return losses, ckpt, start


def dcp_resume(folder: str, write_on: torch.device, load_on: torch.device, async_save: bool, tolerance: float) -> str:
    """Four steps on `write_on`, saved after steps 2 and 4; the checkpoint of step 2 loaded into a model of other
    weights on `load_on`: its steps 3 and 4 have the uninterrupted run's losses."""
    spec = CheckpointSpec(folder, every=2, async_save=async_save)
    with warnings.catch_warnings():  # DCP's note that it saves and loads in a single process: it is meant to
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        whole, ckpt, _ = _train(write_on, spec, 0, 4)
        resumed, _, start = _train(load_on, replace(spec, async_save=False), 1, 4, load=step_folder(folder, 2))
    if start != 2 or complete_steps(folder) != [2, 4]:
        raise AssertionError(f"resumed at step {start}, complete checkpoints {complete_steps(folder)}")
    diff = _differs(resumed, whole[2:], tolerance, "resumed against uninterrupted")
    return (f"written on {write_on}, loaded on {load_on}: steps 3-4 within {diff:.2g} of the uninterrupted run; "
            f"saves blocked {', '.join(f'{s * 1e3:.0f}' for s in ckpt.blocked)} ms")


# --- processes: a take-home script under torchrun, notebook 13's train() runs --------------------------------------

def killed_script(rig: Rig, workdir: Path, model_dir: str) -> list[Check]:
    """scripts/train_fsdp2.py on one rank under `torchrun --max-restarts 1`, killed after step 5 of 6 (LAB_KILL_AT):
    torchrun restarts it, it resumes from step 3's checkpoint and reprints steps 4 and 5 (the restored weights, then
    the restored optimizer state) with the killed start's losses; its `--save-to` folder loads with transformers."""
    from transformers import AutoModelForCausalLM

    folder, saved = workdir / "killed-ckpt", workdir / "killed-saved"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts",
           "1", str(REPO / "scripts" / "train_fsdp2.py"), "--model", model_dir, "--steps", "6", "--batch", "4",
           "--seq-len", "16", "--lr", "3e-3", "--autocast", "none", "--checkpoint-dir", str(folder),
           "--checkpoint-every", "3", "--save-to", str(saved)]
    t0 = time.perf_counter()
    proc = run_command(cmd, timeout_s=SCRIPT_TIMEOUT_S, env=script_env(rig, str(workdir), **{KILL_ENV: "0:5"}),
                       cwd=REPO)
    t1 = time.perf_counter()
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    printed = printed_steps(proc.stdout)
    restart = max((i for i in range(1, len(printed)) if printed[i]["step"] <= printed[i - 1]["step"]), default=0)
    first, again = ({r["step"]: r["loss"] for r in part} for part in (printed[:restart], printed[restart:]))
    if not (folder / "killed-at-5").exists() or sorted(again) != [3, 4, 5]:
        raise AssertionError(f"not killed after step 5 and resumed from step 3: printed steps {sorted(first)}, then "
                             f"{sorted(again)}\n{proc.stderr[-2000:]}")
    diff = _differs([again[3], again[4]], [first[3], first[4]], EXACT, "restarted against killed start")
    killed = Check(KILLED, "PASS", f"resumed from step 3 after torchrun's restart; steps 4-5 within {diff:.2g} of "
                                   "the killed start's", t1 - t0)
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(8)[None]).logits
    if not torch.isfinite(logits).all():
        raise AssertionError(f"{saved} loads, but its logits are not finite")
    size = sum(p.numel() for p in model.parameters())
    return [killed, Check(SAVE_TO, "PASS", f"{type(model).__name__} of {size:,} parameters from {saved.name}/",
                          time.perf_counter() - t1)]


def notebook_13(rig: Rig, workdir: Path, model_dir: str) -> str:
    """Notebook 13's runs at small size: FSDP2 over two ranks (the CPU rig where this rig cannot run it), once
    uninterrupted and once with rank 1 killed after step 3 and every rank restarted (`restarts=1`): the restarted
    run resumes from step 2's checkpoint with the uninterrupted run's losses."""
    from helpers.training import train
    from helpers.training.support import support

    ranks = rig if support(rig, "fsdp2", "processes").ok else cpu_rig()
    run = dict(steps=5, batch=4, seq_len=16, microbatches=1, lr=3e-3, rig=ranks, timeout=SCRIPT_TIMEOUT_S)
    whole = train(model_dir, "fsdp2", "processes", checkpoint=CheckpointSpec(str(workdir / "nb13-whole"), every=2),
                  **run)  # checkpointed too, so deterministic on CUDA as the resumed run is
    os.environ[KILL_ENV] = "1:3"
    try:
        killed = train(model_dir, "fsdp2", "processes", checkpoint=CheckpointSpec(str(workdir / "nb13"), every=2),
                       restarts=1, **run)
    finally:
        del os.environ[KILL_ENV]
    if killed.first_step != 2 or not (workdir / "nb13" / "killed-at-3").exists():
        raise AssertionError(f"rank 1 not killed after step 3, or resumed from step {killed.first_step}, not 2")
    diff = _differs(killed.losses, whole.losses[2:], EXACT, "resumed against uninterrupted")
    return f"{ranks.kind} rig, two ranks: resumed from step 2, steps 3-5 within {diff:.2g}"


def long_run_checks(rig: Rig, workdir: str, wanted: Callable[[str], bool] = lambda name: True) -> list[Check]:
    """Every long-run row `wanted` keeps; REFUSED with the reason where this rig cannot run one."""
    from helpers.models.hf import hf_config, save_hf_model

    root, device = Path(workdir) / "long-runs", rig.devices[0]
    checks = []
    root.mkdir(parents=True, exist_ok=True)
    for name, async_save, folder in ((SYNC, False, "sync"), (ASYNC, True, "async")):
        if wanted(name):
            checks += guarded(name, lambda a=async_save, f=folder: dcp_resume(
                str(root / f), device, device, a, EXACT))
    if wanted(CPU_TO_GPU):
        checks += [Check(CPU_TO_GPU, "REFUSED", "needs a GPU: this rig writes and loads on its CPU (the DCP rows)")
                   ] if not rig.is_cuda else guarded(CPU_TO_GPU, lambda: dcp_resume(
                       str(root / "cpu-to-gpu"), torch.device("cpu"), device, False, 1e-4))
    if wanted(RESERVE):
        checks += [Check(RESERVE, "REFUSED", "needs a GPU: on the CPU rig a rank's device is host memory, with no "
                                             "CUDA context or NCCL buffers beside the allocator")
                   ] if not rig.is_cuda else guarded(RESERVE, lambda: reserve_check(rig))
    if not any(wanted(name) for name in (OFFLOAD, KILLED, SAVE_TO, NOTEBOOK_13)):
        return checks
    model = save_hf_model(hf_config("llama", 2, 32, 4, 64, 16, kv_heads=2), root / "llama").path
    if wanted(OFFLOAD):  # LoRA's script, the one with --offload: one rank on a GPU (world 1 under NCCL reaches the
        # gather of the adapters' offloaded shards), two on the CPU rig (strict ranks refuse a gather of host memory)
        nproc = 2 if rig.is_cpu else min(2, len(rig.devices))
        checks += [replace(c, name=OFFLOAD) for c in guarded(OFFLOAD, lambda: script_check(
            rig, "finetune_lora.py", nproc, ("--method", "lora", "--lora-rank", "4", "--offload", "cpu"), model))]
    if wanted(KILLED) or wanted(SAVE_TO):
        checks += guarded(KILLED, lambda: killed_script(rig, root, model))
    if wanted(NOTEBOOK_13):
        checks += guarded(NOTEBOOK_13, lambda: notebook_13(rig, root, model))
    return checks
