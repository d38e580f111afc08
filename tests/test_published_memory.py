"""The training-memory planner against published peak-memory measurements on 24 GB cards (issue 56).

data/published.json "answerai_fsdp_qlora_benchmarks" holds every peak-memory figure of Answer.AI's FSDP+QLoRA
benchmarks post (2 x RTX 3090 and 2 x RTX 4090), each with the conditions the post and its train.py state and the
planner's settings for them. Each row is planned with `plan_training` and must come within 10% of the figure.

What is compared, with no constant fitted to these rows:
- max_memory_reserved (the tables' "Peak Memory"): the fullest GPU's planned peak less the CUDA context
  (data/inference.json runtime_reserve: reserved memory leaves the context out), so the allocator margin there
  (1 GiB, llama.cpp's) stands in for the caching allocator's cached bytes, as tests/test_plan_train.py does; but
  never more than the card holds beside the context (`reserved_figure`): a run at the card's limit gives up the
  cached bytes first. Three rows are planned at that bound (Mistral's two 24,576-token rows, Llama-2 7B's batch 12
  with offload): their planned bytes in use, margin aside (24.15 and 23.32 GiB), already exceed the 23.19 GiB the
  RTX 4090 leaves, so the plan says they would not fit where they trained: an over-count of the plan's (see MISSES'
  notes on the loss and the recomputed layer) that the bound does not hide from the planner's verdict;
- max_memory_allocated (the post's note under the LoRA table): the planned peak without any reserve.
Rows that miss 10% are xfailed (strict: a planner change that brings one in makes this file fail until the mark
goes) with the measured gap and what is known of its cause; rows the planner cannot price are skipped, with why.
"""
from __future__ import annotations

import pytest
from transformers import AutoConfig

from helpers.facts import load_data
from helpers.finetune.memory_plan import GpuTraining, plan_training
from helpers.sizing.shape import inference_data

TOLERANCE = 0.10
GiB = 2**30
ENTRY = load_data("published")["answerai_fsdp_qlora_benchmarks"]
ROWS = {row["id"]: row for row in ENTRY["rows"]}

# rows the planner misses by more than 10%: id -> the gap measured here and what is known of its cause
MISSES = {
    "RTX 3090: llama-2-7b qlora, batch 1, context 2048":
        "planned 6.04 GiB vs 5.21 (+16%; in use, margin aside, 5.04: -3.3%). The 1 GiB margin is the miss: at batch "
        "1 the peak reserved is set by blocks cached while loading and wrapping (3.72 GiB reserved after wrap, about "
        "2.0 in use) that training reuses, so the post's reserved figure grows 0.23 GiB from context 512 to 2048 "
        "(4.98 -> 5.21) where the plan's in-use bytes grow 1.40. The true conditions of the run only add to the plan: "
        "transformers 4.37's output keeps the fp32 logits (+0.12 GiB: +18%), lora_dropout 0.1 saves a dropout output "
        "and mask per adapted layer (+0.18: +20%). What autograd does, the log-softmax's backward before the first "
        "layer recompute (the loss's 16 bytes per token per vocabulary entry, then the output's 4 beside the "
        "recomputed layer: the larger, not the sum), puts this row at +7% but the 7B batch-4 and batch-10 QLoRA rows "
        "at -11% and -9%, LoRA batch 6 at -17%, the 7B and Yi-34B offload rows at -25% and -21%: the plan's sum of "
        "the two phases stands in for allocator cache the flat margin does not model, and without it those rows "
        "miss.",
    "RTX 3090: llama-2-70b qlora cpu-offload, batch 2, context 2048":
        "planned 13.30 GiB vs 14.92 (-10.8%; in use 12.30). What the run had that the plan leaves out: transformers "
        "4.37's output keeps the fp32 logits through backward (+0.24 GiB: -9.2%), its SDPA attention repeats K and V "
        "to all 64 heads before scaled_dot_product_attention (repeat_kv; the plan saves the 8 KV heads: +0.11, "
        "-10.1%; both: -8.5%), and lora_dropout 0.1 saves a dropout output (bf16) and mask (1 byte) per adapted "
        "layer beside the input bitsandbytes' MatMul4Bit keeps (+0.80: -5.5%; all three: -3.1%). Added to the plan's "
        "sum they put the 7B QLoRA rows of batch 4, 8 (DDP) and 10 at +15%, +11% and +11% (the last at the card) and "
        "the batch-1 2048 row at +22%, so they are not added. Taken phase by phase (the loss's backward, then each "
        "layer's recompute), this run's peak is the recompute: constants 1.01, checkpointed inputs 5.0, gathered "
        "root 0.98 and two layers 0.83, fp32 logits 0.49, the recomputed layer with dropout and repeated K/V 2.3, its "
        "transients and dequantized weight 1.2: 11.8 GiB in use (-14% with the margin); the 3 GiB between that and "
        "14.92 is not located (untested: the allocator's cache over 80 layers' all-gathers and 960 LoRA FSDP units "
        "under CPU offload).",
    "RTX 4090: llama-2-70b qlora cpu-offload, batch 2, context 2048":
        "the same run as on the 3090s (the post prints the same 14.92 GiB): planned 13.30 GiB (-10.8%).",
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


def reserved_figure(device: GpuTraining) -> int:
    """The bytes torch.cuda.max_memory_reserved would show for a planned GPU: its peak less the CUDA context (reserved
    memory leaves the context out), but no more than the card holds beside the context. When cudaMalloc fails, the
    caching allocator frees its cached blocks and retries before it raises (c10/cuda/CUDACachingAllocator.cpp,
    `malloc`: release_cached_blocks, then alloc_block again), so a run at the card's limit reserves no margin."""
    context = inference_data()["runtime_reserve"]["cuda_context"]["mib"] * 2**20
    return min(device.peak_bytes, device.gpu.capacity_bytes) - context


def planned_gib(row: dict) -> float:
    settings = dict(row["settings"])
    plan = plan_training(**{**settings, "model": model_config(settings["model"])}, suggest=False)
    fullest = max(plan.devices, key=lambda d: d.peak_bytes)
    if row["figure"] == "max_memory_reserved":
        return reserved_figure(fullest) / GiB
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
