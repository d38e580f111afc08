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
import torch

from helpers.models import StackConfig
from helpers.runtime.launch import run_command
from helpers.runtime.rig import cpu_rig
from helpers.training.checkpoint import KILL_ENV, CheckpointSpec, complete_steps
from helpers.training.job import TrainJob
from helpers.training.loop import run_training, run_trainings

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
STEPS = 4  # timed steps: the loop runs STEPS + 2 optimizer steps
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
    return TrainJob(CFG, batch=8, timed_steps=STEPS, optimizer="adam", **STACK_JOBS[name])


@pytest.fixture(scope="module")
def uninterrupted():
    """Every two-rank case's uninterrupted run, one after the other in one launch (one start-up for all)."""
    names = [n for n in STACK_JOBS if stack_job(n).world == 2]
    return dict(zip(names, run_trainings([stack_job(n) for n in names], cpu_rig(), oversubscribe=True)))


def killed_and_resumed(job: TrainJob, folder: Path, name: str, async_save: bool = False):
    """`job` checkpointed every EVERY steps with one rank (chosen at random, seeded by the case) killed at a random
    step after the first checkpoint and every rank restarted; the resumed run."""
    chance = random.Random(name)
    rank, step = chance.randrange(job.world), chance.randrange(EVERY + 1, STEPS + 2)  # a step left to compare
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
    job = TrainJob(lora, dp=2, data_parallel="fsdp2", batch=4, seq_len=16, timed_steps=STEPS, optimizer="adam",
                   checkpointing=True)
    whole = run_training(job, cpu_rig(), oversubscribe=True)
    resumed = killed_and_resumed(job, tmp_path / "ckpt", method)
    assert resumed.losses == whole.losses[resumed.first_step:], max_loss_difference(whole, resumed)
    saved = FileSystemReader(str(tmp_path / "ckpt" / f"step-{STEPS + 2:08d}")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights), "a LoRA checkpoint holds the adapters alone"
    # continued on one device, exported merged (a plain model) and as the adapters alone (for peft)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers.finetune.lora import base_for_merge
    from helpers.training.export import export_hf, load_on_one

    one = load_on_one(job, tmp_path / "ckpt" / f"step-{STEPS + 2:08d}")
    x = torch.randint(128, (2, 16), device="cpu")
    ours = _logits(one.layers, lora, x)
    merged = AutoModelForCausalLM.from_pretrained(export_hf(lora, one.layers, tmp_path / "merged")).eval()
    adapted = PeftModel.from_pretrained(base_for_merge(lora), str(export_hf(lora, one.layers, tmp_path / "adapters",
                                                                            merge=False))).eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, ours, atol=1e-4)
        assert torch.allclose(adapted(input_ids=x).logits, ours, atol=1e-5)


@FULL
def test_torchrun_max_restarts_resumes_bit_for_bit(tmp_path):
    """torchrun --max-restarts=1 restarts both workers after one is killed; they resume from the checkpoint."""
    import json

    fields = dict(dp=2, data_parallel="fsdp2", batch=8, timed_steps=STEPS, optimizer="adam")
    whole = run_training(TrainJob(StackConfig(hidden=64, n_blocks=4, heads=2), **fields), cpu_rig(),
                         oversubscribe=True)
    kwargs = {**fields, "checkpoint": {"folder": str(tmp_path / "ckpt"), "every": EVERY}}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "-m", "helpers.runtime.launch", "helpers.training.loop:torchrun_job", "--kwargs", json.dumps(kwargs)]
    proc = run_command(cmd, timeout_s=300, env=torchrun_env(tmp_path, **{KILL_ENV: "1:3"}))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "ckpt" / "killed-at-3").exists()
    first, losses = re.search(r"losses from step (\d+): (\[.*\])", proc.stdout).groups()
    assert int(first) == EVERY
    assert json.loads(losses) == whole.losses[EVERY:]


def torchrun_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a torchrun test: CPU ranks of one thread, gloo on loopback, torchrun's temp folders in the
    test's."""
    return dict(os.environ, OMP_NUM_THREADS="1", LAB_FORCE_CPU="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp), **extra)


@FULL
def test_workers_torchrun_restarts_never_read_the_killed_workers_addresses(tmp_path):
    """The cause of the torchrun restarts' flake (helpers.runtime.launch.round_store): torchrun's agent keeps one store
    for every start of the workers, so a restarted rank that joins a group before its peer read the killed start's
    address of that peer ("Connection refused" in gloo's connectFullMesh, or a hang). Here rank 0 joins 2 s late
    after the restart: deterministic on the old code, which fails (or hangs past the timeout) every time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "-m", "helpers.runtime.launch", "tests.workers:regroup_after_a_restart", "--args", "[2.0]"]
    proc = run_command(cmd, timeout_s=90, env=torchrun_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.split() == ["1"], proc.stdout  # rank 0's result: it ran on the restart


def _logits(layers, model, x):
    from helpers.models.layered import Stage

    ctx = model.context(x, None)
    with torch.no_grad():
        return Stage(layers).eval()(x, ctx) if ctx is not None else Stage(layers).eval()(x)


@FULL
@pytest.mark.parametrize("kw", [dict(dp=2, data_parallel="fsdp2"), dict(pp=2, schedule="1f1b", microbatches=4)],
                         ids=["fsdp2", "1f1b"])
def test_two_ranks_checkpoint_continues_on_one_and_exports_to_transformers(tmp_path, kw):
    """FSDP2's shards, or a pipeline's stages, load into the whole model in one process (DCP reshards): training
    goes on from the checkpoint's step with the ranks' losses (one device sums in another order: 1e-5), and the
    result exports as a folder AutoModelForCausalLM loads with the same logits."""
    from transformers import AutoModelForCausalLM

    from helpers.models.hf import hf_config, save_hf_model
    from helpers.training.checkpoint import step_folder
    from helpers.training.export import continue_on_one, export_hf

    hf = save_hf_model(hf_config("llama", n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16),
                       tmp_path / "base")
    job = TrainJob(hf, batch=8, seq_len=16, timed_steps=STEPS, optimizer="adam", **kw,
                   checkpoint=CheckpointSpec(str(tmp_path / "ckpt"), every=EVERY))
    ranks = run_training(job, cpu_rig(), oversubscribe=True)
    one = continue_on_one(job, step_folder(tmp_path / "ckpt", STEPS), steps=2)
    assert one.first_step == STEPS
    assert max(abs(a - b) for a, b in zip(one.losses, ranks.losses[STEPS:], strict=True)) < 1e-5
    export_hf(hf, one.layers, tmp_path / "exported")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    x = torch.randint(64, (2, 16), device="cpu")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, _logits(one.layers, hf, x))


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script_losses(script: str, model_dir: Path, tmp: Path, *extra: str, kill: str | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", str(SCRIPTS / script), "--model", str(model_dir), "--steps", "6", "--batch", "8", "--seq-len", "16",
           "--lr", "3e-3", "--autocast", "none", *extra]
    proc = run_command(cmd, timeout_s=300, cwd=SCRIPTS.parent, env=torchrun_env(tmp, **({KILL_ENV: kill} if kill else {})))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import json

    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"step"')]


@FULL
@pytest.mark.parametrize("script, extra", [("finetune_lora.py", ["--method", "qlora"]),
                                           ("train_fsdp2.py", []),
                                           ("train_pipeline.py", ["--schedule", "1f1b"])])
def test_scripts_resume_under_torchrun_max_restarts(tmp_path, script, extra):
    """The take-home scripts with --checkpoint-dir: a worker killed after step 3, torchrun restarts both, they
    resume from step 2's checkpoint and print the uninterrupted run's losses."""
    from helpers.models.hf import hf_config, save_hf_model

    model_dir = tmp_path / "llama"
    save_hf_model(hf_config("llama", n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=64, seq_len=16), model_dir)
    whole = _script_losses(script, model_dir, tmp_path, *extra)
    folder = tmp_path / "ckpt"
    resumed = _script_losses(script, model_dir, tmp_path, *extra, "--checkpoint-dir", str(folder),
                             "--checkpoint-every", "2", kill="1:3")
    assert (folder / "killed-at-3").exists() and complete_steps(folder) == [4, 6]
    restart = max(i for i in range(1, len(resumed)) if resumed[i]["step"] <= resumed[i - 1]["step"])
    after = {r["step"]: r["loss"] for r in resumed[restart:]}  # what the restarted workers printed
    assert min(after) == 2
    assert after == {r["step"]: r["loss"] for r in whole if r["step"] >= 2}


@FULL
def test_two_torchrun_agents_as_two_nodes_resume_after_a_killed_worker(tmp_path):
    """Multi-node torchrun on the loopback address: two agents (`--nnodes 2`, c10d rendezvous), one rank each; one
    agent's worker is killed after a checkpoint, the agents restart both workers together and they resume."""
    import json
    import subprocess

    from helpers.runtime.launch import free_port

    fields = dict(dp=2, data_parallel="fsdp2", batch=8, timed_steps=STEPS, optimizer="adam")
    whole = run_training(TrainJob(StackConfig(hidden=64, n_blocks=4, heads=2), **fields), cpu_rig(),
                         oversubscribe=True)
    kwargs = {**fields, "checkpoint": {"folder": str(tmp_path / "ckpt"), "every": EVERY}}
    port = free_port()
    env = torchrun_env(tmp_path, **{KILL_ENV: "1:3"})
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                "1", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "-m", "helpers.runtime.launch",
                                "helpers.training.loop:torchrun_job", "--kwargs", json.dumps(kwargs)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=300) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, out[-2000:] + err[-4000:]
    assert (tmp_path / "ckpt" / "killed-at-3").exists()
    printed = "".join(out for out, _ in outputs)
    first, losses = re.search(r"losses from step (\d+): (\[.*\])", printed).groups()
    assert int(first) == EVERY
    assert json.loads(losses) == whole.losses[EVERY:]
