"""Exact resume, for every strategy the course trains: N steps uninterrupted; the same run again, one rank killed by
SIGKILL at a random step after a checkpoint, every rank restarted (the course's launcher's `restarts=1`, torchrun's
`--max-restarts=1`) and resumed from the latest complete checkpoint: the losses from the checkpoint on equal the
uninterrupted run's bit for bit (device-strict ranks: conftest). Then what a checkpoint of two ranks becomes: one
process continues it, a pipeline's loads into the unsplit model, and it exports as a Hugging Face folder."""
import os
import random
import re
import sys
from pathlib import Path

import pytest

from helpers.models import StackConfig
from helpers.runtime.launch import run_command
from helpers.runtime.rig import cpu_rig
from helpers.training.checkpoint import KILL_ENV, CheckpointSpec, complete_steps
from helpers.training.job import TrainJob
from helpers.training.loop import run_training, run_trainings

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
STEPS = 4  # timed steps: the loop runs STEPS + 2
EVERY = 2
FULL = pytest.mark.full

STACK_JOBS = {
    "ddp": dict(dp=2, data_parallel="ddp"),
    "zero1": dict(dp=2, data_parallel="zero1"),
    "zero2": dict(dp=2, data_parallel="zero2"),
    "fsdp2": dict(dp=2, data_parallel="fsdp2", microbatches=2),
    "fsdp2-fp16-async": dict(dp=2, data_parallel="fsdp2", autocast="fp16"),
    "gpipe": dict(pp=2, schedule="gpipe", microbatches=4),
    "1f1b": dict(pp=2, schedule="1f1b", microbatches=4),
    "1f1b-torch": dict(pp=2, schedule="1f1b", microbatches=4, engine="torch"),
    "interleaved": dict(pp=2, schedule="interleaved", microbatches=4),
    "zbh1": dict(pp=2, schedule="zbh1", microbatches=4),
    "zbv": dict(pp=2, schedule="zbv", microbatches=4),
    "dualpipev": dict(pp=2, schedule="dualpipev", microbatches=4),
    "dp_x_pp": dict(dp=2, pp=2, schedule="1f1b", microbatches=2),
}


def stack_job(name: str) -> TrainJob:
    return TrainJob(CFG, batch=8, steps=STEPS, optimizer="adam", **STACK_JOBS[name])


@pytest.fixture(scope="module")
def uninterrupted():
    """Every two-rank case's uninterrupted run, one after the other in one launch (one start-up for all)."""
    names = [n for n in STACK_JOBS if stack_job(n).world == 2]
    return dict(zip(names, run_trainings([stack_job(n) for n in names], cpu_rig(), oversubscribe=True)))


def killed_and_resumed(job: TrainJob, folder: Path, name: str, async_save: bool = False):
    """`job` checkpointed every EVERY steps with one rank (chosen at random, seeded by the case) killed at a random
    step after the first checkpoint and every rank restarted; the resumed run."""
    chance = random.Random(name)
    rank, step = chance.randrange(job.world), chance.randrange(EVERY + 1, STEPS + 3)
    spec = CheckpointSpec(str(folder), every=EVERY, async_save=async_save)
    os.environ[KILL_ENV] = f"{rank}:{step}"
    try:
        resumed = run_training(TrainJob(**{**job.__dict__, "checkpoint": spec}), cpu_rig(), oversubscribe=True,
                               restarts=1)
    finally:
        del os.environ[KILL_ENV]
    assert (folder / f"killed-at-{step}").exists(), "the rank was not killed"
    assert resumed.first_step % EVERY == 0 and resumed.first_step >= (EVERY if not async_save else 0)
    assert complete_steps(folder)[-1] == STEPS + 2
    return resumed


def max_loss_difference(whole, resumed) -> float:
    pairs = list(zip(whole.losses[resumed.first_step:], resumed.losses, strict=True))
    return max(abs(a - b) for a, b in pairs)


@FULL
@pytest.mark.parametrize("name", list(STACK_JOBS))
def test_killed_rank_restarted_resumes_bit_for_bit(tmp_path, name, uninterrupted):
    job = stack_job(name)
    whole = uninterrupted.get(name) or run_training(job, cpu_rig(), oversubscribe=True)
    resumed = killed_and_resumed(job, tmp_path / "ckpt", name, async_save=name.endswith("async"))
    assert resumed.losses == whole.losses[resumed.first_step:], max_loss_difference(whole, resumed)


@FULL
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_and_qlora_resume_bit_for_bit_from_their_adapters(tmp_path, method):
    from helpers.finetune.lora import LoraModel, LoraSpec, small_llama
    from torch.distributed.checkpoint import FileSystemReader

    base = small_llama(tmp_path / "base", vocab=128, seq_len=16, n_layers=2, hidden=64)
    lora = LoraModel(base, LoraSpec(method=method, rank=4, init="random"))
    job = TrainJob(lora, dp=2, data_parallel="fsdp2", batch=4, seq_len=16, steps=STEPS, optimizer="adam",
                   checkpointing=True)
    whole = run_training(job, cpu_rig(), oversubscribe=True)
    resumed = killed_and_resumed(job, tmp_path / "ckpt", method)
    assert resumed.losses == whole.losses[resumed.first_step:], max_loss_difference(whole, resumed)
    saved = FileSystemReader(str(tmp_path / "ckpt" / f"step-{STEPS + 2:08d}")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights), "a LoRA checkpoint holds the adapters alone"


@FULL
def test_torchrun_max_restarts_resumes_bit_for_bit(tmp_path):
    """torchrun --max-restarts=1 restarts both workers after one is killed; they resume from the checkpoint."""
    import json

    fields = dict(dp=2, data_parallel="fsdp2", batch=8, steps=STEPS, optimizer="adam")
    whole = run_training(TrainJob(StackConfig(hidden=64, n_blocks=4, heads=2), **fields), cpu_rig(),
                         oversubscribe=True)
    kwargs = {**fields, "checkpoint": {"folder": str(tmp_path / "ckpt"), "every": EVERY}}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "-m", "helpers.runtime.launch", "helpers.training.loop:torchrun_job", "--kwargs", json.dumps(kwargs)]
    env = dict(os.environ, OMP_NUM_THREADS="1", LAB_FORCE_CPU="1", GLOO_SOCKET_IFNAME="lo",
               TMPDIR=str(tmp_path), **{KILL_ENV: "1:3"})  # torchrun's temp folders in the test's
    proc = run_command(cmd, timeout_s=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "ckpt" / "killed-at-3").exists()
    first, losses = re.search(r"losses from step (\d+): (\[.*\])", proc.stdout).groups()
    assert int(first) == EVERY
    assert json.loads(losses) == whole.losses[EVERY:]
