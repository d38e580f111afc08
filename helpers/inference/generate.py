"""Greedy generation across two devices, token for token what Hugging Face's `generate(do_sample=False)` gives on one.

A model saved with `save_pretrained` (`HFModel`: each stage loads only its own layers' tensors) is served by engines
that differ only in where the work runs, never in what is computed:

- `OneDevice`: Hugging Face's own `generate` on one device, the baseline.
- `LayerSplit`: one stage per device, run one after the other: what `from_pretrained(device_map=...)` does.
- `helpers.inference.pipelined.Pipelined`: the same stages, one thread per device, several requests in flight.
- `helpers.inference.tensor_parallel`: PyTorch's `parallelize_module`, one rank per device.

A request is a left-padded batch of prompts (`Request`, `left_pad`, `make_requests`). Every engine stops a request
as `generate` does: at `new_tokens`, or once every row has produced an end-of-sequence token (rows that finished
early get the pad token, and are still fed back, as `generate` feeds them).

Prefill and decode are timed apart (`Generation.prefill_s`, `decode_s`): prefill ends when every request has its
first generated token. Each engine records one timeline (`helpers.timeline` events of kinds "prefill" and "decode",
one row per device); `helpers.inference.throughput` times engines against each other (`measure`, medians of
interleaved rounds) and shows them. `same_tokens` compares two runs' tokens. `LayerSplit.memory(rig.labels)` is what
the memory panel draws while they generate: each device's weights and the KV caches it holds (counted after every
step, with their peak).
"""
from __future__ import annotations

import time
from itertools import groupby
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from helpers.dtypes import NAMES
from helpers.measure import sync_devices
from helpers.models.hf import FAMILIES, HFModel
from helpers.models.layered import Stage, call_layer
from helpers.timeline import Event, Recorder

PHASES = ("prefill", "decode")


# --- requests -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """One request: a batch of prompts, left-padded (`mask` 1 = token, 0 = padding), as `generate` takes them."""

    ids: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self):
        if self.ids.dim() != 2 or self.ids.shape != self.mask.shape or self.ids.shape[1] == 0:
            raise ValueError(f"a request is a [batch, length] tensor of token ids with a mask of the same shape, got "
                             f"ids {tuple(self.ids.shape)} and mask {tuple(self.mask.shape)}")
        if bool((self.mask.sum(-1) == 0).any()):
            raise ValueError("every prompt of a request needs at least one token (a row of the mask is all padding)")

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def prompt_tokens(self) -> int:
        """Real prompt tokens (padding not counted)."""
        return int(self.mask.sum())

    def positions(self) -> torch.Tensor:
        """Position ids as `generate` computes them for left-padded prompts."""
        return (self.mask.long().cumsum(-1) - 1).masked_fill(self.mask == 0, 1)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int = 0) -> Request:
    """Prompts of different lengths as one left-padded request (what a tokenizer with padding_side='left' gives)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("a request needs at least one prompt, and every prompt at least one token")
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, longest - len(p):] = 1
    return Request(ids, mask)


def make_requests(n_requests: int, vocab: int, per_request: int = 1, lengths: tuple[int, int] = (8, 24),
                  seed: int = 0, pad_token_id: int = 0) -> list[Request]:
    """`n_requests` requests of `per_request` random prompts each, of lengths drawn from `lengths` (inclusive),
    token ids 1..vocab-1, left-padded per request."""
    if n_requests < 1 or per_request < 1:
        raise ValueError(f"need at least one request of at least one prompt, got {n_requests} x {per_request}")
    lo, hi = lengths
    if not 1 <= lo <= hi:
        raise ValueError(f"prompt lengths must satisfy 1 <= shortest <= longest, got {lengths}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_requests):
        sizes = torch.randint(lo, hi + 1, (per_request,), generator=g).tolist()
        out.append(left_pad([torch.randint(1, vocab, (n,), generator=g).tolist() for n in sizes], pad_token_id))
    return out


def merge(requests: Sequence[Request], pad_token_id: int = 0) -> Request:
    """All prompts of several requests as one batch (re-padded to the longest): what batching them together means."""
    return left_pad([row[m.bool()].tolist() for r in requests for row, m in zip(r.ids, r.mask)], pad_token_id)


# --- results ------------------------------------------------------------------------------------------------------

class Rates:
    """Tokens per second of each phase, from the tokens it handled and the time it took."""

    prompt_tokens: int
    decode_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass(frozen=True)
class Generation(Rates):
    """What one run of an engine produced: the new tokens of every request (each [rows, steps], on the CPU), the
    wall time of each phase over the whole workload, the tokens each phase handled, and the timeline."""

    engine: str
    tokens: list[torch.Tensor]
    prefill_s: float
    decode_s: float
    prompt_tokens: int  # real prompt tokens, padding not counted
    decode_tokens: int  # tokens made by decode steps: rows x (steps - 1), summed over requests
    events: list[Event] = field(default_factory=list, repr=False)



def _counts(requests: Sequence[Request], tokens: Sequence[torch.Tensor]) -> tuple[int, int]:
    return (sum(r.prompt_tokens for r in requests),
            sum(r.rows * max(t.shape[1] - 1, 0) for r, t in zip(requests, tokens)))


def same_tokens(a: Generation | Sequence[torch.Tensor], b: Generation | Sequence[torch.Tensor]) -> bool:
    """True when two runs produced exactly the same tokens for every request. Two runs of no requests are refused,
    not "the same": a run that generated nothing must not pass a comparison."""
    ta = a.tokens if isinstance(a, Generation) else a
    tb = b.tokens if isinstance(b, Generation) else b
    if len(ta) == 0 and len(tb) == 0:
        raise ValueError("nothing to compare: neither run generated any tokens")
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x.cpu(), y.cpu()) for x, y in zip(ta, tb))


# --- the end-of-sequence rule of generate ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Stopping:
    """`generate`'s greedy rule: argmax; a row that produced an end-of-sequence token gets `pad` from then on; a request
    stops when every row has finished or after `new_tokens` tokens."""

    new_tokens: int
    eos: tuple[int, ...]
    pad: int

    def __post_init__(self):
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 1:
            raise ValueError(f"new_tokens must be a whole number of at least 1, got {self.new_tokens!r}")

    def next_token(self, logits: torch.Tensor, finished: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next token [rows, 1], finished after it) from the last position's logits [rows, vocab]."""
        token = logits.float().argmax(-1)
        if self.eos:
            token = torch.where(finished, torch.full_like(token, self.pad), token)
            finished = finished | torch.isin(token, torch.tensor(self.eos, device=token.device))
        return token[:, None], finished

    def done(self, steps: int, finished: torch.Tensor) -> bool:
        return steps >= self.new_tokens or (bool(self.eos) and bool(finished.all()))


def stopping_for(model: HFModel, new_tokens: int, eos_token_id: int | Sequence[int] | None | str = "model",
                 pad_token_id: int | None = None) -> Stopping:
    """The rule `generate` applies to this model: end-of-sequence ids from its generation_config.json (written by
    save_pretrained) or config, unless given (None: never stop early); pad: given, the model's, or the first eos."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(model.path)
    except OSError:  # no generation_config.json: what generate derives from the model's config
        gen = GenerationConfig.from_model_config(model.config)
    if eos_token_id == "model":
        eos_token_id = gen.eos_token_id
    eos = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if pad_token_id is None:
        pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else eos[0] if eos else 0
    return Stopping(new_tokens, eos, int(pad_token_id))


# --- stages: which layers each device holds -------------------------------------------------------------------------

@dataclass(frozen=True)
class StageSpec:
    """Layers [start, end) of the layer view on device `device` (an index into the engine's devices)."""

    device: int
    start: int
    end: int


def layer_index(model: HFModel, module_name: str) -> int | None:
    """The layer of `HFModel`'s view that holds a module of a device_map (None: a module without weights of its own
    there, such as the rotary embedding, which every block carries a copy of)."""
    parts = FAMILIES[model.config.model_type]
    n = model.config.num_hidden_layers
    base = parts.base + "."
    if module_name == "lm_head":
        return n + 2
    if not module_name.startswith(base):
        raise ValueError(f"the device_map names {module_name!r}, which is not a module of this "
                         f"{model.config.model_type} model")
    local = module_name[len(base):]
    if local in {parts.embed, parts.positions, parts.dropout} - {None}:
        return 0
    if local == parts.norm:
        return n + 1
    if local.startswith(parts.blocks + "."):
        return int(local.split(".")[1]) + 1
    if local == parts.rotary:
        return None
    raise ValueError(f"the device_map names {module_name!r}, which the layer view does not know")


def stages_from_device_map(model: HFModel, device_map: Mapping[str, int | str]) -> list[StageSpec]:
    """The device_map's placement as runs of consecutive layers, one StageSpec per run, in forward order. Values are
    device indices (the planner's 0, 1, ...); "cpu" / "disk" offloading is not a stage."""
    n_layers = model.n_layers
    where: dict[int, int] = {}
    for name, device in device_map.items():
        if isinstance(device, str) or isinstance(device, bool):
            raise ValueError(f"the device_map sends {name} to {device!r}: these engines place every layer on a "
                             "device (plan for more memory, or use accelerate's offloading)")
        i = layer_index(model, name)
        if i is not None:
            where[i] = int(device)
    missing = [i for i in range(n_layers) if i not in where]
    if missing:
        raise ValueError(f"the device_map places no module for layers {missing} of the model's {n_layers}")
    runs = [list(run) for _, run in groupby(range(n_layers), key=where.__getitem__)]
    return [StageSpec(where[run[0]], run[0], run[-1] + 1) for run in runs]


def stages_from_cuts(model: HFModel, cuts: Sequence[int]) -> list[StageSpec]:
    """Stage j holds layers [cuts[j-1], cuts[j]) on device j (cuts: the first layer of each stage after the first)."""
    edges = [0, *cuts, model.n_layers]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"cuts {list(cuts)} must rise strictly inside 1..{model.n_layers - 1} (the model has "
                         f"{model.n_layers} layers: embedding, {model.config.num_hidden_layers} blocks, norm, head)")
    return [StageSpec(j, a, b) for j, (a, b) in enumerate(zip(edges, edges[1:]))]


def rig_gpus(rig) -> list:
    """The rig's devices as the planner's GPUs: their capacity (a CPU virtual device's memory budget), and the runtime
    reserve on GPUs (CUDA context + allocator margin); a CPU virtual device has no CUDA context, so no reserve."""
    from helpers.sizing.gpus import Gpu, runtime_reserve_bytes

    reserve = 0 if rig.is_cpu else runtime_reserve_bytes()
    return [Gpu(label, capacity, reserve) for label, capacity in zip(rig.labels, rig.capacity_bytes)]


def weight_format_name(dtype: torch.dtype) -> str:
    if dtype not in NAMES or dtype == torch.float64:
        raise ValueError(f"no weight format for {dtype}: the engines run fp32, fp16 or bf16 weights")
    return NAMES[dtype]


def plan_for_rig(model: HFModel, rig, context: int, batch: int):
    """The planner's placement of this saved model on the rig's two devices, for `batch` sequences of `context`
    tokens (KV cache, workspace and, on GPUs, the runtime reserve counted)."""
    from helpers.inference.plan import plan

    return plan(model.path, weight_format_name(model.weights_dtype), context, batch, rig_gpus(rig), logits="last")


def _build_stages(model: HFModel, specs: Sequence[StageSpec], devices: Sequence[torch.device]) -> list[Stage]:
    """Each stage's layers loaded from the checkpoint straight to its device (only its tensors are read)."""
    bad = sorted({s.device for s in specs if not 0 <= s.device < len(devices)})
    if bad:
        raise ValueError(f"the split uses devices {bad}, but {len(devices)} devices were given")
    layers = model.meta_layers()
    stages = []
    for s in specs:
        with quiet_transformers():
            model.materialize(layers, range(s.start, s.end), devices[s.device])
        stages.append(Stage(layers[s.start:s.end]).eval())
    return stages


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Loading without transformers' progress bars (a notebook cell shows the result, not 'Loading weights')."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


# --- one stage's work on one request -------------------------------------------------------------------------------

class _StageState:
    """What a stage keeps for one request: its KV cache, the padding mask and positions on its device."""

    def __init__(self, cache, mask: torch.Tensor, positions: torch.Tensor):
        self.cache, self.mask, self.positions = cache, mask, positions

    def advance(self) -> None:
        """After a step: the next position, one more real token in the mask."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        self.positions = self.positions[:, -1:] + 1


def cache_bytes(cache) -> int:
    """Bytes of a Hugging Face KV cache's keys and values (its layers that hold none yet count nothing)."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(t):
                total += t.numel() * t.element_size()
    return total


class _StageRunner:
    """One stage on its device: runs a request's prefill or decode step with the request's own KV cache, and keeps
    count of the bytes of its KV caches (now, and the most at once since it was built)."""

    def __init__(self, model: HFModel, stage: Stage, spec: StageSpec, device: torch.device, recorder: Recorder):
        self.model, self.stage, self.spec, self.device, self.recorder = model, stage, spec, device, recorder
        self.holds_head = spec.end == model.n_layers
        self.norm_index = model.n_layers - 2  # final norm: from here on only the last position matters
        self.states: dict[int, _StageState] = {}
        self.kv_bytes: dict[int, int] = {}  # per request in flight
        self.kv_peak = 0

    def reset(self) -> None:
        self.states.clear()
        self.kv_bytes.clear()

    @property
    def kv_now(self) -> int:
        return sum(list(self.kv_bytes.values()))  # read by the memory panel's thread: copy before summing

    def step(self, r: int, x: torch.Tensor, request: Request, phase: str) -> torch.Tensor:
        """Prefill (x: the prompt's ids on stage 0, hidden states elsewhere) or one decode step of request r. The last
        stage returns the last position's logits [rows, vocab]."""
        if phase == "prefill":
            self.states[r] = _StageState(self.model.new_cache(), request.mask.to(self.device),
                                         request.positions().to(self.device))
        state = self.states[r]
        shape_ids = x if self.spec.start == 0 else torch.zeros(x.shape[:2], dtype=torch.long, device=self.device)
        with self.recorder.span(phase, r):
            ctx = self.model.context(shape_ids, state.mask, cache=state.cache, position_ids=state.positions)
            h = x
            for i, layer in enumerate(self.stage, start=self.spec.start):
                if i == self.norm_index and h.shape[1] > 1:
                    h = h[:, -1:]  # as generate: the norm and the head see only the last position
                h = call_layer(layer, h, ctx)
            state.advance()
        self.kv_bytes[r] = cache_bytes(state.cache)
        self.kv_peak = max(self.kv_peak, self.kv_now)
        return h[:, -1] if self.holds_head else h


def _runners(model: HFModel, specs: Sequence[StageSpec], devices: Sequence[torch.device]) -> list[_StageRunner]:
    stages = _build_stages(model, specs, devices)
    return [_StageRunner(model, stage, spec, devices[spec.device], Recorder(spec.device, devices[spec.device]))
            for stage, spec in zip(stages, specs)]


# --- (a) one device: Hugging Face's own generate -------------------------------------------------------------------

class _Clock:
    """A streamer that only notes when generate hands over tokens: first the prompt, then each new token (on GPUs
    generate copies each to the host first, so every mark is after the device finished that step)."""

    def __init__(self):
        self.marks: list[float] = []

    def put(self, value) -> None:
        self.marks.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(hf: nn.Module, requests: Sequence[Request], rule: Stopping, device: torch.device,
                engine: str = "one device", device_index: int = 0) -> Generation:
    """Hugging Face's own `generate(do_sample=False)` over the requests one at a time, timed by a streamer: prefill
    from the call to the first token, decode from there to the last. (The tensor-parallel ranks run this too.)"""
    tokens, events, prefill, decode = [], [], 0.0, 0.0
    for r, request in enumerate(requests):
        clock = _Clock()
        ids, mask = request.ids.to(device), request.mask.to(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=rule.new_tokens, do_sample=False,
                              eos_token_id=list(rule.eos) or None, pad_token_id=rule.pad, streamer=clock)
        marks = [t0, *clock.marks[1:]]  # the streamer's first mark is the prompt, handed over before any work
        prefill += marks[1] - marks[0]
        decode += marks[-1] - marks[1]
        events.append(Event(device_index, "prefill", marks[0], marks[1], r))
        events += [Event(device_index, "decode", a, b, r) for a, b in zip(marks[1:], marks[2:])]
        tokens.append(out[:, ids.shape[1]:].cpu())
    return Generation(engine, tokens, prefill, decode, *_counts(requests, tokens), events)


def load_hf(model: HFModel, device: torch.device | str = "cpu") -> nn.Module:
    """The whole saved model on one device, as `from_pretrained` loads it (eval mode)."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=model.weights_dtype,
                                                  attn_implementation=model.attn_implementation)
    return hf.to(device).eval()


class OneDevice:
    """Hugging Face's `generate(do_sample=False)` on one device, one request at a time: the baseline, and the
    reference every other engine's tokens are checked against."""

    name = "one device"

    def __init__(self, model: HFModel, device: torch.device | str = "cpu"):
        self.model, self.device = model, torch.device(device)
        self.hf = load_hf(model, self.device)

    def generate(self, requests: Sequence[Request], new_tokens: int, stopping: Stopping | None = None) -> Generation:
        rule = stopping or stopping_for(self.model, new_tokens)  # given, or generate's own
        return hf_generate(self.hf, requests, rule, self.device, self.name)


# --- (b) the layer split: stages one after the other ----------------------------------------------------------------

class LayerSplit:
    """The model cut into stages on the devices, each with its own KV cache, run one after the other for one request
    at a time (how `from_pretrained(device_map=...)` runs: while one device works, the other waits).

    `stages`: StageSpecs (`stages_from_device_map(model, plan.device_map)`, `stages_from_cuts(model, [k])`) or a
    device_map; `devices`: the torch devices the specs' indices name (the rig's two devices)."""

    name = "layer split"

    def __init__(self, model: HFModel, stages: Sequence[StageSpec] | Mapping[str, int],
                 devices: Sequence[torch.device]):
        self.model, self.devices = model, [torch.device(d) for d in devices]
        self.specs = stages_from_device_map(model, stages) if isinstance(stages, Mapping) else list(stages)
        self.runners = _runners(model, self.specs, self.devices)

    @property
    def first_device(self) -> torch.device:
        return self.runners[0].device

    def memory(self, labels: Sequence[str]) -> "SplitMemory":
        """What each device holds while this split (or a `Pipelined.from_split` of it) generates, for the memory
        panel: `MemoryMonitor(rig, split.memory(rig.labels))`; `labels[i]` names device i."""
        return SplitMemory(self.runners, labels)

    def _request(self, r: int, request: Request, rule: Stopping) -> tuple[torch.Tensor, float, float]:
        """(tokens [rows, steps], prefill seconds, decode seconds) of one request, the stages in turn."""
        last = self.runners[-1]
        finished = torch.zeros(request.rows, dtype=torch.bool, device=last.device)
        x, out = request.ids.to(self.first_device), []
        t0 = time.perf_counter()
        t1 = t0
        phase = "prefill"
        while True:
            h = x
            for runner in self.runners:
                h = runner.step(r, h.to(runner.device), request, phase)
            token, finished = rule.next_token(h, finished)
            out.append(token)
            if phase == "prefill":
                sync_devices()
                t1, phase = time.perf_counter(), "decode"
            if rule.done(len(out), finished):
                break
            x = token.to(self.first_device)
        sync_devices()
        t2 = time.perf_counter()
        for runner in self.runners:
            runner.reset()
        return torch.cat(out, dim=1).cpu(), t1 - t0, t2 - t1

    def generate(self, requests: Sequence[Request], new_tokens: int, stopping: Stopping | None = None) -> Generation:
        rule = stopping or stopping_for(self.model, new_tokens)  # given, or generate's own
        for runner in self.runners:
            runner.recorder.clear()
        tokens, prefill, decode = [], 0.0, 0.0
        with torch.no_grad():
            for r, request in enumerate(requests):
                t, p, d = self._request(r, request, rule)
                tokens.append(t)
                prefill += p
                decode += d
        return self._generation(requests, tokens, prefill, decode)

    def _generation(self, requests: Sequence[Request], tokens: list[torch.Tensor], prefill_s: float,
                    decode_s: float) -> Generation:
        """This engine's result: the tokens, each phase's time and token counts, every stage's timeline (two stages on
        one device share its row)."""
        events = sorted((e for r in self.runners for e in r.recorder.events()), key=lambda e: (e.device, e.start))
        return Generation(self.name, tokens, prefill_s, decode_s, *_counts(requests, tokens), events)


class SplitMemory:
    """Per device of a layer split: the weights of its stages ("params") and the KV caches of the requests in flight
    ("kv_cache"), now and at the most so far. A source for `helpers.monitor.MemoryMonitor`."""

    def __init__(self, runners: Sequence[_StageRunner], labels: Sequence[str]):
        used = sorted({r.spec.device for r in runners})
        if used[-1] >= len(labels):
            raise ValueError(f"the split uses devices {used}, but {len(labels)} labels were given: pass rig.labels")
        self.labels = [labels[i] for i in used]
        self._runners = {labels[i]: [r for r in runners if r.spec.device == i] for i in used}
        self._weights = {}
        for label, on_device in self._runners.items():
            unique = {id(p): p for r in on_device for p in r.stage.parameters()}  # a tied weight counts once
            self._weights[label] = sum(p.numel() * p.element_size() for p in unique.values())

    def parts(self, label: str) -> dict[str, int]:
        return {"params": self._weights[label], "kv_cache": sum(r.kv_now for r in self._runners[label])}

    def peak_parts(self, label: str) -> dict[str, int]:
        return {"params": self._weights[label], "kv_cache": sum(r.kv_peak for r in self._runners[label])}
