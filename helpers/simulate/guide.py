"""Which way to train a model on two GPUs: every strategy given the same chances, timed by the simulator.

Fair means: each strategy may accumulate gradients over micro-batches and checkpoint activations wherever that
makes it fit (DDP, ZeRO-1 and FSDP2 as much as a pipeline); the attention-score activations are counted only where
the attention implementation keeps them (eager attention does; SDPA and FlashAttention recompute them in
backward); time comes from the simulator on roofline costs of the target rig, memory from the ZeRO formulas and the
activations the simulated schedule holds. Among the options that fit, the fastest wins; within `tolerance` (5%:
simulators of this kind err by about that much: Calculon 3.65% mean, 8.87% max on A100 clusters, calculon-ai/calculon
llm-validation) the simplest wins (DDP, then
ZeRO-1, FSDP2, a pipeline).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from helpers.catalog import CATALOG, names, strategy as catalog_entry
from helpers.partition import equal_count_split, optimal_split, proportional_shares
from helpers.units import fmt_bytes
from helpers.sizing.activations import transformer_activation_bytes
from helpers.sizing.gpus import Gpu
from helpers.sizing.shape import ModelShape, decoder_shape
from helpers.hardware import Efficiency, TargetRig, target_rig
from helpers.dtypes import BYTES
from helpers.simulate.roofline import Kernel, kernels_s, optimizer_s, step_s, trace_kernels
from helpers.simulate.job import Job
from helpers.simulate.strategies import Simulation, simulate, simulate_memory
from helpers.simulate.workload import LayerCost, Workload

# the strategies the guide weighs, simplest first (the catalog's order): the data-parallel strategies whose layout a
# PyTorch API gives by its defaults (DDP, ZeroRedundancyOptimizer, fully_shard; ZeRO-2 is fully_shard with its
# reshard_after_forward turned off, a knob of FSDP2's rather than another choice), then the pipeline of notebook 06:
# 1F1B, GPipe's bubble at fewer activations, which GPipe and the naive split never beat in the simulator (the
# schedules past it are notebook 06b's own comparison). DeepSpeed's stages are left to notebook 07's comparison: the
# simulator prices its ZeRO-3 with FSDP2's schedule, so the guide would weigh one layout twice
GUIDE_STRATEGIES = (*(s.name for s in CATALOG if s.kind == "data_parallel" and s.reshard_after_forward is not False
                      and s.library == "pytorch"), *names("pipeline", notebook="06"))
MICROBATCHES = (1, 2, 4, 8, 16, 32)
AFTER_BACKWARD_MB = 1e9  # a DDP bucket no model fills: one all-reduce of every gradient once the backward is done


SIZES = {  # family, layers, hidden, heads, vocab, intermediate: as in each model's Hugging Face config
    "GPT-2 small": ("gpt2", 12, 768, 12, 50257, 3072),
    "GPT-2 medium": ("gpt2", 24, 1024, 16, 50257, 4096),
    "GPT-2 XL": ("gpt2", 48, 1600, 25, 50257, 6400),
    "Llama-2 7B": ("llama", 32, 4096, 32, 32000, 11008),
    "Llama-2 13B": ("llama", 40, 5120, 40, 32000, 13824),
}


class _Shapes(Mapping):
    """The guide's models by name, each a `helpers.sizing.shape.ModelShape` built (on the meta device) when first
    asked for."""

    def __getitem__(self, name: str) -> ModelShape:
        return _shape_of(name)

    def __iter__(self):
        return iter(SIZES)

    def __len__(self) -> int:
        return len(SIZES)


@functools.lru_cache(maxsize=None)
def _shape_of(name: str) -> ModelShape:
    if name not in SIZES:
        raise KeyError(name)
    return decoder_shape(*SIZES[name])


MODELS = _Shapes()


ATTENTION_KERNELS = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa"}  # what the trace runs for each

# LoRA as the trace runs it (helpers.simulate.finetune prices LoRA and QLoRA with it)
LORA_SCALING = 0.25  # alpha / rank: its value costs nothing (one multiply either way)


class LoraLinear(nn.Module):
    """peft's LoRA linear as it computes (peft tuners/lora/layer.py `Linear.forward`): the frozen base's output plus
    lora_B(lora_A(dropout(x))) * scaling; no dropout module when its probability is 0 (peft's nn.Identity)."""

    def __init__(self, base: nn.Linear, rank: int, dropout: float):
        super().__init__()
        self.base = base
        kw = {"bias": False, "device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Linear(base.in_features, rank, **kw)
        self.lora_b = nn.Linear(rank, base.out_features, **kw)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(self.dropout(x))) * LORA_SCALING


def adapt(block: nn.Module, rank: int, targets: tuple[str, ...], dropout: float) -> None:
    """Replace each nn.Linear of `block` whose last name part is in `targets` by its `LoraLinear`, in place."""
    for name, module in list(block.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if isinstance(module, nn.Linear) and leaf in targets:
            setattr(block.get_submodule(parent_name), leaf, LoraLinear(module, rank, dropout))


@functools.lru_cache(maxsize=64)
def _decoder_kernels(shape: ModelShape, seq: int, head_outputs: int | None, batch: int, dtype: str, attention: str,
                     lora: tuple[int, tuple[str, ...], float] | None = None):
    """Kernels (forward, backward) of embedding, one block, final norm and head for `batch` sequences, traced on a
    one-block model built on the meta device, with its parameter and parameter-tensor counts (trainable ones). Dropout
    as the family's Hugging Face default has it in training (GPT-2 0.1, Llama none). `lora` (rank, targets,
    dropout): the base frozen and the block's target linears adapted (`adapt`), so that
    backward computes input gradients only, but for the adapters'."""
    from helpers.models import build_hf_model, hf_layers

    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention implementation {attention!r}; choose one of {list(ATTENTION_KERNELS)}")
    family = shape.config.model_type
    model = build_hf_model(family, 1, shape.hidden, shape.heads, shape.vocab, seq, shape.intermediate, meta=True,
                           kv_heads=shape.kv_heads if shape.kv_heads != shape.heads else None,
                           dropout=0.1 if family == "gpt2" else 0.0, attn_implementation=ATTENTION_KERNELS[attention])
    embedding, block, norm, head = hf_layers(model)
    if head_outputs is not None:
        with torch.device("meta"):
            head = torch.nn.Linear(shape.hidden, head_outputs)
    if lora is not None:
        model.requires_grad_(False)
        adapt(block, *lora)
    kernels = trace_kernels([embedding, block, norm, head], torch.zeros(batch, seq, dtype=torch.long), dtype)
    params = [sum(p.numel() for p in module.parameters() if p.requires_grad) for module in (embedding, block, norm, head)]
    tensors = [max(1, len([p for p in module.parameters() if p.requires_grad]))
               for module in (embedding, block, norm, head)]
    if shape.tied and head_outputs is None:
        params[3] = 0  # a tied head (GPT-2's) is the embedding's weight: counted once
    return tuple(kernels), tuple(params), tuple(tensors)


def transformer_workload(shape: ModelShape, seq: int, gpu: Gpu, dtype: str = "bf16", attention: str = "sdpa",
                         recipe: str = "mixed precision + Adam", head_outputs: int | None = None, batch: int = 8,
                         eff: Efficiency | None = None) -> Workload:
    """Per-sample costs of a decoder (`helpers.sizing.shape.ModelShape`: `model_shape(config)`, `decoder_shape(...)`
    or one of MODELS) on `gpu`: embedding, blocks, final norm, head (`head_outputs`: a task head, e.g. 2 for SQuAD
    span logits, instead of the language-model head), each timed kernel by kernel (`helpers.simulate.roofline`) at a
    micro-batch of `batch` sequences (the size launch overheads amortise over). A block's activations by
    Korthikanti et al.'s formula (`transformer_activation_bytes`: the attention scores only where `attention` stores
    them); the head keeps its input and fp32 logits for the loss (an estimate of what Hugging Face's loss holds); a
    tied head's weight is the embedding's (counted once)."""
    kernels, counts, tensors = _decoder_kernels(shape, seq, head_outputs, batch, dtype, attention)
    layers = decoder_layers(shape, seq, gpu, dtype, attention, head_outputs, batch, eff, kernels, counts, tensors)
    n_params = sum(layer.params for layer in layers)
    return Workload(tuple(layers), recipe, optimizer_s(n_params, recipe, gpu))


def decoder_layers(shape: ModelShape, seq: int, gpu: Gpu, dtype: str, attention: str, head_outputs: int | None,
                   batch: int, eff: Efficiency | None, kernels, counts, tensors) -> list[LayerCost]:
    """Embedding, blocks, final norm and head as `LayerCost`s from their traced kernels (`_decoder_kernels`), each
    kernel timed on `gpu` (`step_s`) and the activations as `transformer_workload` says. A layer whose backward runs
    no kernel (a frozen embedding: its output's gradient is the last autograd computes) costs one kernel launch
    there, the floor `kernel_s` puts under every kernel."""
    v, outputs = BYTES[dtype], head_outputs or shape.vocab
    hidden_bytes = seq * shape.hidden * v
    parts = [("embedding", 0.0, hidden_bytes),
             ("block", transformer_activation_bytes(1, seq, shape.hidden, 1, shape.heads, v, attention), hidden_bytes),
             ("final norm", hidden_bytes, hidden_bytes),
             ("head", hidden_bytes + seq * outputs * (v + 4), seq * outputs * v)]
    layers = []
    launch = Kernel("memory", 0.0, 0.0)
    for (name, activations, output), trace, params, n_tensors in zip(parts, kernels, counts, tensors):
        cost = LayerCost(name, step_s(trace.forward, gpu, dtype, batch, eff),
                         step_s(trace.backward or (launch,), gpu, dtype, batch, eff), params, activations, output,
                         n_tensors)
        blocks = len(shape.decoder_layers)
        layers += [replace(cost, name=f"block {i}") for i in range(blocks)] if name == "block" else [cost]
    return layers


def block_tflops(shape: ModelShape, seq: int, gpu: Gpu, dtype: str = "bf16", attention: str = "sdpa",
                 batch: int = 8) -> float:
    """TFLOPS one of the model's blocks sustains forward + backward on `gpu` (its traced kernels' FLOPs over their
    time): a single figure for back-of-the-envelope compute times, from the same model as `transformer_workload`."""
    block = _decoder_kernels(shape, seq, None, batch, dtype, attention)[0][1]
    kernels = block.forward + block.backward
    return sum(k.flops for k in kernels) / kernels_s(kernels, gpu, dtype) / 1e12


@dataclass(frozen=True)
class Option:
    """The best configuration found for one strategy, or its smallest footprint when nothing fits."""

    job: Job
    peak_bytes: int
    fits: bool
    simulation: Simulation | None
    n_layers: int = 0  # the workload's layers (embedding, blocks, norm, head): to name a pipeline's split

    @property
    def step_s(self) -> float | None:
        return self.simulation.step_s if self.simulation else None

    @property
    def split(self) -> str:
        """How the work is dealt to unequal cards: the batch's shares, or the pipeline's layers per card ('' when
        the cards are equal)."""
        if self.job.shares:
            return "batch " + " + ".join(map(str, self.job.shares))
        if self.job.speeds and self.job.boundaries:
            edges = [0, *self.job.boundaries, self.n_layers]
            return "layers " + " | ".join(f"{a}-{b - 1}" for a, b in zip(edges, edges[1:]))
        return ""

    def row(self) -> dict:
        return {"strategy": self.job.entry.label, "micro-batches": self.job.microbatches,
                "checkpointing": self.job.activation_checkpointing, "peak per GPU": fmt_bytes(self.peak_bytes),
                "fits": self.fits, "step (s)": self.step_s,
                "samples/s": self.simulation.samples_per_s if self.simulation else None,
                **({"split by speed": self.split} if self.job.speeds else {})}


@dataclass(frozen=True)
class Recommendation:
    model: str
    rig: str
    n_params: int
    options: tuple[Option, ...]
    choice: str
    cards: tuple[str, ...] = ()  # a mixed rig's GPUs, in device order
    speeds: tuple[float, ...] | None = None  # their relative speeds on this model
    equal_step_s: float | None = None  # the chosen option's step with the work dealt equally (a mixed rig)

    def why(self) -> str:
        """On a mixed rig: the cards' speeds, how the choice deals its work to them, and what the equal split
        would cost ('' on equal cards)."""
        chosen = self.chosen
        if not self.speeds or chosen is None:
            return ""
        speeds = ", ".join(f"{card} {v:.2f}" for card, v in zip(self.cards, self.speeds))
        slower = self.cards[self.speeds.index(min(self.speeds))]
        return (f"relative speed on {self.model}: {speeds}; {self.choice} deals the work by speed ({chosen.split}), "
                f"a step of {chosen.step_s:.3f} s; dealt equally, every step would wait for the {slower}: "
                f"{self.equal_step_s:.3f} s. Tensor parallelism (not among these) splits every layer in halves: "
                f"each waits for the {slower}'s")

    def rows(self) -> list[dict]:
        return [option.row() for option in self.options]

    @property
    def chosen(self) -> Option | None:
        """The option the choice names (None when nothing fits)."""
        return next((o for o in self.options if o.fits and o.job.label() == self.choice), None)


def relative_speeds(workloads: Sequence[Workload]) -> tuple[float, ...]:
    """Each card's speed relative to the first on the same model (its workload priced on that card): the first
    card's forward + backward time over this card's."""
    totals = [sum(layer.forward_s + layer.backward_s for layer in w.layers) for w in workloads]
    return tuple(totals[0] / t for t in totals)


def _candidates(strategy: str, batch: int, devices: int, speeds: tuple[float, ...] | None = None) -> list[Job]:
    """Every micro-batch count that divides the batch, without and then with checkpointing. On cards of unequal
    `speeds` a data-parallel job deals the batch by speed (`proportional_shares`) and a pipeline splits by time
    at those speeds (the simulator's time-balanced split)."""
    jobs = []
    entry = catalog_entry(strategy)
    sizes = {"pp": devices if entry.pipeline else 1, "dp": devices if entry.data_parallel else 1}
    for checkpointing in (False, True):
        for m in MICROBATCHES:
            try:
                shares = proportional_shares(batch, speeds, m) if speeds and entry.data_parallel else None
                job = Job(strategy, batch, microbatches=m, activation_checkpointing=checkpointing, speeds=speeds,
                          shares=shares, **sizes)
            except ValueError:
                continue  # the batch does not split this way
            if strategy == "1f1b" and m < devices:
                continue
            jobs.append(job)
    return jobs


def exposed_exchange(job: Job) -> Job:
    """`job` with none of its gradient and parameter exchange hidden behind compute: DDP and ZeRO-1 all-reduce every
    gradient in one piece once the backward is done, FSDP2's gathers and reduce-scatters hold the compute they would
    overlap. What the published two-GPU runs show (Lambda's logs: helpers.simulate.published), where PyTorch's DDP
    and FSDP2 are designed to overlap (notebook 07 measures DDP's overlap here); a pipeline is left as it is (its
    transfers are small and on its schedule's critical path already)."""
    if job.entry.bucketed:
        return replace(job, first_bucket_mb=AFTER_BACKWARD_MB, bucket_mb=AFTER_BACKWARD_MB)
    return replace(job, host_waits=True) if job.entry.fully_sharded else job


def best_option(workload: Workload, rig: TargetRig, strategy: str, batch: int, capacity: int | Sequence[int],
                overlap: bool = True, speeds: tuple[float, ...] | None = None) -> Option:
    """The fastest configuration of `strategy` that fits `capacity` bytes per GPU (or one capacity per GPU: a mixed
    rig's) (simulated: messages over the rig's link, collectives at the rig's all-reduce, the one the published
    checks use), or if none fits the one with the smallest footprint. `overlap=False`: no communication hidden
    behind compute (`exposed_exchange`). `speeds`: the cards' relative speeds on a mixed rig."""
    caps = [capacity] * rig.devices if isinstance(capacity, int) else list(capacity)
    best, smallest = None, None
    for job in _candidates(strategy, batch, rig.devices, speeds):
        job = job if overlap else exposed_exchange(job)
        if speeds and job.entry.pipeline:  # the split by time at the cards' speeds, named in the job
            layout = job.layout
            per_stage = [speeds[layout.device_of(j)] for j in range(layout.stages)]
            job = replace(job, boundaries=optimal_split(workload.time_costs(), layout.stages, speeds=per_stage)
                          .boundaries)
        memory = simulate_memory(workload, job)
        peak = max(m.total for m in memory.values())
        if smallest is None or peak < smallest.peak_bytes:
            smallest = Option(job, peak, False, None, len(workload.layers))
        if all(memory[d].total <= caps[d % len(caps)] for d in memory):
            sim = simulate(workload, job, rig.link, rig.collectives)
            if best is None or sim.step_s < best.step_s:
                best = Option(job, peak, True, sim, len(workload.layers))
    if best is None and smallest is None:
        raise ValueError(f"global batch {batch} cannot be split for {catalog_entry(strategy).label} on {rig.devices} GPUs")
    return best or smallest


def recommend(workload: Workload, rig: TargetRig | str = "2x3090 PCIe", batch: int = 16, model: str = "model",
              reserve_bytes: int | None = None, tolerance: float = 0.05, overlap: bool = True,
              speeds: tuple[float, ...] | None = None) -> Recommendation:
    """Best option per strategy on `rig` for one optimizer step of `batch` samples, and the choice. Each GPU keeps
    `reserve_bytes` for the runtime (default: the CUDA context and allocator margin, helpers.sizing.gpus). DDP, ZeRO-1
    and FSDP2 overlap their exchange with compute as PyTorch designs them to (`overlap`, the default);
    `overlap=False` exposes it (`exposed_exchange`), as every published two-GPU run the course checks against shows:
    plan with both where they choose differently. On a mixed rig, `speeds` (`relative_speeds`) balance each
    strategy by the cards' speeds and each card is held to its own memory."""
    rig = target_rig(rig) if isinstance(rig, str) else rig
    caps = [card.capacity_bytes - (card.reserve_bytes if reserve_bytes is None else reserve_bytes)
            for card in rig.cards]
    options = tuple(best_option(workload, rig, s, batch, caps, overlap, speeds) for s in GUIDE_STRATEGIES)
    fitting = [o for o in options if o.fits]
    if not fitting:
        choice = (f"does not fit {rig.devices} {rig.gpu.name}s: more GPUs or machines (DP x PP, torchrun), "
                  "CPU offload, or a smaller footprint (LoRA / QLoRA)")
    else:
        fastest = min(o.step_s for o in fitting)
        choice = next(o.job.label() for o in fitting if o.step_s <= fastest * (1 + tolerance))
    rec = Recommendation(model, rig.name, workload.n_params, options, choice,
                         tuple(card.name for card in rig.cards) if speeds else (), speeds)
    if speeds and rec.chosen is not None:
        equal = replace(rec.chosen.job, shares=None, boundaries=(
            equal_count_split(len(workload.layers), rec.chosen.job.layout.stages)
            if rec.chosen.job.entry.pipeline else None))
        rec = replace(rec, equal_step_s=simulate(workload, equal, rig.link, rig.collectives).step_s)
    return rec


def recommend_model(name: str, rig: TargetRig | str = "2x3090 PCIe", batch: int = 16, seq: int = 1024,
                    attention: str = "sdpa", dtype: str = "bf16",
                    recipe: str = "mixed precision + Adam") -> Recommendation:
    """`recommend` for one of MODELS (GPT-2 small / medium / XL, Llama-2 7B / 13B), `batch` sequences of `seq`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    rig = target_rig(rig) if isinstance(rig, str) else rig
    workloads = [transformer_workload(MODELS[name], seq, card, dtype, attention, recipe) for card in rig.cards]
    return recommend(workloads[0], rig, batch, model=name, speeds=relative_speeds(workloads) if rig.mixed else None)


def decision_table(rig: str = "2x3090 PCIe", batch: int = 16, seq: int = 1024, attention: str = "sdpa") -> list[dict]:
    """One row per model of MODELS: its parameters, the step time of each strategy's best option that fits, and
    the choice."""
    rows = []
    for name in MODELS:
        rec = recommend_model(name, rig, batch, seq, attention)
        row = {"model": name, "params (B)": rec.n_params / 1e9}
        for option in rec.options:
            label = option.job.entry.label
            row[label] = f"{option.step_s:.2f} s ({option.job.label()})" if option.fits else \
                f"needs {fmt_bytes(option.peak_bytes)}"
        row["choose"] = rec.choice
        rows.append(row)
    return rows


@dataclass(frozen=True)
class TwoCardAnswer:
    """DDP or a pipeline for one model on two GPUs: the guide's choice with DDP's gradient all-reduce hidden behind
    the backward (PyTorch's design), the choice with it exposed (what every published two-GPU run the course checks
    paid, `exposed_exchange`), and the condition that flips the one into the other, all simulated."""

    model: str
    rig: str
    batch: int
    seq: int
    choice: str               # the all-reduce hidden behind the backward (`recommend`'s default)
    flipped: str              # the all-reduce exposed (`recommend(..., overlap=False)`)
    ddp_s: float              # DDP's simulated step, the all-reduce hidden
    one_gpu_s: float          # one GPU's step on its share of the batch (batch / 2 sequences): DDP without exchange
    allreduce_s: float        # DDP's whole gradient all-reduce, exposed: its exposed step minus one_gpu_s
    rival_s: float            # the fastest other strategy's step with everything exposed (what DDP must stay near)
    flip_s: float             # DDP stays the choice while at most this much of its all-reduce shows in its step

    @property
    def flips(self) -> bool:
        """Whether exposing the exchange changes the answer at all."""
        return self.choice != self.flipped

    def sentence(self) -> str:
        """The answer in one sentence: notebooks 08 and 10 print it, INSTRUCTORS.md quotes it."""
        head = f"{self.model} (batch {self.batch} x {self.seq}) on {self.rig}: {self.choice}"
        if not self.flips:
            return (f"{head}, whether DDP's {self.allreduce_s * 1e3:.0f} ms gradient all-reduce hides behind the "
                    f"backward or not.")
        return (f"{head} while its gradient all-reduce ({self.allreduce_s * 1e3:.0f} ms) hides behind the backward; "
                f"{self.flipped} once more than {self.flip_s * 1e3:.0f} ms of it shows, i.e. once a DDP step takes "
                f"{self.flip_s * 1e3:.0f} ms longer than one GPU's step on its {self.batch // 2} sequences.")


def ddp_or_pipeline(model: str = "GPT-2 medium", rig: TargetRig | str = "2x3090 PCIe", batch: int = 16,
                    seq: int = 1024, tolerance: float = 0.05) -> TwoCardAnswer:
    """The course's one answer to "DDP or 1F1B for GPT-2 medium on two PCIe 3090s?", and the condition that flips it.

    Both choices are `recommend_model`'s rule (the fastest that fits, the simplest within `tolerance`), once with
    DDP's all-reduce overlapping the backward and once exposed. The flip: a DDP step is one GPU's step on its half
    of the batch plus the part of the all-reduce that shows; DDP stays the choice while that step is within
    `tolerance` of the fastest other strategy's with nothing hidden, so the threshold is
    (1 + tolerance) x that step - one GPU's step. A learner measures the same difference on the cards: a DDP step
    against one GPU's step on the same per-GPU batch (no exchange)."""
    rig = target_rig(rig) if isinstance(rig, str) else rig
    workload = transformer_workload(MODELS[model], seq, rig.gpu)
    hidden = recommend(workload, rig, batch, model=model, tolerance=tolerance)
    exposed = recommend(workload, rig, batch, model=model, tolerance=tolerance, overlap=False)
    ddp = next(o for o in hidden.options if o.job.strategy == "ddp")
    ddp_exposed = next(o for o in exposed.options if o.job.strategy == "ddp")
    if not (ddp.fits and ddp_exposed.fits):
        raise ValueError(f"DDP does not fit {model} on {rig.name}: the question is not DDP or a pipeline "
                         f"({hidden.choice})")
    alone = Job("single", batch // rig.devices, microbatches=ddp.job.microbatches,
                activation_checkpointing=ddp.job.activation_checkpointing)
    one_gpu_s = simulate(workload, alone).step_s
    rival_s = min(o.step_s for o in exposed.options if o.fits and o.job.strategy != "ddp")
    return TwoCardAnswer(model, rig.name, batch, seq, hidden.choice, exposed.choice, ddp.step_s, one_gpu_s,
                         ddp_exposed.step_s - one_gpu_s, rival_s, (1 + tolerance) * rival_s - one_gpu_s)
