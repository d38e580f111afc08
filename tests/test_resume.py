"""Exact resume, for every strategy the course trains: N steps uninterrupted; the same run again, one rank killed by
SIGKILL at a random step after a checkpoint, every rank restarted (the course's launcher's `restarts=`, torchrun's
`--max-restarts=1`) and resumed from the latest complete checkpoint: the losses from the checkpoint on equal the
uninterrupted run's bit for bit (device-strict ranks: conftest). Then what a checkpoint of two ranks becomes: one
process continues it, a pipeline's loads into the unsplit model, and it exports as a Hugging Face folder.

What it costs is mostly process start-ups, so the two-rank runs of the file share two launches of the course's
launcher, one start-up each plus one restart per kill: the block stacks' (every strategy's uninterrupted and killed
run, the torchrun cases' reference: `stack_runs`) and the Hugging Face models' (LoRA, QLoRA, the runs continued on
one process: `hf_runs`, whose ranks import transformers and peft)."""
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.models import StackConfig
from helpers.runtime.launch import free_port, run, run_command
from helpers.runtime.rig import cpu_rig
from helpers.training.checkpoint import KILL_ENV, CheckpointSpec, complete_steps, step_folder
from helpers.training.job import TrainJob
from helpers.training.loop import TrainResult, combine_ranks
from tests.workers import trainings_resumed_after_kills

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
STEPS = 4  # timed steps: the loop runs STEPS + 2 optimizer steps, checkpointed after steps 2, 4 and 6
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
LORA_METHODS = ("lora", "qlora")
ON_ONE = {"fsdp2": dict(dp=2, data_parallel="fsdp2"), "1f1b": dict(pp=2, schedule="1f1b", microbatches=4)}
TORCHRUN_FIELDS = dict(dp=2, data_parallel="fsdp2", batch=8, timed_steps=STEPS, optimizer="adam")


def stack_job(name: str) -> TrainJob:
    return TrainJob(CFG, batch=8, timed_steps=STEPS, optimizer="adam", **STACK_JOBS[name])


def lora_job(base, method: str) -> TrainJob:
    from helpers.finetune.lora import LoraModel, LoraSpec

    return TrainJob(LoraModel(base, LoraSpec(method=method, rank=4, init="random")), dp=2, data_parallel="fsdp2",
                    batch=4, seq_len=16, timed_steps=STEPS, optimizer="adam", activation_checkpointing=True)


def on_one_job(hf, name: str, folder: Path) -> TrainJob:
    return TrainJob(hf, batch=8, seq_len=16, timed_steps=STEPS, optimizer="adam", **ON_ONE[name],
                    checkpoint=CheckpointSpec(str(folder), every=EVERY))


def kill_at(name: str, world: int) -> tuple[int, int]:
    """The rank to kill and the step after which it dies, drawn at random (seeded by the case): any rank, rank 0 (the
    checkpoints' coordinator) as often as the others; any step after the first checkpoint is surely complete (a
    later save has begun, which waits for the one before) and before the last: with STEPS = 4, step 4 (its save just
    begun, in flight when async) or 5 (between saves). The restart resumes from step 2 or 4 and the steps compared
    test the restored weights, then the restored optimizer state."""
    chance = random.Random(f"kill {name}")
    return chance.randrange(world), chance.randrange(2 * EVERY, STEPS + 2)


def test_the_kills_cover_every_rank_and_step_of_each_kind():
    """The draw (`kill_at`) kills rank 0 and another rank, after a save's start and between saves, in each kind of
    run: data parallel (rank 0 coordinates the checkpoint), pipelines, the fine-tunes; the async run while a save is
    in flight."""
    kinds = {"data parallel": [n for n, f in STACK_JOBS.items() if f.get("pp", 1) == 1],
             "pipeline": [n for n, f in STACK_JOBS.items() if f.get("pp", 1) > 1], "fine-tune": list(LORA_METHODS)}
    for kind, names in kinds.items():
        draws = [kill_at(name, 2) for name in names]
        assert {rank for rank, _ in draws} == {0, 1} and {step for _, step in draws} == {2 * EVERY, 2 * EVERY + 1}, kind
    assert all(kill_at(n, 2)[1] % EVERY == 0 for n in STACK_JOBS if n.endswith("async"))


def with_checkpoints(job: TrainJob, folder: Path, async_save: bool = False) -> TrainJob:
    return TrainJob(**{**job.__dict__, "checkpoint": CheckpointSpec(str(folder), every=EVERY, async_save=async_save)})


def launch(runs: dict[str, tuple[TrainJob, str | None]], world: int, results: Path) -> dict[str, TrainResult]:
    """Every run (name: (job, LAB_KILL_AT or None)) in one launch of the course's launcher, one restart per kill
    (tests.workers.trainings_resumed_after_kills): each killed run is resumed by restarted ranks."""
    results.mkdir(parents=True)
    kills = sum(kill is not None for _, kill in runs.values())
    parts = run(trainings_resumed_after_kills, list(runs.values()), str(results), nranks=world, rig=cpu_rig(),
                oversubscribe=True, restarts=kills, timeout=900)
    return {name: combine_ranks([rank[i] for rank in parts]) for i, name in enumerate(runs)}


def killed_runs(names, jobs, root: Path) -> dict[str, tuple[TrainJob, str]]:
    """The checkpointed run of each job, with its kill (`kill_at`), under `root/NAME`."""
    runs = {}
    for name, job in zip(names, jobs):
        rank, step = kill_at(name, job.world)
        runs[f"{name}/killed"] = (with_checkpoints(job, root / name, async_save=name.endswith("async")),
                                  f"{rank}:{step}")
    return runs


@pytest.fixture(scope="module")
def stack_runs(tmp_path_factory):
    """Every two-rank run of a block stack in one launch: each strategy's uninterrupted run and the torchrun tests'
    fsdp2 reference first, then each strategy's killed run (ranks that import torch and helpers alone: a restart
    costs seconds). Returns (name -> TrainResult, the folder of the checkpoints)."""
    root = tmp_path_factory.mktemp("stack")
    jobs = {name: stack_job(name) for name in STACK_JOBS if stack_job(name).world == 2}
    runs = {f"{name}/whole": (job, None) for name, job in jobs.items()}
    runs["torchrun/whole"] = (TrainJob(StackConfig(hidden=64, n_blocks=4, heads=2), **TORCHRUN_FIELDS), None)
    runs.update(killed_runs(jobs, jobs.values(), root / "ckpt"))
    return launch(runs, 2, root / "results"), root / "ckpt"


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """The Hugging Face models' two-rank runs in a launch of their own (each start of ranks that unpickle them
    imports transformers and peft, several seconds): LoRA's and QLoRA's uninterrupted runs, the checkpointed runs
    continued on one process, then LoRA's and QLoRA's killed runs. Returns (name -> TrainResult, the folder of the
    checkpoints, the LoRA base model, the Hugging Face model)."""
    from helpers.finetune.lora import small_llama
    from helpers.models.hf import hf_config, save_hf_model

    root = tmp_path_factory.mktemp("hf")
    base = small_llama(root / "base", vocab=128, seq_len=16, n_layers=2, hidden=64)
    hf = save_hf_model(hf_config("llama", n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16),
                       root / "hf")
    jobs = {method: lora_job(base, method) for method in LORA_METHODS}
    runs = {f"{name}/whole": (job, None) for name, job in jobs.items()}
    runs.update({f"{name}/on-one": (on_one_job(hf, name, root / "ckpt" / f"{name}-on-one"), None) for name in ON_ONE})
    runs.update(killed_runs(jobs, jobs.values(), root / "ckpt"))
    return launch(runs, 2, root / "results"), root / "ckpt", base, hf


def check_resumed(whole: TrainResult, resumed: TrainResult, folder: Path, kill: str) -> None:
    """The killed rank died, the restarted ranks resumed from a complete checkpoint (never from scratch, async saves
    included), finished the run, and every loss from the checkpoint on is the uninterrupted run's, bit for bit."""
    assert (folder / f"killed-at-{kill.split(':')[1]}").exists(), "the rank was not killed"
    assert resumed.first_step % EVERY == 0 and resumed.first_step >= EVERY, resumed.first_step
    assert complete_steps(folder)[-1] == STEPS + 2
    pairs = list(zip(whole.losses[resumed.first_step:], resumed.losses, strict=True))
    assert resumed.losses == whole.losses[resumed.first_step:], max(abs(a - b) for a, b in pairs)


@FULL
@pytest.mark.parametrize("name", list(STACK_JOBS))
def test_killed_rank_restarted_resumes_bit_for_bit(tmp_path, name, stack_runs):
    """Every strategy killed once (its own random rank) and resumed by the course's launcher's restart. The
    two-rank ones share `stack_runs`' launch; dp x pp (four ranks) has a launch of its own."""
    results, root = stack_runs
    job = stack_job(name)
    if job.world == 2:
        whole, resumed = results[f"{name}/whole"], results[f"{name}/killed"]
        runs = killed_runs([name], [job], root)
    else:
        runs = {f"{name}/whole": (job, None), **killed_runs([name], [job], tmp_path / "ckpt")}
        whole, resumed = launch(runs, job.world, tmp_path / "results").values()
        root = tmp_path / "ckpt"
    check_resumed(whole, resumed, root / name, runs[f"{name}/killed"][1])


@FULL
@pytest.mark.parametrize("method", LORA_METHODS)
def test_lora_and_qlora_resume_bit_for_bit_from_their_adapters(tmp_path, method, hf_runs):
    """LoRA and QLoRA (FSDP2 over two ranks) killed and resumed in `hf_runs`' launch: the checkpoint holds the
    adapters alone; it continues on one device and exports merged (a plain model) and as the adapters alone (peft)."""
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from helpers.finetune.lora import base_for_merge
    from helpers.training.export import export_hf, layers_logits, load_on_one

    results, root, base, _ = hf_runs
    job = lora_job(base, method)
    check_resumed(results[f"{method}/whole"], results[f"{method}/killed"], root / method,
                  killed_runs([method], [job], root)[f"{method}/killed"][1])
    last = step_folder(root / method, STEPS + 2)
    saved = FileSystemReader(str(last)).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights), "a LoRA checkpoint holds the adapters alone"
    one = load_on_one(job, last)
    x = torch.randint(128, (2, 16), device="cpu")
    ours = layers_logits(job.model, one.layers, x)
    merged = AutoModelForCausalLM.from_pretrained(export_hf(job.model, one.layers, tmp_path / "merged")).eval()
    adapted = PeftModel.from_pretrained(base_for_merge(job.model), str(export_hf(job.model, one.layers,
                                                                                 tmp_path / "adapters",
                                                                                 merge=False))).eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, ours, atol=1e-4)
        assert torch.allclose(adapted(input_ids=x).logits, ours, atol=1e-5)


@FULL
@pytest.mark.parametrize("name", list(ON_ONE))
def test_two_ranks_checkpoint_continues_on_one_and_exports_to_transformers(tmp_path, name, hf_runs):
    """FSDP2's shards, or a pipeline's stages (trained in `hf_runs`' launch), load into the whole model in one
    process (DCP reshards): training goes on from the checkpoint's step with the ranks' losses (one device sums in
    another order: 1e-5), and the result exports as a folder AutoModelForCausalLM loads with the same logits."""
    from transformers import AutoModelForCausalLM

    from helpers.training.export import continue_on_one, export_hf, layers_logits

    results, root, _, hf = hf_runs
    folder = root / f"{name}-on-one"
    ranks = results[f"{name}/on-one"]
    one = continue_on_one(on_one_job(hf, name, folder), step_folder(folder, STEPS), steps=2)
    assert one.first_step == STEPS
    assert max(abs(a - b) for a, b in zip(one.losses, ranks.losses[STEPS:], strict=True)) < 1e-5
    export_hf(hf, one.layers, tmp_path / "exported")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    x = torch.randint(64, (2, 16), device="cpu")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, layers_logits(hf, one.layers, x))


# --- torchrun ------------------------------------------------------------------------------------------------------
# What the course's launcher tests above do not: torchrun's own restarts. The scripts' cases run under
# `torchrun --standalone --max-restarts 1`; the two-node case runs helpers' torchrun entry (helpers.runtime.launch
# main, training.loop.torchrun_job) under two agents' restart, which also covers it under one agent.

def torchrun_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a torchrun test: CPU ranks of one thread, gloo on loopback, torchrun's temp folders in the
    test's."""
    return dict(os.environ, OMP_NUM_THREADS="1", LAB_FORCE_CPU="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp), **extra)


def test_the_workers_token_of_a_start_ignores_what_earlier_starts_left():
    """`round_store`'s handshake on a store holding a previous start's hello, reply and acknowledgement: rank 0 reads
    the stale hello before rank 1 writes its own; both still agree on rank 0's fresh token (threads, no process)."""
    import threading
    import time

    import torch.distributed as dist

    from helpers.runtime.launch import ROUND_KEYS, _agree_on_token

    store = dist.HashStore()
    for key, value in (("hello/1", "old"), ("reply/1", "old:stale"), ("ack/1", "stale")):
        store.set(f"{ROUND_KEYS}/{key}", value)
    tokens = {}

    def rank(r: int, delay_s: float) -> None:
        time.sleep(delay_s)
        tokens[r] = _agree_on_token(store, r, 2, time.monotonic() + 30)

    threads = [threading.Thread(target=rank, args=(0, 0.0)), threading.Thread(target=rank, args=(1, 0.2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert tokens[0] == tokens[1] and tokens[0] != "stale"


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


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@FULL
@pytest.mark.parametrize("script, extra", [("finetune_lora.py", ["--method", "qlora"]),
                                           ("train_fsdp2.py", []),
                                           ("train_pipeline.py", ["--schedule", "1f1b"])])
def test_scripts_resume_under_torchrun_max_restarts(tmp_path, script, extra):
    """The take-home scripts with --checkpoint-dir, one torchrun: a worker killed after step 5 (of 6), torchrun
    restarts both, they resume from step 3's checkpoint. Steps 3 and 4 ran in both starts (the first loss of the
    restored weights, and the first of the restored optimizer state): the restarted workers print the killed
    start's losses bit for bit (no separate uninterrupted run: one torchrun start-up less)."""
    from helpers.models.hf import hf_config, save_hf_model

    model_dir, folder = tmp_path / "llama", tmp_path / "ckpt"
    save_hf_model(hf_config("llama", n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=64, seq_len=16), model_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", str(SCRIPTS / script), "--model", str(model_dir), "--steps", "6", "--batch", "8", "--seq-len", "16",
           "--lr", "3e-3", "--autocast", "none", *extra, "--checkpoint-dir", str(folder), "--checkpoint-every", "3"]
    proc = run_command(cmd, timeout_s=300, cwd=SCRIPTS.parent, env=torchrun_env(tmp_path, **{KILL_ENV: "1:5"}))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"step"')]
    restart = max(i for i in range(1, len(printed)) if printed[i]["step"] <= printed[i - 1]["step"])
    first, again = ({r["step"]: r["loss"] for r in part} for part in (printed[:restart], printed[restart:]))
    assert (folder / "killed-at-5").exists() and complete_steps(folder) == [3, 6]
    assert sorted(first) == [0, 1, 2, 3, 4] and sorted(again) == [3, 4, 5]
    assert {s: again[s] for s in (3, 4)} == {s: first[s] for s in (3, 4)}


def read_together(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Every process's (stdout, stderr), their pipes read at the same time, one thread each: read one after the
    other, a process not yet read can fill its pipe and block writing while the one being read waits for it (torchrun
    agents wait for each other at their exit barrier). Past `timeout` every process group is killed and the test
    fails with each one's tail: the process that hangs is not always the one that says why."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(procs)) as pool:
        waits = [pool.submit(proc.communicate, timeout=timeout) for proc in procs]
        done = [wait.exception() is None for wait in waits]  # each returns or times out within `timeout`
    if all(done):
        return [wait.result() for wait in waits]
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    tails = [wait.result() if ok else proc.communicate() for wait, ok, proc in zip(waits, done, procs)]
    pytest.fail(f"not done within {timeout:.0f} s:\n" + "\n".join(
        f"process {i} (exit {proc.returncode}): ...{out[-1500:]}\n...{err[-3000:]}"
        for i, (proc, (out, err)) in enumerate(zip(procs, tails))))


@FULL
def test_two_torchrun_agents_as_two_nodes_resume_after_a_killed_worker(tmp_path, stack_runs):
    """Multi-node torchrun on the loopback address: two agents (`--nnodes 2`, c10d rendezvous), one rank each; one
    agent's worker is killed after a checkpoint, the agents restart both workers together and they resume with the
    uninterrupted run's losses (from `stack_runs`' launch)."""
    whole = stack_runs[0]["torchrun/whole"]
    kwargs = {**TORCHRUN_FIELDS, "checkpoint": {"folder": str(tmp_path / "ckpt"), "every": EVERY}}
    port = free_port()
    env = torchrun_env(tmp_path, **{KILL_ENV: "1:3"})
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                "1", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "-m", "helpers.runtime.launch",
                                "helpers.training.loop:torchrun_job", "--kwargs", json.dumps(kwargs)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True) for _ in range(2)]
    outputs = read_together(agents, timeout=300)
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, out[-2000:] + err[-4000:]
    assert (tmp_path / "ckpt" / "killed-at-3").exists()
    printed = "".join(out for out, _ in outputs)
    first, losses = re.search(r"losses from step (\d+): (\[.*\])", printed).groups()
    assert int(first) == EVERY
    assert json.loads(losses) == whole.losses[EVERY:]
