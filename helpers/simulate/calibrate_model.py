"""The model's side of the simulator's calibration: what each layer and the whole model cost on this rig, here and
now.

- `measure_workload(model, x, y, microbatch)`: the per-layer profile (`helpers.profile.profile_layers`) at the
  micro-batch size a run will use, rescaled to the whole model's measured forward and backward time per
  micro-batch (`Calibrated`: the workload, the profile it came from, and the factor between them);
  `WholeModelTimer`: the whole model timed between the measurements a calibration is for;
- `Reading`: a calibration's median as the simulator prices with it, keeping the spread and count of its samples;
- `optimizer_seconds(optimizer)`: one optimizer step, measured; `copy_seconds_per_byte`, `split_backward_overhead`.

Why the rescale (`Workload.rescaled`): at small micro-batches the whole model is slower than the sum of its layers
profiled alone (`stream_factor`); the profile still gives the shape (which layers cost what, what they save and send).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Sequence

import torch
from torch import nn

from helpers.measure import median_time, relative_spread, synchronize
from helpers.profile import Profile, profile_layers
from helpers.runtime.rig import run_together
from helpers.simulate.workload import Workload
from helpers.sizing.ledger import MemoryLedger, ledger_for


def forward_backward_seconds(loss: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float]:
    """Seconds of `loss()` (a forward and its loss) and of its backward, `device`'s queued work waited for."""
    synchronize(device)
    t0 = time.perf_counter()
    out = loss()
    synchronize(device)
    t1 = time.perf_counter()
    out.backward()
    synchronize(device)
    return t1 - t0, time.perf_counter() - t1


class Reading(float):
    """A calibration reading: the median the simulator prices with (a plain float wherever a number is wanted), that
    keeps the spread of the samples it is the median of (`helpers.measure.relative_spread`, the bench rows' spread
    column: None for one sample) and their count `n`, as `helpers.measure.Timings` keeps its samples: every row of a
    run is priced with the run's readings, and a reading that a disturbed minute moved should say so beside it."""

    spread: float | None
    n: int

    def __new__(cls, value: float, spread: float | None = None, n: int = 1):
        out = super().__new__(cls, value)
        out.spread, out.n = spread, n
        return out

    def __reduce__(self):  # pickled with its spread: rank workers return readings
        return Reading, (float(self), self.spread, self.n)

    @classmethod
    def median_of(cls, samples: Sequence[float]) -> Reading:
        """The median of `samples` with their relative spread (None where the median is not positive: a spread
        relative to it would say nothing)."""
        median = statistics.median(samples)
        return cls(median, relative_spread(list(samples)) if median > 0 else None, len(samples))

    def at_least(self, floor: float) -> Reading:
        """This reading raised to `floor` (a slowdown below 1, a host time below 0: noise), its spread kept."""
        return Reading(max(floor, float(self)), self.spread, self.n)


def spread_said(value: float | None) -> str:
    """' (spread ±3%, n=6)' after a `Reading` (' (n=1)' for a single sample); '' for a plain number, whose spread
    is not known (a figure given by hand, or read from an old record)."""
    if not isinstance(value, Reading):
        return ""
    return f" (n={value.n})" if value.spread is None else f" (spread {plus_minus(value.spread)}, n={value.n})"


def plus_minus(spread: float | None) -> str:
    """'±3%': a relative spread as the bench prints it; '-' for none."""
    return "-" if spread is None else f"±{spread:.0%}"


def spread_record(value: float | None) -> dict | None:
    """A `Reading`'s spread and count as bench.json keeps them beside its value; None for a plain number."""
    return {"spread": value.spread, "n": value.n} if isinstance(value, Reading) else None


def _medians(timed: Sequence[tuple[float, float]]) -> tuple[Reading, Reading]:
    """Median forward and median backward seconds of (forward, backward) samples, with their spreads."""
    return Reading.median_of([f for f, _ in timed]), Reading.median_of([b for _, b in timed])


@dataclass(frozen=True)
class Calibrated:
    """A model's costs at one micro-batch size on this rig: `workload` (per sample, ready for `simulate`), the
    per-layer `profile` it was shaped by, and the whole model's measured seconds per micro-batch."""

    microbatch: int
    workload: Workload
    profile: Profile
    forward_s: float  # whole model, one micro-batch, measured
    backward_s: float

    @property
    def stream_factor(self) -> float:
        """Whole-model time / sum of the per-layer profile: what streaming the weights costs at this size."""
        return (self.forward_s + self.backward_s) / sum(self.profile.costs("time"))


def whole_model_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                        repeats: int = 4) -> tuple[Reading, Reading]:
    """Median forward and backward seconds of one micro-batch (`x`, `y`) through the whole model, gradients
    accumulating as in a training step with micro-batches (each a `Reading` of the `repeats`)."""
    timed = [forward_backward_seconds(lambda: loss_fn(model(x), y), x.device) for _ in range(1 + repeats)][1:]
    model.zero_grad(set_to_none=True)
    return _medians(timed)


class WholeModelTimer:
    """The whole model's forward and backward at micro-batch sizes, timed one micro-batch at a time whenever asked:
    between the measurements a calibration is for, so that both see the same machine (a shared or virtual machine's
    speed drifts by several percent over minutes). A sample taken with a `key` also counts for that key alone: e.g.
    the samples around one bench row's launches, which calibrate that row for the minutes it ran. On the CPU rig it
    can also time two copies of the model at once, in two threads (`sample_together`): how much slower the virtual
    devices compute while both are busy in those same minutes (`slowdown`), which once per run mispriced the rows
    (docs/bench.md, `WholeModelTimer`). Each forward runs as the engines run theirs, with a memory ledger counting
    what autograd saves (`_loss`)."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable):
        self.model, self.x, self.y, self.loss_fn = model, x, y, loss_fn
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self.keyed: dict[tuple[Hashable, int], list[tuple[float, float]]] = {}
        self.together: dict[tuple[Hashable, int], list[float]] = {}  # seconds per copy, both copies at once
        self.twin: nn.Module | None = None  # the second copy, made on the first `sample_together`
        self.ledgers: dict[int, MemoryLedger] = {}  # by id() of the copy it counts for
        self.in_launch: dict[tuple[str, Hashable], list[float]] = {}  # (reading, key): its samples, `add_launch_reading`

    def _microbatch(self, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 1 <= microbatch <= self.x.shape[0]:
            raise ValueError(f"micro-batch {microbatch} must be between 1 and the {self.x.shape[0]} samples given")
        return self.x[:microbatch], self.y[:microbatch]

    def _loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The forward pass (and loss) of `model` (this timer's model or its twin) as every engine the bench times
        runs it: inside its memory ledger's `track_activations`, whose hook handles each tensor autograd saves (about
        5% of a forward: docs/bench.md, "How a prediction is calibrated")."""
        if id(model) not in self.ledgers:
            self.ledgers[id(model)] = ledger_for([model], ["model"])
        with self.ledgers[id(model)].track_activations("model"):
            return self.loss_fn(model(x), y)

    def sample(self, microbatch: int, key: Hashable | None = None, keys: Sequence[Hashable] = ()) -> None:
        """Time one micro-batch of `microbatch` samples (gradients accumulate, as in a step with micro-batches);
        with `key` (or `keys`: jobs of one launch at this size), also kept as one of that key's samples."""
        xb, yb = self._microbatch(microbatch)
        if microbatch not in self.samples:  # the first call at a size warms up, untimed
            self.samples[microbatch] = []
            self._loss(self.model, xb, yb).backward()
        timed = forward_backward_seconds(lambda: self._loss(self.model, xb, yb), self.x.device)
        self.samples[microbatch].append(timed)
        for k in ([key] if key is not None else []) + list(keys):
            self.keyed.setdefault((k, microbatch), []).append(timed)

    def sampler(self, microbatch: int, key: Hashable | None = None) -> Callable[[], None]:
        return lambda: self.sample(microbatch, key)

    def seconds(self, microbatch: int, key: Hashable | None = None) -> tuple[Reading, Reading] | None:
        """Median forward and backward seconds at `microbatch` (of `key`'s samples, where it has any; otherwise
        of all; each a `Reading`, with the samples' spread), or None before any sample."""
        got = self.keyed.get((key, microbatch)) if key is not None else None
        got = got or self.samples.get(microbatch)
        return _medians(got) if got else None

    def sample_together(self, microbatch: int, key: Hashable | None = None) -> None:
        """Time forward and backward of one micro-batch on this model and on a copy of it at once, in two threads
        released together (as two virtual devices of the CPU rig compute side by side); kept under `key`."""
        import copy

        xb, yb = self._microbatch(microbatch)
        if self.twin is None:
            self.twin = copy.deepcopy(self.model)
        work = [lambda m=m: self._loss(m, xb, yb).backward() for m in (self.model, self.twin)]
        if (key, microbatch) not in self.together:  # the first call warms both copies up, untimed
            self.together[(key, microbatch)] = []
            run_together(work)
        self.together[(key, microbatch)].extend(run_together(work))

    def add_together(self, microbatch: int, seconds: Sequence[float], keys: Sequence[Hashable]) -> None:
        """Seconds of one micro-batch's forward and backward, each timed with another copy computing at once
        somewhere else (the bench's two ranks, inside the launch that ran `keys`), kept under each of `keys`."""
        for key in keys:
            self.together.setdefault((key, microbatch), []).extend(seconds)

    def add_launch_reading(self, reading: str, samples: Sequence[float], keys: Sequence[Hashable]) -> None:
        """Samples of a calibration `reading` measured inside the launch that ran `keys` (the bench's two ranks,
        after its jobs), kept under each of `keys`: e.g. "receive_post_s", what posting a receive cost a rank while
        both ranks computed (`receive_post_seconds`), or "fsdp2_host_s", FSDP2's host work per collective
        (`fsdp2_host_samples`). Like the compute's speed, such a reading moves from minute to minute, and ranks that
        have run jobs read it otherwise than fresh ones (docs/bench.md, `receive_post_seconds` and
        `fsdp2_host_samples`)."""
        for key in keys:
            self.in_launch.setdefault((reading, key), []).extend(samples)

    def launch_reading(self, reading: str, key: Hashable) -> Reading | None:
        """The median of `key`'s samples of `reading` (`add_launch_reading`, from all its launches) with their
        spread, or None where none was measured."""
        got = self.in_launch.get((reading, key))
        return Reading.median_of(got) if got else None

    def together_sampler(self, microbatch: int, key: Hashable | None = None) -> Callable[[], None]:
        return lambda: self.sample_together(microbatch, key)

    def slowdown(self, key: Hashable | None = None) -> Reading | None:
        """How much slower one copy computed while both ran at once than alone, from the samples under `key`
        (the median of each together-time over the median alone-time at its micro-batch size; at least 1; with the
        ratios' spread), or None without both kinds of samples."""
        ratios = []
        for (k, microbatch), together in self.together.items():
            alone = self.seconds(microbatch, key) if k == key else None
            ratios += [t / sum(alone) for t in together] if alone else []
        return typical_slowdown(ratios).at_least(1.0) if ratios else None


def measure_workload(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, microbatch: int,
                     repeats: int = 3, recipe: str = "fp32 + Adam", optimizer_s: float = 0.0,
                     whole: tuple[float, float] | None = None) -> Calibrated:
    """Profile `model` layer by layer at `microbatch` samples (the first rows of `x`, `y`) and rescale the profile
    to the whole model's measured forward and backward at that size (`whole`: seconds measured already, e.g. by a
    `WholeModelTimer` between the runs being predicted; otherwise measured now)."""
    if not 1 <= microbatch <= x.shape[0]:
        raise ValueError(f"micro-batch {microbatch} must be between 1 and the {x.shape[0]} samples given")
    xb, yb = x[:microbatch], y[:microbatch]
    profile = profile_layers(model, xb, repeats=repeats, loss_fn=loss_fn, target=yb)
    model.zero_grad(set_to_none=True)
    forward_s, backward_s = whole or whole_model_seconds(model, xb, yb, loss_fn, repeats + 1)
    base = with_tensor_counts(Workload.from_profile(profile, recipe, optimizer_s), model)
    return Calibrated(microbatch, base.rescaled(forward_s / microbatch, backward_s / microbatch), profile, forward_s,
                      backward_s)


def with_tensor_counts(workload: Workload, model: nn.Module) -> Workload:
    """`workload` with each layer's count of parameter tensors taken from `model`'s layers (what is sent tensor by
    tensor, as ZeRO-1 broadcasts parameters, pays one latency per tensor)."""
    from helpers.pipeline.stages import as_layers

    layers = as_layers(model)
    if len(layers) != len(workload.layers):
        raise ValueError(f"the model has {len(layers)} layers, the workload {len(workload.layers)}")
    return replace(workload, layers=tuple(replace(cost, tensors=max(1, len(list(layer.parameters()))))
                                          for cost, layer in zip(workload.layers, layers)))


def optimizer_seconds(optimizer: torch.optim.Optimizer, repeats: int = 5, zero_grad: bool = False) -> float:
    """Median seconds of `optimizer.step()` (or of `zero_grad(set_to_none=False)`) on its current gradients;
    parameters without a gradient get zeros first, so the step does its full work."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    device = params[0].device
    fn = (lambda: optimizer.zero_grad(set_to_none=False)) if zero_grad else optimizer.step
    return median_time(fn, repeats, device)


def copy_seconds_per_byte(device: torch.device, nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Seconds per byte of `dst.copy_(src)` on `device` (`nbytes` copied): the memory copies the data-parallel
    engines make into and out of their communication buffers cost this much on the device's own compute."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return median_time(lambda: dst.copy_(src), repeats, device) / nbytes


def split_backward_overhead(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                            rounds: int = 7) -> Reading:
    """What splitting a backward costs beyond a plain one (`Workload.split_overhead`): on the second half of `model`'s
    layers, a pipeline's last stage (its input, the first half's output, needs a gradient, as every stage's but the
    first does), for one micro-batch (`x`, `y`), each round times (on a CPU in CPU seconds) a plain backward and
    then the zero-bubble engines' input pass plus weight pass, each after its own forward (the split one run layer by
    layer, as the engines run it: `helpers.pipeline.split_backward.forward_cut`); the median of the rounds' ratios,
    minus 1, never below 0 (the two halves compute exactly a plain backward's FLOPs: what is left is the host work
    of their autograd calls and each weight gradient reading its saved tensors a second time). A `Reading` whose
    spread is the ratios' (the figure the bench prints is 1 + it)."""
    from helpers.pipeline.split_backward import backward_input_cut, forward_cut
    from helpers.pipeline.stages import as_layers

    layers = as_layers(model)
    cut = max(1, len(layers) // 2)
    rest = list(layers[cut:])
    with torch.no_grad():
        h = x
        for layer in layers[:cut]:
            h = layer(h)
    pieces = [(layer, list(layer.parameters())) for layer in rest]
    last, last_weights = pieces[-1]
    pieces[-1] = (lambda t: loss_fn(last(t), y), last_weights)

    def plain() -> Callable[[], object]:
        out = h.detach().requires_grad_()
        for layer in rest:
            out = layer(out)
        return loss_fn(out, y).backward

    def split() -> Callable[[], object]:
        cuts = forward_cut(pieces, h.detach().requires_grad_())
        return lambda: backward_input_cut(cuts, torch.ones_like(cuts[-1].out))[1].run()

    # on a CPU the work itself, in the thread's CPU seconds: what other processes on the cores take is not in it
    clock = time.thread_time if x.device.type == "cpu" else time.perf_counter

    def timed(forward: Callable[[], Callable[[], object]]) -> float:
        backward = forward()
        synchronize(x.device)
        t0 = clock()
        backward()
        synchronize(x.device)
        return clock() - t0

    ratios = []
    for r in range(1 + rounds):  # the first round warms both up
        plain_s, split_s = timed(plain), timed(split)
        if r and plain_s > 0:
            ratios.append(split_s / plain_s)
    model.zero_grad(set_to_none=True)
    if not ratios:
        return Reading(0.0, None, 0)
    ratio = Reading.median_of(ratios)
    return Reading(max(0.0, ratio - 1), ratio.spread, ratio.n)


def typical_slowdown(ratios: Sequence[float]) -> Reading:
    """The busy-core slowdown from rounds of (together / alone) ratios: their median, with their spread. Each ratio
    divides two noisy times, and on a shared or virtual machine either can be disturbed; the smallest ratio picks the
    round whose "alone" was slowed and makes every two-device prediction too fast (docs/bench.md,
    `typical_slowdown`)."""
    if not ratios:
        raise ValueError("no rounds measured")
    return Reading.median_of(ratios)
