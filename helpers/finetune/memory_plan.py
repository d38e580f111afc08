"""Will my fine-tune fit? Per-GPU training memory for full fine-tuning, LoRA and QLoRA under DDP, FSDP2 and a pipeline.

The planner prices a Hugging Face decoder exactly where exactness is possible and names every estimate:

- parameters: counted on the meta device by `helpers.sizing.shape.model_shape` (the inference planner's shapes and
  weight formats: NF4 with its quantization constants, bf16, ...); the LoRA adapters are counted from the shapes of
  the adapted `nn.Linear` modules (r x in for A, out x r for B, as peft builds them). Exact.
- gradients and optimizer state: from data/training_memory.json (AdamW's two moments, bitsandbytes' 8-bit AdamW, the
  mixed-precision master copy). Exact for the tensors; allocator rounding is left to the runtime reserve.
- activations: what autograd saves, derived term by term in `layer_saved_bytes` from what a Llama-style decoder layer
  saves (measured with `helpers.sizing.ledger.MemoryLedger` on a small model; tests/test_plan_train.py checks the
  formula against the ledger). With checkpointing, the layer inputs plus one layer recomputed during backward.
- workspace (estimates, each named): the loss's logits and their gradients, one layer's transient tensors, the
  dequantized 4-bit weight, FSDP2's gathered layers and gradient buffers, pipeline boundary buffers.
- reserve: the CUDA context and an allocator margin per GPU (data/inference.json, as the inference planner uses).
- loading (host RAM, per rank): what a rank holds while it streams its weights from the safetensors checkpoint, part
  by part in `gpu_memory._loading`; tests/test_streamed_load.py checks it within 15% of each rank's VmHWM.

Strategies (N GPUs; the assumptions the figures rest on):
- DDP: a full replica per GPU, each GPU runs `batch` sequences; DistributedDataParallel's gradient buckets are a second
  copy of the gradients (gradient_as_bucket_view=False, its default).
- FSDP2 (`fully_shard` per decoder layer and on the root): parameters, gradients and optimizer state sharded 1/N per
  GPU; bitsandbytes' quantization constants are not parameters, so every GPU keeps all of them (torchao's NF4, the
  course's, keeps them inside the sharded tensor: sharded with the codes); two decoder layers
  are all-gathered at once (the running one and the prefetched next) and the root (embedding, final norm, head) stays
  gathered from its forward to its backward. With CPU offload (CPUOffloadPolicy) the shards, gradients and optimizer
  state live in host RAM and the optimizer step runs there; the GPU keeps the gathered layers, activations and the
  constants. On GPUs the parameter shards and their gradients are pinned, each allocation rounded up to a power of
  two (`gpu_memory.pinned_rounding`); the CPU rig pins nothing.
- pipeline: one stage per GPU, decoder layers split evenly (earlier stages take the remainder), the embedding on the
  first stage and the final norm, head and loss on the last. `batch` is the micro-batch; under 1F1B stage j of p holds
  the activations of min(m, p - j) micro-batches (m micro-batches per step, `microbatches`).

Precision: compute in the base format's activation dtype (bf16 by default). "mixed" keeps the optimizer in fp32
(FSDP2: fp32 shards with a bf16 all-gather; DDP and pipeline, full fine-tuning: bf16 weights and gradients, fp32
master copy and moments, ZeRO's 16 bytes per parameter; LoRA outside FSDP2: peft's fp32 adapters). "pure" keeps
everything in the compute dtype (answer.ai's --precision bf16).

Attention is assumed to run a fused SDPA kernel (flash or memory-efficient: no context x context scores saved) on
unpadded sequences (no attention mask: packed or equal-length batches, so transformers lets SDPA handle GQA without
repeating K and V); the activation model knows Llama-style decoders (q/k/v/o_proj, gate/up/down_proj), which every
bundled model is.

Here: the plan and what would fit when it does not; the request and its checks are `training_request`'s, each GPU's
parts `gpu_memory`'s.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from helpers.finetune.gpu_memory import GpuTraining, gpu_training, pipeline_stages
from helpers.finetune.training_request import PLAN_STRATEGIES, TrainingRequest, check_request
from helpers.sizing.gpus import Gpu, check_gpus, describe_gpus, largest_fitting
from helpers.sizing.shape import WeightFormat
from helpers.sizing.training import LLAMA_LINEARS, TrainShape, training_shape
from helpers.training.job import renamed
from helpers.units import fmt_bytes

# the planner's names, wherever they are defined (`python -m helpers.plan --train` and the notebooks import them here)
__all__ = ["GpuTraining", "PLAN_STRATEGIES", "Suggestion", "TrainingPlan", "TrainingRequest", "plan_training",
           "suggestions"]


# --- the plan -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Suggestion:
    """One change to the request, re-planned."""

    change: str  # in words
    flags: str  # the command-line flags that make it
    plan: "TrainingPlan"

    @property
    def fits(self) -> bool:
        return self.plan.fits

    def outcome(self) -> str:
        """'fits, 3.2 GiB left on the fullest GPU (host RAM 48 GiB)' or 'does not fit (short 1.1 GiB on a GPU)'."""
        free = min(d.free_bytes for d in self.plan.devices)
        host = f" (host RAM {fmt_bytes(self.plan.host_peak_bytes)} at its peak)" \
            if self.plan.request.host_ram_bytes is not None or self.plan.host_ram_bytes else ""
        if self.fits:
            return f"fits, {fmt_bytes(free)} left on the fullest GPU{host}"
        return f"does not fit ({fmt_bytes(-free)} short on the fullest GPU{host})" if free < 0 else \
            f"does not fit in host RAM{host}"

    def as_dict(self) -> dict:
        return {"change": self.change, "flags": self.flags, "fits": self.fits,
                "peak_bytes_per_gpu": [d.peak_bytes for d in self.plan.devices],
                "free_bytes_per_gpu": [d.free_bytes for d in self.plan.devices],
                "host_ram_bytes": self.plan.host_ram_bytes}


@dataclass(frozen=True)
class TrainingPlan:
    """A training request accounted per GPU (and in host RAM), with what would fit when it does not."""

    request: TrainingRequest
    shape: TrainShape
    devices: tuple[GpuTraining, ...]
    suggestions: tuple[Suggestion, ...] = ()

    @property
    def host_ram_bytes(self) -> int:
        return sum(d.host_bytes for d in self.devices)

    @property
    def loading_host_bytes(self) -> int:
        """The most host RAM one rank needs while it loads (its shards kept on the host with CPU offload, the
        largest unit it reads at once, quantization's workspace, the process itself); ranks on one machine add up."""
        return max(d.loading_bytes for d in self.devices)

    @property
    def host_peak_bytes(self) -> int:
        """Host RAM the run needs at its peak on one machine: every rank streaming its weights at once (their loading
        figures add up), or the training's offloaded shards, whichever is larger."""
        return max(self.host_ram_bytes, sum(d.loading_bytes for d in self.devices))

    @property
    def host_fits(self) -> bool:
        return self.request.host_ram_bytes is None or self.host_peak_bytes <= self.request.host_ram_bytes

    @property
    def fits(self) -> bool:
        return self.host_fits and all(d.free_bytes >= 0 for d in self.devices)

    def as_dict(self) -> dict:
        r, s = self.request, self.shape
        return {"fits": self.fits, "model": s.name, "method": s.method, "dtype": s.format.name,
                "strategy": r.strategy, "offload": r.offload, "activation_checkpointing": r.activation_checkpointing,
                "context": r.context, "batch": r.batch, "microbatches": r.microbatch_count,
                "global_batch": r.global_batch, "lora_rank": s.lora_rank, "lora_targets": list(s.lora_targets),
                "optimizer": r.optimizer, "precision": r.precision, "techniques": list(r.techniques),
                "params": {"total": s.total_params, "frozen": s.frozen_params, "trainable": s.trainable_params},
                "devices": [d.as_dict() for d in self.devices],
                "host_ram_bytes": self.host_ram_bytes, "host_ram_available_bytes": r.host_ram_bytes,
                "loading_host_ram_bytes_per_rank": self.loading_host_bytes,
                "host_ram_peak_bytes": self.host_peak_bytes,
                "suggestions": [x.as_dict() for x in self.suggestions]}

    def rows(self) -> list[dict]:
        return [{"device": d.label, "frozen": fmt_bytes(d.frozen_bytes), "trainable": fmt_bytes(d.trainable_bytes),
                 "grads": fmt_bytes(d.gradient_bytes), "optimizer": fmt_bytes(d.optimizer_bytes),
                 "activations": fmt_bytes(d.activation_bytes), "workspace": fmt_bytes(d.workspace_bytes),
                 "reserve": fmt_bytes(d.reserve_bytes), "peak": fmt_bytes(d.peak_bytes),
                 "free": fmt_bytes(d.free_bytes), "capacity": fmt_bytes(d.gpu.capacity_bytes),
                 "layers": d.layers} for d in self.devices]

    def describe(self) -> str:
        """Header lines, the per-GPU table, the activations both ways, host RAM, and the suggestions."""
        from helpers.report import table

        r, s = self.request, self.shape
        adapters = "" if s.method == "full" else f", LoRA rank {s.lora_rank} on {','.join(s.lora_targets)}"
        lines = [f"{s.name}, {s.method} ({s.format.name} base{adapters}): {s.total_params:,} parameters, "
                 f"{s.trainable_params:,} trainable, {s.frozen_params:,} frozen",
                 f"{r.strategy}{' + CPU offload' if r.offload == 'cpu' else ''} on {describe_gpus(r.gpus)}; context "
                 f"{r.context} x batch {r.batch} x {r.microbatch_count} micro-batch(es) (global batch "
                 f"{r.global_batch}); {r.optimizer}, {r.precision} precision, activation checkpointing "
                 f"{'on' if r.activation_checkpointing else 'off'}"
                 + (f", {', '.join(r.techniques)}" if r.techniques else "")
                 + f": {'fits' if self.fits else 'does NOT fit'}",
                 table(self.rows())]
        for d in self.devices:
            estimates = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.workspace.items())
            constants = f"quantization constants {fmt_bytes(d.constants_bytes)} (in frozen); " \
                if d.constants_bytes else ""
            lines.append(f"{d.label}: activations {fmt_bytes(d.activations_checkpointed_bytes)} with checkpointing, "
                         f"{fmt_bytes(d.activations_full_bytes)} without; {constants}optimizer step temporaries "
                         f"{fmt_bytes(d.step_bytes)}; workspace (estimates): {estimates or '-'}")
        if self.host_ram_bytes or r.host_ram_bytes:
            parts = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(sum(d.host.get(k, 0) for d in self.devices))}"
                              for k in self.devices[0].host)
            pinned = "pinned, " if r.pins_host_memory or r.uses("activation-offload") else ""
            what = " and ".join(x for x, on in (("CPU offload", r.offload == "cpu"),
                                                ("activation offload", r.uses("activation-offload"))) if on)
            lines.append(f"host RAM ({pinned}{what or 'CPU offload'}), all GPUs': {fmt_bytes(self.host_ram_bytes)}"
                         + ("" if r.host_ram_bytes is None else f" of {fmt_bytes(r.host_ram_bytes)}")
                         + (f" ({parts})" if parts else ""))
        worst = max(self.devices, key=lambda d: d.loading_bytes)
        lines.append(f"host RAM while loading, per rank: {fmt_bytes(worst.loading_bytes)} ("
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in worst.loading.items()) + "); the machine's peak, "
                     f"all {len(self.devices)} ranks at once or the offloaded shards: {fmt_bytes(self.host_peak_bytes)}"
                     + ("" if r.host_ram_bytes is None else f" of {fmt_bytes(r.host_ram_bytes)}"))
        if self.suggestions:
            lines.append("What would fit (one change each, cheapest first; re-planned):")
            lines += [f"  - {x.change} [{x.flags}]: {x.outcome()}" for x in self.suggestions]
        return "\n".join(lines)


def _check_fits_model(request: TrainingRequest, shape: TrainShape) -> None:
    longest = shape.max_position_embeddings
    if longest is not None and request.context > longest:
        raise ValueError(f"context {request.context} is longer than {shape.name} handles "
                         f"(max_position_embeddings {longest}): train on at most {longest} tokens per sequence")
    if not set(LLAMA_LINEARS) <= set(shape.decoder_linears):
        raise ValueError(f"the activation model knows Llama-style decoder layers ({', '.join(LLAMA_LINEARS)}); "
                         f"{shape.name}'s layers have {', '.join(shape.decoder_linears)}")
    stages = len(request.gpus)
    if request.pipelined and stages > len(shape.decoders):
        raise ValueError(f"a pipeline of {stages} stages needs at least {stages} decoder layers; {shape.name} has "
                         f"{len(shape.decoders)}")


def _plan(request: TrainingRequest) -> TrainingPlan:
    shape = training_shape(request.model, request.method, request.dtype, request.lora_rank, request.lora_targets)
    _check_fits_model(request, shape)
    n = len(request.gpus)
    if request.pipelined:
        groups = pipeline_stages(shape, n)
        devices = [gpu_training(request, shape, j, g, min(request.microbatch_count, n - j), j == 0, j == n - 1)
                   for j, g in enumerate(groups)]
    else:
        everything = list(range(len(shape.units)))
        devices = [gpu_training(request, shape, j, everything, 1, True, True) for j in range(n)]
    return TrainingPlan(request, shape, tuple(devices))


def plan_training(model="llama-2-7b", method: str = "qlora", context: int = 2048, batch: int = 1,
                  gpus: Sequence[Gpu] | str | None = None, strategy: str = "fsdp2", offload: str = "none",
                  activation_checkpointing: bool = True, lora_rank: int | None = None, lora_targets: str = "all",
                  optimizer: str = "adamw", precision: str = "mixed", dtype: str | WeightFormat | None = None,
                  microbatches: int | None = None, host_ram_bytes: int | None = None,
                  techniques: Sequence[str] | str = (), suggest: bool = True, **old) -> TrainingPlan:
    """Per-GPU memory of fine-tuning `model` (a bundled name, a Hugging Face id, a directory holding a config.json, or
    a transformers config) with `method` on `gpus` (default two RTX 3090s), and, when it does not fit, the changes
    that would (`TrainingPlan.suggestions`, each re-planned, cheapest first). `dtype`: a format's name, or a
    `WeightFormat` (e.g. NF4 computing in fp32, as on the CPU rig). `strategy`: a catalog name (ddp, fsdp2, or
    1f1b: a pipeline of one stage per GPU); `microbatches` per optimizer step (accumulated, or the pipeline's).
    `techniques`: memory techniques (training_request.TECHNIQUES: optimizer-in-backward, chunked-loss,
    activation-offload; data/training_memory.json "techniques" says what each changes). `optimizer`: adamw, torchao's
    low-bit adamw-8bit and adamw-4bit (what the training loop runs), or bitsandbytes' adamw-8bit-bnb (planned only).
    `suggest=False`: no suggestions (what a table of many plans wants: they re-plan).
    `old`: the deprecated `checkpointing=` and `grad_accum=` (helpers.training.job.RENAMED)."""
    old = renamed(old)
    if set(old) - {"activation_checkpointing", "microbatches"}:
        raise TypeError(f"plan_training() got unknown option(s) {sorted(old)}")
    activation_checkpointing = old.get("activation_checkpointing", activation_checkpointing)
    microbatches = old.get("microbatches", microbatches)
    request = check_request(TrainingRequest(
        model=model if hasattr(model, "model_type") else str(model), method=method, context=context, batch=batch,
        gpus=tuple(check_gpus(gpus)), strategy=strategy, offload=offload,
        activation_checkpointing=activation_checkpointing, lora_rank=lora_rank, lora_targets=lora_targets,
        optimizer=optimizer, precision=precision, dtype=dtype, microbatches=microbatches,
        host_ram_bytes=host_ram_bytes, techniques=techniques))
    plan = _plan(request)
    return plan if plan.fits or not suggest else dataclasses.replace(plan, suggestions=suggestions(plan))


# --- when it does not fit ---------------------------------------------------------------------------------------

def _try_plan(request: TrainingRequest) -> TrainingPlan | None:
    """The plan, or None for a change this model cannot take (e.g. a pipeline deeper than its layers)."""
    try:
        return _plan(request)
    except ValueError:
        return None


def _fits(request: TrainingRequest) -> bool:
    return (plan := _try_plan(request)) is not None and plan.fits


def _better(plan: TrainingPlan, other: TrainingPlan) -> bool:
    """Whether `other` needs less on the fullest GPU than `plan`, or fits host RAM where `plan` does not."""
    worst = max(d.peak_bytes for d in plan.devices)
    return max(d.peak_bytes for d in other.devices) < worst or (other.host_fits and not plan.host_fits)


def _lowers_peak(plan: TrainingPlan, request: TrainingRequest) -> bool:
    """Whether `request` (one change to the plan's) is `_better`: a technique is offered only where it helps (the
    chunked loss's chunk can outweigh a small model's logits; while the optimizer step's temporaries make the peak,
    neither the chunked loss nor activation offload lowers it)."""
    return (other := _try_plan(request)) is not None and _better(plan, other)


def _technique(plan: TrainingPlan, name: str) -> TrainingRequest | None:
    """The request with technique `name` added, where the request lacks it, can take it and it helps."""
    r = plan.request
    if r.uses(name):
        return None
    changed = dataclasses.replace(r, techniques=(*r.techniques, name))
    try:
        check_request(changed)
    except ValueError:  # optimizer-in-backward: FSDP2 without CPU offload, one micro-batch a step
        return None
    return changed if _lowers_peak(plan, changed) else None


TECHNIQUE_CHANGES = {  # technique -> what it changes, in words (data/training_memory.json "techniques" says how)
    "optimizer-in-backward": "step the optimizer in backward, each gradient freed as it is used (same numbers)",
    "chunked-loss": "the head and loss in chunks of tokens, recomputed in backward (same numbers)",
    "activation-offload": "offload saved activations to pinned host RAM (same numbers; they cross PCIe twice a step)"}


def _candidates(plan: TrainingPlan) -> list[tuple[str, str, TrainingRequest]]:
    """One-change alternatives, cheapest first. First the changes that train the same model (same data, same global
    batch, the same numbers but for summation order): the step in backward (no extra work; full fine-tuning, where
    the gradients are large) and the chunked loss (the head's matmul once more), checkpointing (about one more
    forward per step), a smaller micro-batch with more accumulation (less work per kernel), activation offload
    (saved activations cross PCIe each step), FSDP2 sharding (more communication), CPU offload (every layer crosses
    PCIe each step); each technique offered only where it lowers the peak (`_lowers_peak`). Then the changes to what
    is trained: 8-bit, then 4-bit AdamW (quantized moments), pure bf16 (no fp32 master copy: bf16 weights and
    moments), a smaller LoRA rank, a lighter method (lora, then qlora), and last a shorter context (the model sees
    less text per sequence). Searches (micro-batch, rank, context) keep the largest value that fits."""
    r = plan.request
    out = []

    def technique(name: str) -> None:
        changed = _technique(plan, name) if name != "optimizer-in-backward" or plan.shape.method == "full" else None
        if changed is not None:
            out.append((TECHNIQUE_CHANGES[name], f"--technique {name}", changed))

    technique("optimizer-in-backward")
    technique("chunked-loss")
    if not r.activation_checkpointing:
        out.append(("turn activation checkpointing on (about one more forward per step)",
                    "--activation-checkpointing", dataclasses.replace(r, activation_checkpointing=True)))
    if r.batch > 1:
        smaller = [d for d in range(r.batch - 1, 0, -1) if r.batch % d == 0]
        best = next((d for d in smaller if _fits(dataclasses.replace(
            r, batch=d, microbatches=r.microbatch_count * r.batch // d))), smaller[-1])
        accum = r.microbatch_count * r.batch // best
        out.append((f"micro-batch {best} with {accum} accumulation steps (global batch {r.global_batch} kept)",
                    f"--batch {best} --microbatches {accum}",
                    dataclasses.replace(r, batch=best, microbatches=accum)))
    technique("activation-offload")
    if r.strategy != "fsdp2":
        out.append(("shard weights, gradients and optimizer state with FSDP2", "--strategy fsdp2",
                    dataclasses.replace(r, strategy="fsdp2", microbatches=None if r.pipelined else r.microbatches)))
    if r.offload == "none" and not r.uses("optimizer-in-backward"):
        out.append(("FSDP2 with CPU offload (shards, gradients and the optimizer step in host RAM)",
                    ("" if r.strategy == "fsdp2" else "--strategy fsdp2 ") + "--offload cpu",
                    dataclasses.replace(r, strategy="fsdp2", offload="cpu",
                                        microbatches=None if r.pipelined else r.microbatches)))
    for name, words in (("adamw-8bit", "8-bit AdamW (torchao)"), ("adamw-4bit", "4-bit AdamW (torchao)")):
        if r.optimizer not in (name, "adamw-4bit"):
            out.append((words, f"--optimizer {name}", dataclasses.replace(r, optimizer=name)))
    if r.precision == "mixed" and _lowers_peak(plan, dataclasses.replace(r, precision="pure")):
        out.append(("pure bf16: weights, gradients and moments in bf16, no fp32 master copy (torchao's low-bit "
                    "AdamW rounds its updates stochastically)", "--precision pure",
                    dataclasses.replace(r, precision="pure")))
    rank = plan.shape.lora_rank
    if rank and rank > 1:
        ranks = [rank // 2**k for k in range(1, rank.bit_length()) if rank // 2**k >= 1]
        best = next((k for k in ranks if _fits(dataclasses.replace(r, lora_rank=k))), ranks[-1])
        out.append((f"LoRA rank {best} instead of {rank}", f"--lora-rank {best}",
                    dataclasses.replace(r, lora_rank=best)))
    lighter = {"full": ["lora", "qlora"], "lora": ["qlora"]}.get(plan.shape.method, [])
    for method in lighter:
        out.append((f"{method} instead of {plan.shape.method}", f"--method {method}",
                    dataclasses.replace(r, method=method, dtype=None if method == "qlora" else r.dtype)))
    best = largest_fitting(lambda c: _fits(dataclasses.replace(r, context=c)), r.context - 1)
    if best:  # 0: not even one token fits
        out.append((f"context {best} tokens instead of {r.context}", f"--context {best}",
                    dataclasses.replace(r, context=best)))
    return out


def _replan(candidates: list[tuple[str, str, TrainingRequest]]) -> list[Suggestion]:
    return [Suggestion(change, flags, plan) for change, flags, request in candidates
            if (plan := _try_plan(request)) is not None]


def _same_model(flags: str) -> bool:
    """Whether a change keeps the model and the text it trains on: not a lighter method, not a shorter context."""
    return not flags.startswith(("--method", "--context"))


def _delta(before: TrainingRequest, after: TrainingRequest) -> dict:
    """The fields one change sets (techniques: those it adds)."""
    changed = {f.name: getattr(after, f.name) for f in dataclasses.fields(after)
               if getattr(after, f.name) != getattr(before, f.name)}
    if "techniques" in changed:
        changed["techniques"] = tuple(t for t in after.techniques if t not in before.techniques)
    return changed


def _applied(request: TrainingRequest, deltas: Sequence[dict]) -> TrainingRequest:
    for delta in deltas:
        added = (*request.techniques, *delta.get("techniques", ()))
        request = check_request(dataclasses.replace(request, **{**delta, "techniques": added}))
    return request


def _stack(plan: TrainingPlan, same_model: bool) -> Suggestion | None:
    """The cheapest combination found greedily: apply the cheapest change that lowers the fullest GPU's peak (or
    makes host RAM fit), re-plan, repeat until it fits or nothing helps (`same_model`: changes of method and context
    left out); then, where it fits, drop each change it still fits without, the dearest first (a 4-bit AdamW taken
    after an 8-bit one leaves the 8-bit one nothing to do)."""
    current, steps = plan, []
    while not current.fits:
        better = [s for s in _replan(_candidates(current))
                  if (not same_model or _same_model(s.flags)) and _better(current, s.plan)]
        if not better:
            break
        steps.append((better[0], _delta(current.request, better[0].plan.request)))
        current = better[0].plan
    if not steps:
        return None
    for step in reversed(steps[:-1] if current.fits else []):
        rest = [s for s in steps if s is not step]
        try:
            without = _plan(_applied(plan.request, [delta for _, delta in rest]))
        except ValueError:
            continue
        if without.fits:
            steps, current = rest, without
    return Suggestion(" + ".join(s.change for s, _ in steps), " ".join(s.flags for s, _ in steps), current)


def suggestions(plan: TrainingPlan) -> tuple[Suggestion, ...]:
    """What would fit: each one-change alternative re-planned, cheapest first (see `_candidates`). When no single
    change that keeps the model and its text fits, the cheapest such combination (`_stack`) is appended if it fits;
    failing that, when no single change fits at all, the cheapest combination of any changes."""
    single = _replan(_candidates(plan))
    if any(s.fits and _same_model(s.flags) for s in single):
        return tuple(single)
    stack = _stack(plan, same_model=True)
    if stack is not None and stack.fits:
        return (*single, stack)
    if any(s.fits for s in single):
        return tuple(single)
    stack = _stack(plan, same_model=False)
    return tuple(single) if stack is None else (*single, stack)
