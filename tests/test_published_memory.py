"""The training-memory planner against published peak-memory measurements on 24 GB cards (issue 56).

data/published.json "answerai_fsdp_qlora_benchmarks" holds every peak-memory figure of Answer.AI's FSDP+QLoRA
benchmarks post (2 x RTX 3090 and 2 x RTX 4090), each with the conditions the post and its train.py state and the
planner's settings for them. Each row is planned with `plan_training` and must come within 10% of the figure.

What is compared, with no constant fitted to these rows:
- max_memory_reserved (the tables' "Peak Memory"): the fullest GPU's planned peak less the CUDA context
  (data/inference.json runtime_reserve: reserved memory leaves the context out), so the allocator margin there
  (1 GiB, llama.cpp's) stands in for the caching allocator's cached bytes, as tests/test_plan_train.py does;
- max_memory_allocated (the post's note under the LoRA table): the planned peak without any reserve.
Rows that miss 10% are xfailed (strict: a planner change that brings one in makes this file fail until the mark
goes) with the measured gap and what is known of its cause; rows the planner cannot price are skipped, with why.
"""
from __future__ import annotations

import pytest
from transformers import AutoConfig

from helpers.facts import load_data
from helpers.finetune.memory_plan import plan_training
from helpers.sizing.shape import inference_data

TOLERANCE = 0.10
GiB = 2**30
ENTRY = load_data("published")["answerai_fsdp_qlora_benchmarks"]
ROWS = {row["id"]: row for row in ENTRY["rows"]}

# rows the planner misses by more than 10%: id -> the gap measured here and what is known of its cause
MISSES = {
    "RTX 3090: llama-2-7b qlora, batch 1, context 2048":
        "planned 6.04 GiB vs 5.21 (+16%). The planner's token-proportional parts grow 1.40 GiB from context 512 to "
        "2048 at batch 1; the post's reserved figure grows 0.23 GiB (4.98 -> 5.21) and its LoRA pair's allocated "
        "figure 0.88 GiB (8.28 -> 9.16). At batch 1 the peak reserved is set by blocks cached while loading and "
        "wrapping (3.72 GiB reserved after wrap) that later allocations reuse, which a flat 1 GiB allocator margin "
        "does not model; the same row at context 512 is -7%, the batch-4 and batch-10 rows +4% and +9%.",
    "RTX 3090: llama-2-70b qlora cpu-offload, batch 2, context 2048":
        "planned 13.30 GiB vs 14.92 (-10.8%; allocated-only 12.30). Not located: what the GPU holds under FSDP1's "
        "CPUOffload is quantization constants (1.0 GiB, nf4-dq, assumed to stay on the GPU), two gathered layers "
        "(0.83), the gathered root (0.98), 80 checkpointed layer inputs (5.0) and the loss and recompute; FSDP1's "
        "copy of each unit's shard to the GPU before its all-gather is not in the plan, nor the allocator's slack "
        "over 80 layers' 64 MiB inputs. Nor is train.py's lora_dropout 0.1: peft applies dropout to each adapted "
        "layer's input, so the recomputed layer saves a dropout output (bf16) and mask (1 byte) per adapted layer "
        "instead of the shared input the plan counts: 0.45 GiB more here (-7.8% with it), but 1.07 GiB more on the "
        "7B batch-10 row (+14% with it) and 1.36 GiB on the Mistral rows (+18%), so adding it alone is not the fix.",
    "RTX 4090: llama-2-70b qlora cpu-offload, batch 2, context 2048":
        "the same run as on the 3090s (the post prints the same 14.92 GiB): planned 13.30 GiB (-10.8%).",
    "RTX 4090: mistral-7b-v0.2 qlora cpu-offload, batch 12, context 2048":
        "planned 25.15 GiB vs 22.54 (+11.6%; allocated-only 24.15, +7.1%): the plan exceeds the card (23.64 GiB) "
        "for a run that trained. Of the planned 24.2 GiB in use, 24 GiB is activations (13.5: 32 checkpointed "
        "inputs 6.0, the loss's fp32 log-softmax 2.9, one recomputed layer 4.2) and workspace (10.5: logits and their "
        "gradients 7.3, one layer's transients 2.3); 24576 tokens on a 24 GB card leave the caching allocator no "
        "room for a 1 GiB margin (it frees its cache and retries before it fails). Llama-2 7B at the same 24576 "
        "tokens plans +8.7%, 0.8 GiB less (Mistral's wider MLP in the recomputed layer and transients), where the "
        "post measures only 0.16 GiB less. Which token-proportional part is high is not located: taking the larger "
        "of the loss's peak and the recomputed layer's instead of their sum puts these rows at -18% and the "
        "batch-10 rows at -14%, so the sum is not simply the error.",
    "RTX 4090: mistral-7b-v0.2 qlora cpu-offload, batch 1, context 24576":
        "the same 24576 tokens as batch 12 x 2048 (the post prints the same 22.54 GiB and the plan is the same "
        "25.15): +11.6%, as that row.",
}
# rows the planner has no figure for: id -> why
SKIPS = {
    "RTX 3090: llama-2-7b qlora, batch 1, context 512 (after wrap)":
        "memory_reserved right after FSDP wraps the model counts the blocks cached while rank 0 broadcast each unit "
        "whole (sync_module_states) before sharding; the planner prices training, not that loading transient on "
        "the GPU (its frozen + trainable weights per GPU are 2.0 GiB against the 3.72 reserved).",
}


def model_config(name: str):
    """A bundled model's name as is; a model the planner does not bundle from the entry's model_configs (stored
    as data/inference.json stores bundled configs, with its source)."""
    entry = ENTRY["model_configs"].get(name)
    if entry is None:
        return name
    fields = dict(entry["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.name_or_path = name
    return config


def planned_gib(row: dict) -> float:
    settings = dict(row["settings"])
    plan = plan_training(**{**settings, "model": model_config(settings["model"])}, suggest=False)
    fullest = max(plan.devices, key=lambda d: d.peak_bytes)
    if row["figure"] == "max_memory_reserved":
        context = inference_data()["runtime_reserve"]["cuda_context"]["mib"] * 2**20
        return (fullest.peak_bytes - context) / GiB
    assert row["figure"] == "max_memory_allocated", row["figure"]
    return fullest.used_bytes / GiB


def _param(key: str, skips: dict[str, str], misses: dict[str, str]):
    """A row as a test parameter: skipped or expected to miss (strict) with its stated reason, else plain."""
    if key in skips:
        return pytest.param(key, marks=pytest.mark.skip(reason=skips[key]))
    if key in misses:
        return pytest.param(key, marks=pytest.mark.xfail(strict=True, reason=misses[key]))
    return key


@pytest.mark.parametrize("row_id", [_param(i, SKIPS, MISSES) for i in ROWS])
def test_planner_within_10_percent_of_each_published_row(row_id):
    row = ROWS[row_id]
    ours = planned_gib(row)
    assert abs(ours / row["gib"] - 1) <= TOLERANCE, f"{row_id}: planned {ours:.2f} GiB vs published {row['gib']}"


def test_every_row_of_the_post_is_recorded_with_its_conditions():
    """All 24 "Peak Memory" cells of the post's tables (13 on the 3090s, 11 on the 4090s), its two allocated figures
    and its reserved-after-wrap figure; each row names its GPUs, model, method, sharding, offload, batch, context
    and which memory figure it is; the common conditions (precision, checkpointing, LoRA, quantization) are the
    entry's, with their source; the exclusions above name real rows."""
    rows = ENTRY["rows"]
    reserved = [r for r in rows if r["figure"] == "max_memory_reserved"]
    assert len(reserved) == 24 and len(rows) == 27
    assert sum(r["gpus"] == "2 x RTX 3090" for r in reserved) == 13
    keys = {"table", "gpus", "model", "method", "sharding_strategy", "cpu_offload", "batch_size", "context_length",
            "figure", "gib", "settings"}
    for r in rows:
        assert keys <= set(r), r["id"]
        s = r["settings"]
        assert (s["batch"], s["context"], s["method"]) == (r["batch_size"], r["context_length"], r["method"])
        assert (s["offload"] == "cpu") == r["cpu_offload"] and (s["strategy"] == "ddp") == (r["sharding_strategy"]
                                                                                           == "ddp")
    assert ENTRY["source"] and ENTRY["figure_source"] and ENTRY["conditions"]["source"]
    for name, config in ENTRY["model_configs"].items():
        assert config["source"], name
    assert set(MISSES) | set(SKIPS) <= set(ROWS) and not set(MISSES) & set(SKIPS)


def test_the_older_entry_agrees_with_the_full_table():
    """answerai_fsdp_qlora_2x3090 (notebook 07's) carries two of these figures (its 20.9 is the table's 20.94)."""
    old = load_data("published")["answerai_fsdp_qlora_2x3090"]
    ddp = ROWS["RTX 3090: llama-2-7b qlora ddp, batch 8, context 2048"]
    assert old["llama2_7b_batch8"]["gib_per_gpu"] == pytest.approx(ddp["gib"], abs=0.05)
    assert old["llama2_7b_batch8"]["seconds"] == ddp["seconds"]
    assert old["llama2_70b_cpu_offload"]["gib_per_gpu"] == pytest.approx(
        ROWS["RTX 3090: llama-2-70b qlora cpu-offload, batch 2, context 2048"]["gib"], abs=0.05)


def test_most_rows_are_held_to_10_percent():
    """The exclusions stay a minority: at least 20 of the 26 plannable rows are asserted, none excused silently."""
    plannable = [i for i in ROWS if i not in SKIPS]
    assert len(plannable) - len(MISSES) >= 20


# --- torchtune's 'Optimization flags' table (Llama 3.2 3B on one A100, techniques stacked) --------------------------

TORCHTUNE = load_data("published")["torchtune_optimization_flags_llama3_2_3b"]
TT_ROWS = {row["technique"]: row for row in TORCHTUNE["rows"]}
TT_COMPILE = ("the row runs with torch.compile (on from '+ Compile' down, and in the final command): the planner "
              "models eager PyTorch, and compile alone moved this table's peak by -15%")
TT_SKIPS = {
    "Baseline": "unpacked Alpaca batches: the tokens per batch vary and are not stated",
    **{t: TT_COMPILE for t in TT_ROWS if t not in ("Baseline", "+ Packed Dataset")},
}
TT_MISSES = {
    "+ Packed Dataset":
        "the planner has no single-device strategy: on one GPU 'fsdp2' adds FSDP2's all-gathered layers and root "
        "(1.5 GiB here) and 'ddp' DDP's bucket copy of the gradients (6 GiB); planned with fsdp2, 67.8 GiB in use "
        "against 60.0 GiB active (+13%): activations 32.1 (no checkpointing, 8192 tokens), logits workspace, "
        "bf16 weights, gradients and AdamW moments 24.0, the step's temporaries beside them",
}


@pytest.mark.parametrize("technique", [_param(t, TT_SKIPS, TT_MISSES) for t in TT_ROWS])
def test_planner_within_10_percent_of_torchtune_rows(technique):
    """Peak active memory (allocated blocks: no allocator cache, no context) against the plan without reserve."""
    row = TT_ROWS[technique]
    plan = plan_training(**row["settings"], suggest=False)
    ours = plan.devices[0].used_bytes / GiB
    assert abs(ours / row["peak_memory_active_gib"] - 1) <= TOLERANCE, (technique, ours)


def test_torchtune_rows_are_recorded_with_their_conditions():
    """All ten rows of the table, each with its technique stack; the stated conditions and the figure's meaning
    with their sources; every row but the unpacked baseline carries the planner's settings for it."""
    assert len(TT_ROWS) == 10 and TORCHTUNE["source"] and TORCHTUNE["figure_source"]
    assert TORCHTUNE["conditions"]["stated"] and TORCHTUNE["conditions"]["source"]
    for technique, row in TT_ROWS.items():
        assert (row["settings"] is None) == (technique == "Baseline"), technique
        if row["settings"]:
            assert row["settings"]["method"] == row["method"] and row["settings"]["context"] == 4096
    assert set(TT_SKIPS) | set(TT_MISSES) == set(TT_ROWS) and not set(TT_SKIPS) & set(TT_MISSES)
