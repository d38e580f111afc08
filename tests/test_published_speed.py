"""The simulator's LoRA and QLoRA training times against Answer.AI's published FSDP+QLoRA runs (issue 56).

data/published.json "answerai_fsdp_qlora_benchmarks" holds 24 rows with `seconds`: train.py's timed epoch (the
training loop only) over 1024 dummy samples of full context length on 2 x RTX 3090 or 2 x RTX 4090, with the
conditions the post and its train.py state (`seconds_figure`, `dataset_samples`, `steps`: each with its source).
Each row is predicted here from first principles, with no constant fitted to these rows:
`helpers.simulate.finetune.finetune_workload` (the planner's `training_shape` of the row's model, method, format,
rank 64 and targets; peft's dropout 0.1 on each adapter's input; adapters and AdamW state in bf16, train.py's
precision) on the rig's GPU, then `simulate` of one step per batch size the run takes (FSDP1's FULL_SHARD as FSDP2,
its NO_SHARD "DDP" rows as DDP: both overlap their exchange with compute, as the post says FSDP does; CPU offload over
the rig's host, `rig_host`), times the steps train.py runs (`run_steps`).

Every row must come within TOLERANCE of its published time; the ones that miss are xfailed (strict: a change that
brings one in makes this file fail until its mark goes) with the measured gap and what is known of its cause. The
errors are printed (`pytest -s`): the model is pessimistic on compute-bound rows (+17% to +41% on 7B), optimistic
where the 3090 rig's slow links dominate.
"""
from __future__ import annotations

import functools

import pytest

from helpers.facts import load_data
from helpers.hardware import target_rig
from helpers.simulate.finetune import finetune_workload, rig_host
from helpers.simulate.job import Job
from helpers.simulate.strategies import simulate
from helpers.sizing.training import training_shape
from tests.test_published_memory import model_config

TOLERANCE = 0.35
ENTRY = load_data("published")["answerai_fsdp_qlora_benchmarks"]
ROWS = {row["id"]: row for row in ENTRY["rows"] if "seconds" in row}
RIGS = {"2 x RTX 3090": "2x3090 PCIe", "2 x RTX 4090": "2x4090"}  # the post's rigs: no NVLink, no P2P
LORA_DROPOUT = 0.1  # train.py's lora_dropout (the entry's conditions)
STATE_BYTES = 2  # train.py's precision bf16: adapters, gradients and AdamW moments in bfloat16
RANKS = 2

SLOW_LINKS = ("Johno's 3090 rig is 'an older motherboard' with 'slow PCI lanes' (the post); the simulator's 2x3090 "
              "PCIe rig is Lambda's (all-reduce bus bandwidth 7.18 GB/s, data/hardware.json). At batch 1 the run "
              "is bound by FSDP's gathers: ")
# rows the simulator misses by more than TOLERANCE: id -> the gap measured here and what is known of its cause
MISSES = {
    "RTX 3090: llama-2-7b qlora, batch 1, context 512":
        "predicted 371 s vs 1082 (-66%). " + SLOW_LINKS + "1082 s is 2.11 s a step against 0.59 s of compute "
        "alone, and each GPU receives the whole 4.05 GB model (packed codes, bf16 embedding and head) per step: "
        "2.7 GB/s if nothing overlapped.",
    "RTX 3090: llama-2-7b lora, batch 1, context 512":
        "predicted 1000 s vs 2597 (-61%). " + SLOW_LINKS + "5.07 s a step against 0.51 s of compute, 13.8 GB of "
        "bf16 weights received per step: 3.0 GB/s if nothing overlapped.",
    "RTX 3090: llama-2-7b lora, batch 1, context 2048":
        "predicted 1332 s vs 3090 (-57%). " + SLOW_LINKS + "6.04 s a step against 2.25 s of compute, 13.8 GB "
        "received per step: 3.6 GB/s if nothing overlapped (the 2048 row, more compute to hide behind).",
    "RTX 4090: llama-2-7b lora ddp, batch 4, context 2048":
        "predicted 614 s vs 437 (+41%): compute-bound (DDP all-reduces only the adapters' gradients), so the "
        "roofline's compute is high. The 4090s' QLoRA batch-10 row is 2,240 tokens/s per GPU on Llama-2 7B "
        "(1020 x 2048 / 466 s / 2; the post's Mistral figure: 2,200); the trace prices a block's 2,048 x 10 tokens "
        "at 56 ms of matmuls, 26 ms of memory-bound "
        "kernels (peft's six dropouts, scalings and adds, RMSNorm in fp32, rotary) and 8 ms of attention forward, "
        "all over the framework share (0.809, fitted on BERT-large): the element-wise kernels at the 936 GB/s a "
        "4090 sustains and the fused attention without causal skipping (`_FusedAttention` counts the whole score "
        "matrix; FlashAttention skips the blocks above the diagonal) are the likely excess, not located further.",
    "RTX 4090: llama-2-7b qlora ddp, batch 8, context 2048":
        "predicted 617 s vs 450 (+37%): compute-bound, as the LoRA DDP row on the 4090s.",
    "RTX 4090: mistral-7b-v0.2 qlora cpu-offload, batch 1, context 24576":
        "predicted 17404 s vs 7809 (+123%): attention over 24,576 tokens dominates, and the roofline prices the "
        "fused kernel over the whole score matrix at half the matmul rate (efficiency 'attention' 0.5, an "
        "estimate). Counting only the causal half, as FlashAttention computes it, predicts 12152 s (+56%); that "
        "change moves the guide's GPT-2 answers quoted in INSTRUCTORS.md, so it is not made here.",
}


def run_steps(batch: int) -> dict[int, int]:
    """Steps of each size one rank runs (entry `steps`): the dataset truncated to a multiple of the batch, dealt to
    the ranks, then batches of `batch` and a last short one."""
    samples = ENTRY["dataset_samples"]
    per_rank = (samples - samples % batch) // RANKS
    steps = {batch: per_rank // batch}
    if per_rank % batch:
        steps[per_rank % batch] = 1
    return steps


@functools.lru_cache(maxsize=None)
def predicted_seconds(row_id: str) -> float:
    """The simulated time of the row's whole timed epoch."""
    row = ROWS[row_id]
    settings = row["settings"]
    rig = target_rig(RIGS[row["gpus"]])
    train = training_shape(model_config(settings["model"]), settings["method"], settings["dtype"],
                           settings["lora_rank"], settings["lora_targets"])
    workload = finetune_workload(train, settings["context"], rig.gpu, batch=settings["batch"],
                                 lora_dropout=LORA_DROPOUT, state_bytes=STATE_BYTES)
    total = 0.0
    for size, count in run_steps(settings["batch"]).items():
        job = Job(settings["strategy"], RANKS * size, activation_checkpointing=True, dp=RANKS,
                  cpu_offload=settings["offload"] == "cpu")
        total += count * simulate(workload, job, rig.link, rig.collectives, host=rig_host()).step_s
    return total


def _param(key: str):
    if key in MISSES:
        return pytest.param(key, marks=pytest.mark.xfail(strict=True, reason=MISSES[key]))
    return key


@pytest.mark.parametrize("row_id", [_param(i) for i in ROWS])
def test_simulated_time_within_tolerance_of_each_published_row(row_id):
    seconds = ROWS[row_id]["seconds"]
    ours = predicted_seconds(row_id)
    print(f"{row_id}: predicted {ours:.0f} s vs published {seconds} s ({ours / seconds - 1:+.0%})")
    assert abs(ours / seconds - 1) <= TOLERANCE, f"{row_id}: predicted {ours:.0f} s vs published {seconds} s"


def test_every_timed_row_is_there_and_its_steps_add_up_to_the_run():
    """24 timed rows (13 on the 3090s, 11 on the 4090s); each rank runs its half of the truncated dataset; the misses
    name real rows."""
    assert len(ROWS) == 24 and sum(r["gpus"] == "2 x RTX 3090" for r in ROWS.values()) == 13
    for row in ROWS.values():
        batch = row["settings"]["batch"]
        assert sum(size * n for size, n in run_steps(batch).items()) == (1024 - 1024 % batch) // RANKS
    assert run_steps(12) == {12: 42, 6: 1} and run_steps(1) == {1: 512}
    assert set(MISSES) <= set(ROWS)


def test_the_trends_the_post_reports_come_out():
    """What the post draws from its tables, as the simulator has it: a larger batch is faster for the same samples
    (fewer gathers per sample), and QLoRA beats LoRA at batch 1 on the 3090s (a quarter of the bytes to gather)."""
    time = {row_id: predicted_seconds(row_id) for row_id in ROWS}
    assert time["RTX 3090: llama-2-7b qlora, batch 10, context 2048"] < \
        time["RTX 3090: llama-2-7b qlora, batch 4, context 2048"] < \
        time["RTX 3090: llama-2-7b qlora, batch 1, context 2048"]
    assert time["RTX 3090: llama-2-7b qlora, batch 1, context 512"] < \
        time["RTX 3090: llama-2-7b lora, batch 1, context 512"]
