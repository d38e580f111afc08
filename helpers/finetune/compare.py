"""The training-memory planner beside what runs: its prediction for a run of the course's loop in the parts the ledger
counts, its plans of real models drawn per GPU, and its peaks beside the published ones (notebook 12).

A run of `helpers.finetune.lora.finetune` (LoRA / QLoRA) or `helpers.training.train(..., "fsdp2")` (full fine-tuning)
shards a Hugging Face decoder with FSDP2 and reports each rank's memory from `helpers.sizing.ledger.MemoryLedger`:
parameters (this rank's shards), gradients, optimizer state, and the activations saved by the end of a forward pass.
`planned_parts` asks the planner (`helpers.finetune.memory_plan.plan_training`) about the same model directory, method,
weight format, per-rank batch, sequence length and checkpointing, and returns its figures for those four parts. What
the two count differently is named where it happens (see `planned_parts`), so a notebook can explain every gap.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from helpers.finetune.memory_plan import TrainingPlan, plan_training
from helpers.sizing.training import TORCHAO_NF4, saved_activation_bytes
from helpers.sizing.state import training_data
from helpers.sizing.gpus import runtime_reserve
from helpers.sizing.shape import WeightFormat, weight_format
from helpers.sizing.ledger import DeviceMemory, stacked_bars
from helpers.units import GiB, fmt_bytes
from helpers.training.job import renamed
from helpers.dtypes import BYTES, DTYPES, NAMES

ADAPTER_BYTES = BYTES["fp32"]  # helpers.finetune.lora trains the adapters in fp32 whatever the base (ADAPTER_DTYPE)


def run_format(method: str, base_dtype: str) -> WeightFormat:
    """The planner's weight format for a base stored as `helpers.finetune.lora` stores it.

    full and lora: every tensor in `base_dtype`. qlora: the decoder blocks' linear weights in torchao's NF4 (the
    planner's nf4-torchao: 4-bit codes, an 8-bit scale per block of 64 values, a factor per 256 scales, and
    torchao's dequantization peak); the embeddings, norms and head stay in `base_dtype`, and the dequantized weights
    compute in it (nf4-torchao assumes bf16 for both, as on a GPU; on the CPU rig the base computes in fp32)."""
    if method != "qlora":
        return weight_format(base_dtype)
    nf4 = weight_format(TORCHAO_NF4)
    itemsize = DTYPES[base_dtype].itemsize
    if itemsize == nf4.activation_bytes:
        return nf4
    return dataclasses.replace(nf4, name=f"{nf4.name}, {base_dtype} compute", activation_bytes=itemsize)


def _run_of(model) -> tuple[str, str, str, int | None, object]:
    """(model directory, method, base dtype, LoRA rank, LoRA targets) of a LoraModel or an HFModel (full)."""
    spec = getattr(model, "spec", None)
    if spec is None:  # an HFModel trained whole
        return model.path, "full", NAMES[model.weights_dtype], None, "all"
    targets = "all" if spec.targets == "all-linear" else ",".join(spec.targets)
    return model.base.path, spec.method, spec.base_dtype, spec.rank, targets


def planned_parts(model, batch: int, seq_len: int, activation_checkpointing: bool = True, ranks: int = 2,
                  **old) -> tuple[TrainingPlan, DeviceMemory]:
    """The planner's plan for training `model` (a `LoraModel`, or an `HFModel` trained whole) with FSDP2 over `ranks`
    GPUs, `batch` sequences of `seq_len` tokens per rank and Adam, and one rank's figures in the ledger's parts.

    What each part is, and where the ledger of a run counts otherwise:
    - params: the frozen shards (quantization constants included) plus the trainable shards. The planner keeps NF4's
      constants whole on every GPU (bitsandbytes keeps them beside the packed weight, where FSDP cannot shard them);
      torchao's NF4, which this course trains, shards them too. Buffers (RoPE's inverse frequencies) are not
      parameters: left out here, as the ledger leaves them out.
    - grads, optimizer: the trainable shards' gradients and Adam's two moments. The ledger also counts Adam's step
      counter, one 4-byte tensor per trainable tensor, which a GPU's AdamW keeps on the host (data/training_memory.json).
    - activations: what the forward pass saves (`Activations.saved`): the ledger tracks the forward, so the one layer
      that backward recomputes under checkpointing (in the planner's peak) is not in it. Adapters compute in fp32 here
      (the planner assumes FSDP2 gathers them in the compute dtype), and the course's loop checkpoints the final norm
      with the decoder layers, so it keeps the norm's input where the planner keeps what the norm saves.
    Full fine-tuning keeps everything in the model's dtype (`precision="pure"`); LoRA and QLoRA keep the adapters,
    their gradients and Adam's moments in fp32 (`precision="mixed"`). `checkpointing=` is the deprecated name of
    `activation_checkpointing=`."""
    options = renamed(old)
    activation_checkpointing = options.pop("activation_checkpointing", activation_checkpointing)
    if options:
        raise TypeError(f"planned_parts() got unexpected keyword arguments {sorted(options)}")
    path, method, base_dtype, rank, targets = _run_of(model)
    fmt = run_format(method, base_dtype)
    plan = plan_training(path, method, context=seq_len, batch=batch, gpus=f"{ranks}x RTX 3090", strategy="fsdp2",
                         activation_checkpointing=activation_checkpointing, lora_rank=rank, lora_targets=targets,
                         optimizer="adamw", precision="pure" if method == "full" else "mixed", dtype=fmt)
    gpu, shape = plan.devices[0], plan.shape
    buffers = sum(u.buffer_bytes for u in shape.units)
    adapters = fmt.activation_bytes if method == "full" else ADAPTER_BYTES
    saved = saved_activation_bytes(shape, seq_len, batch, activation_checkpointing=activation_checkpointing,
                                   compute_bytes=fmt.activation_bytes, adapter_bytes=adapters).saved
    return plan, DeviceMemory(gpu.frozen_bytes - buffers + gpu.trainable_bytes, gpu.gradient_bytes,
                              gpu.optimizer_bytes, saved)


# --- real models on real GPUs -----------------------------------------------------------------------------------------

PLAN_PARTS = (("frozen weights", "frozen_bytes", "tab:blue"), ("trainable weights", "trainable_bytes", "tab:cyan"),
              ("gradients", "gradient_bytes", "tab:orange"), ("optimizer state", "optimizer_bytes", "tab:purple"),
              ("activations", "activation_bytes", "tab:green"), ("workspace", "workspace_bytes", "tab:olive"),
              ("reserve", "reserve_bytes", "tab:gray"))


def fullest(plan: TrainingPlan):
    """The GPU of `plan` with the highest peak (the one that decides whether it fits)."""
    return max(plan.devices, key=lambda d: d.peak_bytes)


def summary_row(name: str, plan: TrainingPlan) -> dict:
    """One line of a plan for a table: sizes, the fullest GPU's parts (formatted), its peak, whether it fits, and the
    host RAM CPU offload takes."""
    g, s = fullest(plan), plan.shape
    return {"run": name, "parameters": f"{s.total_params / 1e9:.2f} B", "trainable": f"{s.trainable_params / 1e6:,.1f} M",
            "weights": fmt_bytes(g.frozen_bytes + g.trainable_bytes),
            "grads + optimizer": fmt_bytes(g.gradient_bytes + g.optimizer_bytes),
            "activations + workspace": fmt_bytes(g.activation_bytes + g.workspace_bytes),
            "reserve": fmt_bytes(g.reserve_bytes), "peak per GPU": fmt_bytes(g.peak_bytes),
            "of": fmt_bytes(g.gpu.capacity_bytes), "fits": plan.fits, "host RAM": fmt_bytes(plan.host_ram_bytes)}


def plot_plans(plans: Mapping[str, TrainingPlan], ax=None, title: str = "fullest GPU of each plan"):
    """One stacked bar per plan, for its fullest GPU, in GiB: frozen and trainable weights, gradients, optimizer
    state, activations, workspace and the runtime reserve (the optimizer step's temporaries are drawn inside the
    activations' and workspace's room when they are smaller, as the peak counts them); a black line at the GPU's
    capacity, so a plan that does not fit rises above it."""
    names = list(plans)
    gpus = [fullest(plans[n]) for n in names]
    parts = []
    for label, attr, color in PLAN_PARTS:
        values = [getattr(g, attr) / GiB for g in gpus]
        if attr == "activation_bytes":  # the peak takes the larger of (activations + workspace) and the step's
            values = [max(v, g.step_bytes / GiB - g.workspace_bytes / GiB) for v, g in zip(values, gpus)]
        parts.append((label, values, {"color": color}))
    capacities = [g.gpu.capacity_bytes / GiB for g in gpus]
    ax, tops = stacked_bars(names, parts, ax, (9, 3.6), "GiB per GPU", title, capacities, True, 10)
    for i, name in enumerate(names):
        ax.text(i, tops[i], "fits" if plans[name].fits else "does NOT fit", ha="center", va="bottom", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    return ax


def published_comparison() -> list[dict]:
    """Answer.AI's measured peak per GPU on two RTX 3090s (data/training_memory.json "published_runs", with their
    settings) beside the planner's for the same settings. Their figure is torch.cuda.max_memory_reserved, which leaves
    out the CUDA context, so the planner's fullest GPU is given less the context too (the allocator margin stays, as
    the stand-in for the caching allocator's slack)."""
    context = runtime_reserve()["context"]
    rows = []
    for name, run in training_data()["published_runs"]["runs"].items():
        plan = plan_training(**run["settings"])
        ours = (fullest(plan).peak_bytes - context) / GiB
        rows.append({"run": name, "published (GiB per GPU)": run["peak_gib_per_gpu"],
                     "planner (GiB per GPU)": round(ours, 2),
                     "planner / published": round(ours / run["peak_gib_per_gpu"], 3),
                     "host RAM, planner (GiB)": round(plan.host_ram_bytes / GiB, 1), "seconds": run["seconds"]})
    return rows
