"""Which split is faster on your two cards: prefill and decode tokens per second, predicted for each engine.

The engines of `helpers.inference.generate` and `helpers.inference.tensor_parallel`, as a cost model:

- **layer split** (what `from_pretrained(device_map=...)` runs): the decoder layers in two contiguous stages, one
  device at a time; a step costs both stages plus one hop of the hidden state and the token back;
- **pipelined** (several requests in flight over the same stages): both devices busy, each request still waits for
  its own round trip, so `requests` x batch tokens per max(round trip, requests x the slower stage);
- **tensor parallel** (`parallelize_module`: q, k, v, gate, up column-wise; o, down row-wise): each device reads
  half of every layer's weights and KV cache and does half its arithmetic, then waits for two all-reduces of the
  hidden state per layer (and one all-gather of the logits when the head is sharded).

One layer's time on a device is a roofline, max(bytes read / memory bandwidth, FLOPs / sustained FLOP/s): decode
reads every weight and the whole KV cache for `batch` tokens (bandwidth-bound), prefill multiplies a whole prompt
(compute-bound). Quantised weights are read as stored when a forward has one row, and dequantised to 16 bits first
when it has more (bitsandbytes' batch-1 kernels; data/inference_speed.json). The host launches every op of a layer
(Hugging Face's eager generate): on a GPU the launches overlap the kernels, so a layer takes at least the host's
time; on the CPU rig the same thread computes, so the two add, and so does what a decoder layer computes besides
its weights' matmuls (attention, norms, SiLU: `Device.activation_s`, measured), and the pipelined engine's two
stage threads, one process, wait for the interpreter lock on every op (`Device.lock_wait_s_per_op`, measured). A
collective of n bytes costs its measured or published small-message latency + n / bandwidth
(`helpers.inference.speed_rigs.rig_allreduce`): at decode's few KiB the latency is the cost.

The devices and rigs it prices are `helpers.inference.speed_rigs` (`speed_rig("2x3090 PCIe")`, a doctor's report,
the CPU rig the speed bench measures). `predict_speed(model, dtype, rig, batch, context)` gives every engine's tokens
per second per phase; `crossovers(...)` says where tensor parallelism stops paying and why; `plot_speed_vs_batch`
draws tokens per second against batch. The command line is `python -m helpers.plan --speed`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple, Sequence

import torch

from helpers.hardware import Link
from helpers.inference.speed_rigs import Device, SpeedRig, speed_rig
from helpers.sizing.shape import Layer, ModelShape, model_shape, weight_format

INFERENCE_ENGINES = ("one device", "layer split", "pipelined", "tensor parallel")  # the order of a prediction's rows
SPLITS = INFERENCE_ENGINES[1:]  # the engines that use both devices
PHASES = ("prefill", "decode")
SHARDED_LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
COLLECTIVES_PER_LAYER = 2  # the row-parallel o and down projections' all-reduces
COLUMN_LINEARS_PER_LAYER = SHARDED_LINEARS_PER_LAYER - COLLECTIVES_PER_LAYER  # q, k, v, gate, up: no collective


# --- what the host launches ---------------------------------------------------------------------------------------

class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that reach the dispatcher and launch work (views launch nothing)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False):
            self.n += 1
        return func(*args, **(kwargs or {}))


class OpCounts(NamedTuple):
    """Ops a decode step dispatches: per decoder layer, and outside the layers (masks, rotary embedding, norm, head,
    picking the token): the host's work, whatever the arithmetic."""

    per_layer: int
    outside: int


def tiny_model(model_type: str, layers: int) -> torch.nn.Module:
    """A causal LM of the family with hidden size 64 (random weights, eval mode): its ops without the arithmetic."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@lru_cache(maxsize=16)
def op_counts(model_type: str) -> OpCounts:
    """Ops of a decode step of Hugging Face's eager forward, counted on tiny models of the same family: a two-layer
    model's step minus a one-layer model's is one layer; the rest of the one-layer step is outside the layers."""
    counts = []
    for layers in (1, 2):
        model = tiny_model(model_type, layers)
        ids = torch.ones(1, 4, dtype=torch.long)
        with torch.no_grad():
            cache = model(ids, use_cache=True).cache
            with _OpCounter() as counter:
                model(ids[:, :1], cache=cache, use_cache=True).logits.argmax(-1)
        counts.append(counter.n)
    return OpCounts(counts[1] - counts[0], 2 * counts[0] - counts[1])


# --- one layer, one phase -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Phase:
    """One forward of the model: `batch` rows of `tokens` new tokens each, attending over `context` positions."""

    name: str
    batch: int
    tokens: int
    context: int

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


def _weight_read_bytes(layer: Layer, shape: ModelShape, rows: int) -> float:
    """Bytes of weights a forward of `rows` rows reads: as stored, or for a quantised format with more than one row
    its dequantised 16-bit copy written and read again (bitsandbytes' batch-1 kernels; data/inference_speed.json)."""
    fmt = shape.format
    if not fmt.quantized or rows == 1 or layer.kind != "decoder":
        return layer.streamed_bytes
    return layer.streamed_bytes + 2 * layer.params * fmt.activation_bytes


def layer_cost(layer: Layer, shape: ModelShape, phase: Phase, share: float = 1.0) -> tuple[float, float]:
    """(bytes, FLOPs) of one unit in one forward, `share` of it on this device (tensor parallel: half).

    Decoder layer: its weights, the KV cache it reads (decode) or writes (prefill), 2 FLOPs per parameter per row,
    and attention's scores and weighted sum (4 x heads x head_dim per pair of query and key; causal prefill: half
    the pairs). The head: the last position of every row only (generate asks for no more). The embedding: a row
    lookup per token."""
    if layer.kind == "embedding":
        return phase.rows * layer.row_bytes, 0.0
    if layer.kind in ("norm", "buffers"):
        return 0.0, 0.0
    rows = phase.batch if layer.kind == "head" else phase.rows
    kv = phase.batch * layer.kv_tokens(phase.context) * layer.kv_bytes_per_token
    nbytes = _weight_read_bytes(layer, shape, rows) + kv
    flops = 2.0 * layer.params * rows
    if layer.kind == "decoder":
        pairs = phase.tokens * layer.kv_tokens(phase.context)
        if phase.tokens > 1:
            pairs = phase.tokens * (phase.tokens + 1) / 2 + phase.tokens * max(phase.context - phase.tokens, 0)
        flops += 4.0 * shape.heads * shape.head_dim * pairs * phase.batch
    return share * nbytes, share * flops


def unit_seconds(layer: Layer, shape: ModelShape, phase: Phase, device: Device, rig: SpeedRig, ops: int,
                 share: float = 1.0, busy: bool = False, extra_host_s: float = 0.0) -> float:
    """One unit's time on `device`: the roofline, with the host's dispatch of its `ops` ops overlapped (GPUs) or
    added (CPU rig)."""
    nbytes, flops = layer_cost(layer, shape, phase, share)
    rows = phase.batch if layer.kind == "head" else phase.rows
    work = device.seconds(nbytes, flops, rows, busy) if nbytes or flops else 0.0
    if layer.kind == "decoder":
        work += share * device.activation_seconds(rows, phase.name == "prefill")
    host = ops * device.host_s_per_op + extra_host_s
    return max(work, host) if rig.host_overlaps else work + host


def _unit_ops(layer: Layer, ops: OpCounts) -> int:
    """A decoder layer's ops; the embedding carries what runs outside the layers (once per stage or rank: each builds
    its own masks and rotary embedding)."""
    return ops.per_layer if layer.kind == "decoder" else ops.outside if layer.kind == "embedding" else 0


# --- the engines --------------------------------------------------------------------------------------------------

def split_layers(shape: ModelShape, rig: SpeedRig) -> list[int]:
    """Device of each unit for the layer split: the decoder layers cut so each device's share follows its memory
    bandwidth (the planner's cut on equal cards), the embedding on the first device, the final norm and the head on
    the last (a tied head too: the engines' cuts keep one stage per device)."""
    decoders = [i for i, layer in enumerate(shape.layers) if layer.kind == "decoder"]
    a, b = (d.bandwidth for d in rig.devices)
    first = max(1, min(len(decoders) - 1, round(len(decoders) * a / (a + b))))
    cut = decoders[first]
    return [0 if i < cut else 1 for i in range(len(shape.layers))]


@dataclass(frozen=True)
class EngineSpeed:
    """One engine, one phase: seconds per forward (a decode step, or a whole prefill), tokens per second, and where
    the time goes (seconds per forward: compute/memory per device, link)."""

    engine: str
    phase: str
    seconds: float
    tok_s: float
    parts: dict

    def as_dict(self) -> dict:
        return {"engine": self.engine, "phase": self.phase, "ms": self.seconds * 1e3, "tok/s": self.tok_s,
                **{f"{k} ms": v * 1e3 for k, v in self.parts.items()}}


def _stage_seconds(shape: ModelShape, phase: Phase, rig: SpeedRig, devices: list[int], busy: bool,
                   ops: OpCounts) -> list[float]:
    """Each stage's seconds; the second stage also builds its masks and rotary embedding (the ops outside layers).
    `busy`: the stages are the pipelined engine's threads working at once: the busy rates, and every op waits for
    the interpreter lock the threads share (`Device.lock_wait_s_per_op`)."""
    stages = [0.0, 0.0]
    for d in (0, 1):
        mine = [layer for layer, where in zip(shape.layers, devices) if where == d]
        device, outside = rig.devices[d], ops.outside if d else 0
        dispatched = sum(n * _unit_ops(layer, ops) for layer, n in _distinct(mine)) + outside
        stages[d] = (sum(n * unit_seconds(layer, shape, phase, device, rig, _unit_ops(layer, ops), busy=busy)
                         for layer, n in _distinct(mine))
                     + outside * device.host_s_per_op + (dispatched * device.lock_wait_s_per_op if busy else 0.0))
    return stages


def _hops(shape: ModelShape, phase: Phase, rig: SpeedRig) -> float:
    """The hidden state forward over the link, and the token ids back."""
    return rig.hop.seconds(phase.rows * shape.hidden * shape.format.activation_bytes) + rig.hop.seconds(8 * phase.batch)


def _distinct(layers: Sequence[Layer]) -> list[tuple[Layer, int]]:
    """The units with equal costs counted once (a model's decoder layers are alike): (one of them, how many)."""
    groups: dict[tuple, list] = {}
    for layer in layers:
        key = (layer.kind, layer.params, layer.streamed_bytes, layer.row_bytes, layer.kv_bytes_per_token, layer.window)
        groups.setdefault(key, [layer, 0])[1] += 1
    return [(layer, n) for layer, n in groups.values()]


def model_seconds(shape: ModelShape, phase: Phase, device: Device, rig: SpeedRig, ops: OpCounts,
                  decoders: int | None = None) -> float:
    """One forward of the whole model on `device`, or of a model of the same shapes with only its first `decoders`
    decoder layers (the CPU calibration's stage-sized model)."""
    units = [layer for layer in shape.layers if layer.kind != "decoder"] + shape.decoder_layers[:decoders]
    return sum(n * unit_seconds(layer, shape, phase, device, rig, _unit_ops(layer, ops))
               for layer, n in _distinct(units))


def one_device(shape: ModelShape, phase: Phase, rig: SpeedRig, ops: OpCounts) -> EngineSpeed:
    device = rig.devices[0]
    t = model_seconds(shape, phase, device, rig, ops)
    return EngineSpeed("one device", phase.name, t, _tokens(phase) / t, {device.name: t})


def layer_split(shape: ModelShape, phase: Phase, rig: SpeedRig, ops: OpCounts) -> EngineSpeed:
    devices = split_layers(shape, rig)
    stages = _stage_seconds(shape, phase, rig, devices, False, ops)
    hops = _hops(shape, phase, rig)
    t = sum(stages) + hops
    return EngineSpeed("layer split", phase.name, t, _tokens(phase) / t,
                       {"device 0": stages[0], "device 1": stages[1], "link": hops})


def pipelined(shape: ModelShape, phase: Phase, rig: SpeedRig, ops: OpCounts, requests: int = 2,
              steps: int = 0) -> EngineSpeed:
    """`requests` requests in flight (each of `phase.batch` rows). Decode: each cycle serves every request once and
    lasts max(one request's round trip, requests x the slower stage), both devices busy throughout: the steady
    state of a long generation. With `steps` (> 0), a decode phase of that many steps per request as the engine
    times it: it starts with the pipeline empty, so the last stage waits while the first stage computes its first
    step alone (the fill), once per phase: seconds per cycle are the steady cycle plus that step over `steps`
    (docs/bench.md, `pipelined`). Prefill: the prompts fill the pipeline and drain from it: the first stage
    takes the first prompt alone, then both stages work at once (the first on prompt k + 1, the second on prompt k:
    `requests` - 1 overlaps, each as long as the slower stage while both are busy), then the second stage takes
    the last prompt alone. Only the overlaps pay for sharing the memory (the CPU rig's busy rates)."""
    devices = split_layers(shape, rig)
    stages = _stage_seconds(shape, phase, rig, devices, requests > 1, ops)
    alone = _stage_seconds(shape, phase, rig, devices, False, ops)
    hops = _hops(shape, phase, rig)
    if phase.name == "decode":
        t = max(sum(stages) + hops, requests * max(stages)) + (alone[0] / steps if steps > 0 else 0.0)
    else:
        t = alone[0] + (requests - 1) * max(stages) + alone[1] + hops
    return EngineSpeed("pipelined", phase.name, t, requests * _tokens(phase) / t,
                       {"device 0": stages[0], "device 1": stages[1], "link": hops})


def tensor_parallel(shape: ModelShape, phase: Phase, rig: SpeedRig, ops: OpCounts) -> EngineSpeed:
    """Each device runs half of every decoder layer (and of an untied head) at once; the step waits for the slower
    device, then for the collectives: two all-reduces of the hidden state per layer (each also waiting for the ranks'
    drift over the work since the last, `SpeedRig.allreduce_wait`), an all-gather of the logits."""
    halves = [0.0, 0.0]
    decoders = [0.0, 0.0]
    for d, device in enumerate(rig.devices):
        for layer, n in _distinct(shape.layers):
            sharded = layer.kind == "decoder" or (layer.kind == "head" and not shape.tied)
            extra = (rig.sharded_linear_seconds(phase.rows) * COLUMN_LINEARS_PER_LAYER if layer.kind == "decoder"
                     else 0.0)
            launched = _unit_ops(layer, ops) + (COLLECTIVES_PER_LAYER if layer.kind == "decoder" else 0)
            seconds = n * unit_seconds(layer, shape, phase, device, rig, launched, 0.5 if sharded else 1.0, busy=True,
                                       extra_host_s=extra)
            halves[d] += seconds
            decoders[d] += seconds if layer.kind == "decoder" else 0.0
    hidden_bytes = phase.rows * shape.hidden * shape.format.activation_bytes
    collectives = len(shape.decoder_layers) * COLLECTIVES_PER_LAYER
    link = collectives * (rig.allreduce.seconds(hidden_bytes) + rig.allreduce_wait(max(decoders) / collectives))
    if not shape.tied:  # ColwiseParallel head with replicated output: gather the other half of the vocabulary
        link += rig.allreduce.seconds(phase.batch * shape.vocab * shape.format.activation_bytes / 2)
    t = max(halves) + link
    return EngineSpeed("tensor parallel", phase.name, t, _tokens(phase) / t,
                       {"device 0": halves[0], "device 1": halves[1], "link": link})


def _tokens(phase: Phase) -> int:
    return phase.rows if phase.name == "prefill" else phase.batch


# --- the prediction -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpeedPrediction:
    """Every engine's prefill and decode speed for one model, weight format, batch and context on one rig."""

    model: str
    dtype: str
    rig: SpeedRig
    batch: int
    context: int
    prompt: int
    requests: int
    rows: tuple[EngineSpeed, ...]

    def tok_s(self, engine: str, phase: str) -> float:
        return next(r.tok_s for r in self.rows if r.engine == engine and r.phase == phase)

    def best(self, phase: str, engines: Sequence[str] = SPLITS) -> str:
        return max(engines, key=lambda e: self.tok_s(e, phase))

    def as_dicts(self) -> list[dict]:
        return [{"rig": self.rig.name, "model": self.model, "dtype": self.dtype, "batch": self.batch,
                 "context": self.context, **r.as_dict()} for r in self.rows]

    def describe(self) -> str:
        from helpers.report import table

        rows = [{"engine": r.engine, "phase": r.phase, "tok/s": r.tok_s, "ms per forward": r.seconds * 1e3,
                 "dev0 ms": r.parts.get("device 0", r.seconds) * 1e3, "dev1 ms": r.parts.get("device 1", 0.0) * 1e3,
                 "link ms": r.parts.get("link", 0.0) * 1e3} for r in self.rows]
        head = (f"{self.model} in {self.dtype} on {self.rig.name}: batch {self.batch}, prefill of a {self.prompt}-"
                f"token prompt, decode at {self.context} tokens of context; pipelined: {self.requests} requests in "
                "flight (its tok/s is their total); one device: speed only, whether it fits is the planner's question")
        best = (f"fastest: prefill {self.best('prefill')}, decode {self.best('decode')}"
                f"; all-reduce {self.rig.allreduce.latency_s * 1e6:.1f} us + bytes / "
                f"{self.rig.allreduce.bandwidth / 1e9:.3g} GB/s")
        return "\n".join([head, table(rows), best])


def predict_speed(model="llama-2-7b", dtype: str = "bf16", rig: str | SpeedRig = "2x3090 PCIe", batch: int = 1,
                  context: int = 1024, prompt: int | None = None, requests: int = 2,
                  shape: ModelShape | None = None) -> SpeedPrediction:
    """Prefill and decode tokens per second of one device, the layer split, the pipelined split (`requests` in
    flight, each of `batch` rows) and tensor parallelism, for `model` (bundled name, HF id, config directory) in
    weight format `dtype` on `rig`: prefill of `prompt` tokens per row (default: `context`), decode steps attending
    over `context` tokens. Memory is the planner's business (`helpers.inference.plan`): this predicts speed only."""
    for what, value in (("batch", batch), ("context", context), ("requests", requests)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a whole number of at least 1, got {value!r}")
    prompt = context if prompt is None else prompt
    if not 1 <= prompt <= context:
        raise ValueError(f"the prompt ({prompt} tokens) must be 1..context ({context})")
    shape = shape or model_shape(model, weight_format(dtype))
    rig = speed_rig(rig)
    ops = op_counts(shape.config.model_type)
    rows = []
    for phase in (Phase("prefill", batch, prompt, prompt), Phase("decode", batch, 1, context)):
        rows += [one_device(shape, phase, rig, ops), layer_split(shape, phase, rig, ops),
                 pipelined(shape, phase, rig, ops, requests), tensor_parallel(shape, phase, rig, ops)]
    return SpeedPrediction(shape.name, shape.format.name, rig, batch, context, prompt, requests, tuple(rows))


def speed_vs_batch(model, dtype: str, rig: str | SpeedRig, batches: Sequence[int], context: int,
                   prompt: int | None = None, requests: int = 2) -> list[dict]:
    """tokens/s of every engine and phase at each batch: rows of (batch, engine, phase, tok/s)."""
    shape = model_shape(model, weight_format(dtype)) if not isinstance(model, ModelShape) else model
    out = []
    for b in batches:
        p = predict_speed(shape.name, shape.format.name, rig, b, context, prompt, requests, shape=shape)
        out += [{"batch": b, "engine": r.engine, "phase": r.phase, "tok/s": r.tok_s} for r in p.rows]
    return out


def plot_speed_vs_batch(panels: dict[str, list[dict]], engines: Sequence[str] = SPLITS):
    """One row of plots per panel (a rig), prefill and decode side by side: tokens/s against batch per engine,
    from `speed_vs_batch` rows (plus measured rows with "measured": True, drawn as points)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 2, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for (title, rows), row_axes in zip(panels.items(), axes):
        for ax, phase in zip(row_axes, PHASES):
            for k, engine in enumerate(engines):
                color = f"C{k}"
                for measured, style in ((False, "-"), (True, "o")):
                    pts = sorted((r["batch"], r["tok/s"]) for r in rows if r["engine"] == engine
                                 and r["phase"] == phase and bool(r.get("measured")) == measured)
                    if pts:
                        ax.plot(*zip(*pts), style, color=color,
                                label=f"{engine} ({'measured' if measured else 'predicted'})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch (sequences)")
            ax.set_ylabel("tokens/s")
            ax.set_title(f"{title}: {phase}")
            ax.grid(True, which="both", alpha=0.3)
        row_axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


# --- where tensor parallelism stops paying ------------------------------------------------------------------------

BATCHES = tuple(2**k for k in range(0, 9))
CONTEXTS = tuple(2**k for k in range(7, 16))
RIVALS = ("tensor parallel", "layer split")  # a tie goes to the first


@dataclass(frozen=True)
class Crossover:
    """Tensor parallelism against the layer split (same batch: what one user's `device_map` run gets) along one axis
    (batch at a fixed context, or context at batch 1) for one phase: which wins at the start of the range, the first
    value where the other wins (None: no change within the range), and why, from the predicted parts."""

    phase: str
    rig: str
    axis: str
    start_winner: str
    flips_at: int | None
    reason: str

    def as_dict(self) -> dict:
        return {"rig": self.rig, "phase": self.phase, "axis": self.axis, "winner at the start": self.start_winner,
                "flips at": self.flips_at if self.flips_at is not None else "-", "why": self.reason}


def _why(p: SpeedPrediction, phase: str) -> str:
    """The numbers behind a verdict: each engine's tok/s, the share of tensor parallelism's time in collectives,
    and whether its half-layers are bound by the host's launches rather than by the device."""
    tp = next(r for r in p.rows if r.engine == "tensor parallel" and r.phase == phase)
    split = next(r for r in p.rows if r.engine == "layer split" and r.phase == phase)
    return (f"at batch {p.batch}, context {p.context}: TP {tp.tok_s:.4g} tok/s ({tp.parts['link'] / tp.seconds:.0%} "
            f"of it in all-reduces), layer split {split.tok_s:.4g} tok/s")


def crossovers(model, dtype: str, rig: str | SpeedRig, context: int = 1024, batches: Sequence[int] = BATCHES,
               contexts: Sequence[int] = CONTEXTS) -> list[Crossover]:
    """Per phase, along batch (at `context`) and along context (at batch 1): where the faster of tensor parallelism
    and the layer split changes, with the numbers that explain it."""
    shape = model_shape(model, weight_format(dtype))
    rig = speed_rig(rig)
    out = []
    for axis, values in (("batch", batches), ("context", contexts)):
        preds = [predict_speed(shape.name, shape.format.name, rig, v if axis == "batch" else 1,
                               context if axis == "batch" else v, shape=shape) for v in values]
        for phase in PHASES:
            first = preds[0].best(phase, RIVALS)
            flip = next((p for p in preds if p.best(phase, RIVALS) != first), None)
            reason = _why(preds[0], phase) + (f"; {_why(flip, phase)}" if flip else "")
            out.append(Crossover(phase, rig.name, axis, first,
                                 None if flip is None else (flip.batch if axis == "batch" else flip.context), reason))
    return out


def crossover_table(model, dtype: str, rigs: Sequence[str], context: int = 1024) -> list[dict]:
    """`crossovers` over several rigs (the link axis): one row per rig, phase and axis."""
    return [{"model": model, "dtype": dtype, **c.as_dict()} for rig in rigs for c in crossovers(model, dtype, rig,
                                                                                               context)]


def breakeven_latency(model, dtype: str, rig: str | SpeedRig = "2x3090 PCIe", batch: int = 1, context: int = 1024,
                      phase: str = "decode") -> float | None:
    """The link axis: the all-reduce latency (seconds, everything else on `rig` kept) above which the layer split
    overtakes tensor parallelism in `phase`; None when tensor parallelism loses even over a link with no latency
    (the host or the device, not the link, decides), inf when it wins whatever the latency (up to 1 s)."""
    shape = model_shape(model, weight_format(dtype))
    base = speed_rig(rig)

    def tp_wins(latency: float) -> bool:
        on = replace(base, allreduce=Link(latency, base.allreduce.bandwidth, base.allreduce.name))
        p = predict_speed(shape.name, shape.format.name, on, batch, context, shape=shape)
        return p.best(phase, RIVALS) == "tensor parallel"

    lo, hi = 0.0, 1.0
    if not tp_wins(lo):
        return None
    if tp_wins(hi):
        return math.inf
    for _ in range(40):  # bisection to well under a microsecond
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tp_wins(mid) else (lo, mid)
    return lo

