"""What a user runs beside the library (the doctor's sections 5 and 6): the take-home scripts, two steps each under
torchrun; the bench's calibration and a launch of its jobs, in their ranks; each notebook's GPU sizes against this
rig's memory."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from helpers.doctor.engines import BATCH, CFG
from helpers.doctor.checks import Check, guarded
from helpers.models import SyntheticTokens, build_stack, lm_loss
from helpers.runtime.launch import run_command
from helpers.runtime.rig import FORCE_CPU_ENV, Rig


# --- 5. the take-home scripts, the bench's calibration and a launch of its jobs ------------------------------------

REPO = Path(__file__).resolve().parents[2]
SCRIPT_RUNS = (("train_naive_split.py", 0, ()), ("train_pipeline.py", 2, ("--schedule", "1f1b")),
               ("train_ddp.py", 2, ()), ("train_fsdp2.py", 2, ()), ("train_dp_x_pp.py", 4, ("--pp", "2")),
               ("finetune_lora.py", 2, ("--method", "qlora", "--lora-rank", "4", "--checkpointing")),
               ("train_deepspeed.py", 2, ("--stage", "3", "--offload", "cpu")))
# the Llama-3-8B full fine-tune's flags (scripts/train_fsdp2.py's docstring) plus activation offload: torchao's 4-bit
# AdamW stepped in backward on each rank's shards, the chunked loss, pinned host copies of what autograd saves
MEMORY_RUN = ("train_fsdp2.py", 2, ("--microbatches", "1", "--dtype", "bf16", "--autocast", "none", "--optimizer",
                                    "adamw-4bit", "--technique", "optimizer-in-backward,chunked-loss,activation-offload"))
LINEAR_BLOCKS = {"finetune_lora.py"}  # scripts that need nn.Linear in the blocks (GPT-2's are Conv1D): a Llama
SCRIPT_TIMEOUT_S = 300  # two steps of a tiny model take 5-15 s: anything near this is a hang
SCRIPT_FLAGS = ("--steps", "2", "--batch", "4", "--seq-len", "16", "--microbatches", "2", "--lr", "1e-3")


def script_env(rig: Rig, tmpdir: str, **extra: str) -> dict[str, str]:
    """The environment a take-home script runs in: one thread per rank, this repository importable, torchrun's temp
    folders in `tmpdir` (removed with ours), LAB_FORCE_CPU=1 on the CPU rig; and `extra`."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]), TMPDIR=tmpdir, **extra, **({FORCE_CPU_ENV: "1"} if rig.is_cpu else {}))


def printed_steps(stdout: str) -> list[dict]:
    """The lines a take-home script prints per step (`{"step": ..., "loss": ...}`), parsed."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"step"')]


def script_check(rig: Rig, script: str, nproc: int, extra: tuple[str, ...], model_dir: str) -> Check:
    """One take-home script, two steps, as a user starts it (torchrun; on the CPU rig with LAB_FORCE_CPU=1). More
    ranks than GPUs: the script's own refusal, before NCCL, is the expected answer."""
    name = (f"script: {script}" + (" with the memory techniques" if "--technique" in extra else "")
            + (f" on {nproc} ranks" if nproc else ""))
    if script == "train_deepspeed.py":
        from helpers.training.deepspeed_zero import missing

        if missing():  # an optional install: said, not failed
            return Check(name, "REFUSED", missing(), 0.0)
    launcher = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--nproc-per-node", str(nproc)]
    cmd = [*launcher, str(REPO / "scripts" / script), "--model", model_dir, *SCRIPT_FLAGS, *extra]
    t0 = time.perf_counter()
    try:
        proc = run_command(cmd, timeout_s=SCRIPT_TIMEOUT_S, env=script_env(rig, os.path.dirname(model_dir)), cwd=REPO)
    except subprocess.TimeoutExpired as hung:
        return Check(name, "FAIL", f"no answer in {SCRIPT_TIMEOUT_S} s (its ranks were stopped); it printed:\n"
                     f"{(hung.stdout or '')[-1000:]}\n{(hung.stderr or '')[-2000:]}", time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    losses = [printed["loss"] for printed in printed_steps(proc.stdout)]
    if proc.returncode == 0 and len(losses) == 2 and all(math.isfinite(v) for v in losses):
        said = next((line for line in proc.stdout.splitlines() if line.startswith("naive split:")), "")
        return Check(name, "PASS", f"losses {losses[0]:.4f} -> {losses[1]:.4f}" + (f"; {said}" if said else ""),
                     seconds)
    refusal = next((line for line in proc.stderr.splitlines() if "NCCL needs one GPU per process" in line), None)
    if refusal:
        return Check(name, "REFUSED", refusal.split("): ", 1)[-1], seconds)
    return Check(name, "FAIL", f"exit code {proc.returncode}, losses {losses}\n{proc.stderr[-2000:]}", seconds)


def script_checks(rig: Rig, workdir: str, wanted: Callable[[str], bool] = lambda name: True) -> list[Check]:
    """Every script of SCRIPT_RUNS that `wanted` keeps, on a small GPT-2 (a Llama where it needs nn.Linear) saved
    in `workdir`."""
    from helpers.models.hf import hf_config, save_hf_model

    runs = [run for run in (*SCRIPT_RUNS, MEMORY_RUN) if wanted(f"script: {run[0]}")]
    if not runs:
        return []
    models = {"gpt2": save_hf_model(hf_config("gpt2", 2, 32, 4, 64, 16, tie_embeddings=True), f"{workdir}/gpt2"),
              "llama": save_hf_model(hf_config("llama", 2, 32, 4, 64, 16, kv_heads=2), f"{workdir}/llama"),
              # wide enough that each rank's MLP shards are whole blocks of 4096+ numbers: quantized by torchao
              "wide llama": save_hf_model(hf_config("llama", 2, 128, 4, 256, 16, kv_heads=2), f"{workdir}/wide")}
    model_for = lambda script, extra: ("wide llama" if "--technique" in extra  # noqa: E731
                                       else "llama" if script in LINEAR_BLOCKS else "gpt2")
    return [c for script, nproc, extra in runs
            for c in guarded(f"script: {script}", lambda a=(script, nproc, extra): script_check(
                rig, *a, models[model_for(a[0], a[2])].path))]


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
    """One launch of the bench's two-rank jobs as the bench runs it (`launch_jobs` with its timer: our 1F1B, DDP and
    FSDP2, then the whole model timed on both ranks at once, a receive's post and FSDP2's host work timed, in the same
    processes): on GPUs the timer's model and micro-batches and the probes' buffers live on each rank's device, which
    no other check runs. The jobs are the bench's own (`two_rank_jobs` of its quick run), those this rig can run."""
    from helpers.bench.blocks import model_and_batch
    from helpers.bench.jobs import default_config, two_rank_jobs
    from helpers.bench.rows import launch_jobs
    from helpers.simulate.calibrate_model import WholeModelTimer

    config = default_config("quick", rig)
    jobs = [job for job in two_rank_jobs(config, rig) if job.strategy in ("1f1b", "ddp", "fsdp2")
            and job.engine == "ours" and job.wire == "auto"]
    if not jobs:
        return Check(BENCH_LAUNCH, "REFUSED", "none of the bench's two-rank jobs runs on this rig", 0.0)
    timer = WholeModelTimer(*model_and_batch(config.cfg, config.batch, rig.devices[0]), lm_loss)
    results = launch_jobs(jobs, config, rig, timer)
    said = {"receive_post_s": "a receive posted in", "fsdp2_host_s": "FSDP2's host work per collective"}
    readings = {job: {name: timer.launch_reading(name, job) for name in said} for job in jobs}
    for job in jobs:  # each reading timed for the jobs it prices, and for no other
        wanted = {"receive_post_s": job.pp > 1, "fsdp2_host_s": job.fully_sharded}
        if any((readings[job][name] is not None) != wanted[name] for name in said):
            raise AssertionError(f"launch readings timed for the wrong jobs: {job.strategy} got {readings[job]}")
    return "; ".join(f"{job.strategy} step {res.step_s * 1e3:.1f} ms" + "".join(
        f", {said[name]} {value * 1e3:.2f} ms" for name, value in readings[job].items() if value is not None)
        for job, res in zip(jobs, results))


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


