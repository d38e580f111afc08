"""The speed model's figures of the CPU rig, measured for one model with micro-benchmarks, never with the engines
themselves: what `helpers.inference.speed_bench` prices its measured engines with.

- `DeviceCalibration` (in rounds): one virtual device's weight streaming, matmul rates, host time per op, the
  interpreter lock's wait and a decoder layer's work beyond its matmuls (`StageForwards`);
- `tensor_parallel_sample`: in two ranks, the all-reduce at hidden-state sizes issued back to back as tensor
  parallelism issues them (`lockstep_allreduce_link`) and DTensor's host time per sharded linear;
- `calibrate_cpu_rig(model, rig, rows)`: both, as the `SpeedRig` the speed model prices.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import replace
from typing import Sequence

import torch
import torch.nn.functional as F

from helpers.hardware import FREE_LINK, Link
from helpers.inference.speed import COLLECTIVES_PER_LAYER, Phase, model_seconds, op_counts, tiny_model
from helpers.inference.speed_rigs import Device, SpeedRig
from helpers.models.hf import HFModel
from helpers.runtime.rig import run_together, run_together_with_cpu
from helpers.sizing.shape import ModelShape, model_shape

LOCKSTEP_PAIRS = 25  # steps with and without all-reduces at the shortest work (fewer leave the latency noisy)
STRETCHES = (4, 16)  # the longer work between two all-reduces the calibration measures: 4 and 16 pieces
STAGE_BATCHES = (1, 4, 16)  # decode batches of the stage-sized model (the lock's wait, the layers' activation work)
DECODE_STEPS = 4  # per timing of a stage-sized model's decode (StageForwards)
CONTEXT = 8  # the stage-sized model's prompt: its decode steps attend over 9 positions


def _extra_seconds(fn, base, repeats: int, warmup: int = 1) -> float:
    """Median over `repeats` interleaved pairs of `fn`'s time less `base`'s: a slow moment of the machine hurts both
    of a pair alike (docs/bench.md, `_extra_seconds`)."""
    def seconds(f) -> float:
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    for _ in range(warmup):
        fn()
        base()
    return statistics.median(seconds(fn) - seconds(base) for _ in range(repeats))


def _weights(shape: ModelShape, dtype: torch.dtype) -> list[torch.Tensor]:
    """MLP-shaped matrices adding up to the model's decoder weights: the working set a decode step streams. What a
    layer computes besides its matmuls is measured apart (`Device.activation_s`, from `StageForwards`)."""
    one = torch.randn(shape.intermediate, shape.hidden, dtype=dtype)
    total = sum(layer.weight_bytes for layer in shape.decoder_layers)
    return [one] + [torch.randn_like(one) for _ in range(max(0, total // (one.numel() * one.element_size()) - 1))]


def _sweep(mats: Sequence[torch.Tensor], rows: int, dtype: torch.dtype):
    """A function multiplying `rows` rows through every matrix of `mats`, as a forward does (inputs made once)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in mats}
    return lambda: [F.linear(inputs[w.shape[1]], w) for w in mats]


class DeviceCalibration:
    """The CPU virtual device's micro-benchmarks for one model, sampled in rounds: `sample()` times each once,
    `device()` is the medians of the rounds so far. The speed bench takes a round before each of the engines'
    measurements, so that the calibration and the engines share the same minutes of the machine (docs/bench.md,
    `DeviceCalibration`). Per round:

    - weight streaming: one row through every matrix of the working set, as decoding one token reads every weight
      once, alone and while the other virtual device streams too;
    - matmul rates: `rows` rows multiplied through every matrix of the working set, as a forward does (the weights
      come from memory, not from the cache: one matrix timed alone stays in the cache, and at a few rows multiplies
      faster than the same rows swept through the working set; a CPU overlaps streaming and multiplying only in
      part, so the roofline's max(bytes / bandwidth, FLOPs / rate) holds only with a rate measured while
      streaming), alone and both devices at once (slower by how much each row count streams, so per row count);
    - the host's time per op (`host_seconds_per_op`); with a stage-sized model decoding (`StageForwards`), the
      interpreter lock's wait per op with both devices' threads at once, and a decoder layer's work beyond its
      weights' roofline and its dispatch (`activation_s`: attention, norms, SiLU and the like, one after another),
      at each decode batch and, where `prefills` names them, at each prefill's (batch, prompt) rows.

    Each row count alone then together, all in the same round: a slow moment of the machine hurts alone and together
    alike and spreads over all row counts."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, rows: Sequence[int],
                 prefills: Sequence[tuple[int, int]] = ()):
        self.shape, self.dtype = shape, dtype
        mats = [_weights(shape, dtype), _weights(shape, dtype)]
        self.nbytes = sum(w.numel() * w.element_size() for w in mats[0])
        self.per_row = 2.0 * sum(w.numel() for w in mats[0])
        self.works = {r: [_sweep(m, r, dtype) for m in mats] for r in sorted({1, *rows})}
        self.forwards = StageForwards(shape.config, dtype, prefills=prefills)
        for work in self.works.values():  # warm-up: the matrices' pages touched, the threads' pools started
            work[0]()
            max(run_together(work))
        self.alone: dict = {r: [] for r in self.works}
        self.together: dict = {r: [] for r in self.works}
        self.host: list[float] = []
        self.waits: list[float] = []
        self.steps: dict = {b: [] for b in self.forwards.batches}
        self.prefills: dict = {case: [] for case in self.forwards.prefills}

    def sample(self) -> None:
        """One round: every row count alone then on both devices at once, the host's time per op, the stage-sized
        model's decode and prefills (`StageForwards.sample`)."""
        for r, work in self.works.items():
            t0 = time.perf_counter()
            work[0]()
            self.alone[r].append(time.perf_counter() - t0)
            self.together[r].append(max(run_together(work)))  # until the last finished
        self.host.append(host_seconds_per_op(self.shape.config.model_type))
        wait, steps, prefills = self.forwards.sample()
        self.waits.append(wait)
        for batch, seconds in steps.items():
            self.steps[batch].append(seconds)
        for case, seconds in prefills.items():
            self.prefills[case].append(seconds)

    @property
    def rounds(self) -> int:
        """How many rounds were sampled."""
        return len(self.host)

    def device(self, rounds: Sequence[int] | None = None) -> Device:
        """The device as the medians of the rounds sampled so far (at least one) price it, or of the rounds numbered
        `rounds` only (the speed bench prices each of its cases with the rounds just before and after it). One row:
        the streaming sweep's rate, not a second reading of it."""
        if not self.host:
            raise ValueError("no round sampled: call sample() first")
        chosen = range(self.rounds) if rounds is None else list(rounds)
        if not chosen or not all(0 <= i < self.rounds for i in chosen):
            raise ValueError(f"rounds {list(chosen)} not among the {self.rounds} sampled")

        def median(samples: Sequence[float]) -> float:
            return statistics.median(samples[i] for i in chosen)

        alone = {r: median(t) for r, t in self.alone.items()}
        together = {r: median(t) for r, t in self.together.items()}
        bandwidth, slowdown = self.nbytes / alone[1], max(1.0, together[1] / alone[1])
        streaming = 2 * bandwidth / self.dtype.itemsize
        counts = [r for r in alone if r > 1]
        device = Device("CPU virtual device", bandwidth,
                        ((1, streaming),) + tuple((r, self.per_row * r / alone[r]) for r in counts),
                        median(self.host), slowdown,
                        ((1, streaming / slowdown),) + tuple((r, self.per_row * r / together[r]) for r in counts),
                        max(median(self.waits), 0.0))
        decodes = [(b, self._activation_seconds(device, Phase("decode", b, 1, CONTEXT + 1), median(self.steps[b])))
                   for b in self.steps]
        prefills = [(b * p, self._activation_seconds(device, Phase("prefill", b, p, p), median(self.prefills[(b, p)])))
                    for b, p in self.prefills]
        return replace(device, activation_s=tuple(decodes), prefill_activation_s=_mean_by_rows(prefills))

    def _activation_seconds(self, device: Device, phase: Phase, seconds: float) -> float:
        """A decoder layer's work at `phase`'s rows beyond its weights' roofline and its ops' dispatch: the
        stage-sized model's forward (`seconds`, the rounds' median) less what `device` prices for it without that
        work, per decoder layer: it grows with the batch and with the rows a prefill multiplies, so it is measured at
        each. Measured as a difference, it also takes up what the rounds' matmul rates miss of the model's own
        matmuls (docs/bench.md, `_activation_seconds`)."""
        rig = SpeedRig("calibrating", (device, device), FREE_LINK, FREE_LINK, host_overlaps=False)
        priced = model_seconds(self.shape, phase, device, rig, op_counts(self.shape.config.model_type),
                               self.forwards.layers)
        return max((seconds - priced) / self.forwards.layers, 0.0)


def _mean_by_rows(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """(rows, seconds) points with one per row count: where several prefills multiply as many rows (batch 4 x 64
    tokens and 16 x 16), their mean."""
    by_rows: dict[int, list[float]] = {}
    for rows, seconds in points:
        by_rows.setdefault(rows, []).append(seconds)
    return tuple((rows, statistics.mean(values)) for rows, values in sorted(by_rows.items()))


def decode_steps(model: torch.nn.Module, batch: int, context: int, steps: int):
    """A function running `steps` decode steps of `model` (a Hugging Face causal LM) for `batch` rows after a prompt
    of `context` tokens, the cache cropped back after each so that every call decodes at the same position."""
    ids = torch.ones(batch, context, dtype=torch.long)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache

    def run() -> None:
        with torch.no_grad():  # grad mode belongs to the thread
            for _ in range(steps):
                model(ids[:, :1], cache=cache, use_cache=True)
                cache.crop(-1)
    return run


def host_seconds_per_op(model_type: str, repeats: int = 20) -> float:
    """Host time of one dispatched op: a decode step of a tiny model of the family (hidden 64, where the arithmetic
    is nothing) with 4 layers against 1, per layer, divided by the ops a layer dispatches."""
    def step(layers: int):
        return decode_steps(tiny_model(model_type, layers), 1, 8, 1)

    return max(_extra_seconds(step(4), step(1), repeats), 0.0) / 3 / op_counts(model_type).per_layer


class StageForwards:
    """Forwards of a stage-sized model of the workload's family and layer shapes (`config`, a Hugging Face config;
    random weights, half its decoder layers): decode steps after a prompt of `CONTEXT` tokens, one per virtual
    device, at each of `batches`, and one device's prefill of each (batch, prompt) of `prefills`, as the engines
    prefill (the head for each sequence's last position only): what `sample` times."""

    def __init__(self, config, dtype: torch.dtype, batches: Sequence[int] = STAGE_BATCHES,
                 prefills: Sequence[tuple[int, int]] = ()):
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(config)
        config.num_hidden_layers = max(1, config.num_hidden_layers // 2)
        counts = op_counts(config.model_type)
        self.dispatched = DECODE_STEPS * (config.num_hidden_layers * counts.per_layer + counts.outside)
        torch.manual_seed(0)
        stages = [AutoModelForCausalLM.from_config(config).to(dtype).eval() for _ in range(2)]
        self.layers, self.batches, self.prefills = config.num_hidden_layers, tuple(batches), tuple(prefills)
        self.works = [[decode_steps(stage, b, CONTEXT, DECODE_STEPS) for stage in stages] for b in batches]
        self.prefill_works = [self._prefilling(stages[0], b, p) for b, p in self.prefills]
        self.sample()  # warm-up

    @staticmethod
    def _prefilling(stage: torch.nn.Module, batch: int, prompt: int):
        ids = torch.ones(batch, prompt, dtype=torch.long)

        def prefill() -> None:
            with torch.no_grad():
                stage(ids, use_cache=True, logits_to_keep=1)
        return prefill

    def sample(self) -> tuple[float, dict[int, float], dict[tuple[int, int], float]]:
        """(what each op waits for the interpreter lock, {batch: seconds of one decode step alone}, {(batch,
        prompt): seconds of one prefill alone}). The wait: while the other device's thread decodes in the same
        process, as the pipelined engine's two stage threads do, every op takes the lock to dispatch and gives it
        back while it computes, and a thread whose op ended waits while the other holds it; measured as the wall
        time the thread's CPU time does not account for, both devices at once less alone, per op (layers x ops per
        layer, and the ops outside the layers), the median over the batches. The other thread decodes the same
        model because the wait comes with its many small ops: a streaming sweep beside it waits almost nothing
        (docs/bench.md, `StageForwards.sample`). A difference of two timings: where no op waited, noise can take
        it just below zero, read as 0."""
        waits, steps = [], {}
        for batch, work in zip(self.batches, self.works):
            (both, both_cpu), (alone, alone_cpu) = run_together_with_cpu(work)[0], run_together_with_cpu(work[:1])[0]
            waits.append(((both - both_cpu) - (alone - alone_cpu)) / self.dispatched)
            steps[batch] = alone / DECODE_STEPS
        prefills = {case: run_together_with_cpu([work])[0][0] for case, work in zip(self.prefills,
                                                                                   self.prefill_works)}
        return max(0.0, statistics.median(waits)), steps, prefills


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A collective's result, arrived: DTensor hands back an AsyncCollectiveTensor whose sum is still on its way."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def lockstep_allreduce_link(sizes: Sequence[int], mesh, device: torch.device, dtype: torch.dtype, work: Sequence,
                            hidden: int, stretches: Sequence[int] = STRETCHES) -> dict:
    """Rank worker: the all-reduce tensor parallelism pays inside a decode step: {"latency_s", "bandwidth"} (seconds
    = latency + bytes / bandwidth) and "waits", (seconds of work since the last all-reduce, seconds the next waits
    beyond that) points, as the ranks drift apart while they work (`SpeedRig.allreduce_waits`). After each of `work`
    (a rank's half of half a layer, weights from memory) one row-parallel linear (`RowwiseParallel`, as the engine's
    o and down projections), the step timed less the same step on plain tensors, per all-reduce (median of
    `LOCKSTEP_PAIRS` pairs; every k pieces, of `LOCKSTEP_PAIRS` / k, at least 3). The smallest of `sizes` after one
    piece (latency) and after k pieces for each k of `stretches` (waits, as in prefill); the largest after one piece
    (bandwidth). Timed between work and through RowwiseParallel, not after a barrier with `dist.all_reduce`: the wait
    depends on the work before it, and DTensor's redistribution costs the host as much as the wait (docs/bench.md)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    row = parallelize_module(nn.Linear(8 * mesh.size(), hidden, bias=False, dtype=dtype, device=device), mesh,
                             RowwiseParallel())
    local = row.weight.to_local()

    def step(issue, every: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i, fn in enumerate(list(work) * every):
            fn()
            if i % every == every - 1:
                issue()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    def per_allreduce(nbytes: int, every: int) -> tuple[float, float]:
        """(seconds of work between two all-reduces, seconds one all-reduce adds), medians."""
        x = torch.zeros(max(1, nbytes // (hidden * dtype.itemsize)), 1, local.shape[1], dtype=dtype, device=device)
        summed, plain = (lambda: _waited(row(x))), (lambda: F.linear(x, local))
        step(summed, every)
        step(plain, every)
        pairs = [(step(plain, every), step(summed, every)) for _ in range(max(3, LOCKSTEP_PAIRS // every))]
        return (statistics.median(p for p, _ in pairs) / len(work),
                max(statistics.median((s - p) / len(work) for p, s in pairs), 1e-6))

    short, small = per_allreduce(sizes[0], 1)
    waits = [(short, 0.0)]
    for k in stretches:
        longer, after = per_allreduce(sizes[0], k)
        waits.append((longer, max(after - small, waits[-1][1])))  # the wait never shrinks with more work
    _, large = per_allreduce(sizes[-1], 1)
    extra = large - small
    bandwidth = (sizes[-1] - sizes[0]) / extra if extra > 0 and sizes[-1] > sizes[0] else float("inf")
    return {"latency_s": small, "bandwidth": bandwidth, "waits": tuple(waits)}


def decode_step_work(shape: ModelShape, dtype: torch.dtype, device: torch.device, ranks: int) -> list:
    """What one rank of tensor parallelism computes between two all-reduces of a decode step, once per all-reduce
    of the step: one row through its share of half a decoder layer (weights out of the cache: every stretch its
    own matrix)."""
    layers = shape.decoder_layers
    per_work = layers[0].weight_bytes / ranks / COLLECTIVES_PER_LAYER
    rows = max(1, round(per_work / (shape.hidden * dtype.itemsize)))
    x = torch.zeros(1, shape.hidden, dtype=dtype, device=device)
    mats = [torch.randn(rows, shape.hidden, dtype=dtype, device=device)
            for _ in range(len(layers) * COLLECTIVES_PER_LAYER)]
    return [lambda w=w: F.linear(x, w) for w in mats]


def tensor_parallel_calibration(sizes: list[int], shape: ModelShape, dtype: torch.dtype, repeats: int,
                                rows: Sequence[int] = (1,)) -> dict:
    """Rank worker: the all-reduce at hidden-state sizes inside a decode step's work, and DTensor's host time per
    column-parallel linear at each of `rows` (the same matmul through parallelize_module against on plain tensors;
    it grows with the rows), both ranks at once. Fewer pairs at more rows, where each matmul takes longer."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from helpers.runtime.launch import rank_device

    device = rank_device()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    linear = parallelize_module(nn.Linear(shape.hidden, shape.intermediate, bias=False, dtype=dtype, device=device),
                                mesh, ColwiseParallel())
    local = linear.weight.to_local()

    def sharded(r: int) -> float:
        x = torch.zeros(r, 1, shape.hidden, dtype=dtype, device=device)
        pairs = max(7, 20 * repeats * 16 // max(r, 16))
        return max(_extra_seconds(lambda: linear(x), lambda: F.linear(x, local), pairs, warmup=5), 0.0)

    with torch.no_grad():
        work = decode_step_work(shape, dtype, device, dist.get_world_size())
        allreduce = lockstep_allreduce_link(sorted(sizes), mesh, device, dtype, work, shape.hidden)
        linears = tuple((r, sharded(r)) for r in sorted(set(rows)))
    dist.barrier()
    return {**allreduce, "sharded_linear_s": linears}


def model_shape_of(model: HFModel) -> ModelShape:
    """The saved model's shape in the weight format it holds (what the calibration and the predictions price)."""
    from helpers.inference.generate import weight_format_name

    return model_shape(model.path, weight_format_name(model.weights_dtype))


def _refuse_gpu_rigs(rig) -> None:
    """Before any rank starts: the calibration times CPU virtual devices only."""
    if not rig.is_cpu:
        raise ValueError("the speed bench's calibration times CPU virtual devices; on GPUs predict from the doctor's "
                         "measured links: python -m helpers.doctor --json doctor.json, then speed_rig('doctor.json')")


def tensor_parallel_sample(model: HFModel, rig, rows: Sequence[int], repeats: int) -> dict:
    """One launch of two ranks timing what tensor parallelism pays (`tensor_parallel_calibration`), rank 0's
    reading, at the hidden-state sizes of `rows` and DTensor's time on a linear of each of them."""
    from helpers.runtime.launch import run

    _refuse_gpu_rigs(rig)
    dtype, shape = model.weights_dtype, model_shape_of(model)
    sizes = sorted({r * shape.hidden * dtype.itemsize for r in rows})
    if len(sizes) < 2:
        sizes.append(2 * sizes[0])
    return run(tensor_parallel_calibration, sizes, shape, dtype, repeats, sorted(set(rows)), rig=rig)[0]


def median_sample(samples: Sequence[dict]) -> dict:
    """Field by field medians of `tensor_parallel_sample`s, the waits and DTensor's times point by point (each
    sample's waits never shrink with more work, and neither do their medians): one launch's waits move too much
    from one run to the next to price with (docs/bench.md, `median_sample`)."""
    def median(key: str) -> float:
        return statistics.median(s[key] for s in samples)

    def pointwise(key: str) -> tuple:
        points = [s[key] for s in samples]
        return tuple((statistics.median(p[i][0] for p in points), statistics.median(p[i][1] for p in points))
                     for i in range(len(points[0])))

    return {"latency_s": median("latency_s"), "bandwidth": median("bandwidth"),
            "sharded_linear_s": pointwise("sharded_linear_s"), "waits": pointwise("waits")}


def calibrate_cpu_rig(model: HFModel, rig, rows: Sequence[int], repeats: int = 5,
                      device: Device | None = None, tensor_parallel: Sequence[dict] = (),
                      prefills: Sequence[tuple[int, int]] = ()) -> SpeedRig:
    """The CPU rig as `helpers.inference.speed` sees it, measured for `model` (`DeviceCalibration`,
    `tensor_parallel_sample`). `rows`: the row counts the workload multiplies at once (batch x prompt tokens for
    prefill, batch for decode); `prefills`: its prefills' (batch, prompt), where a layer's work beyond its matmuls
    is measured too (without them, prefill is priced with decode's). `device` and `tensor_parallel`: a virtual
    device already calibrated (`DeviceCalibration`) and `tensor_parallel_sample`s, taken while the engines were
    measured; else `repeats` rounds and one launch now."""
    _refuse_gpu_rigs(rig)
    if device is None:
        calibration = DeviceCalibration(model_shape_of(model), model.weights_dtype, rows, prefills)
        for _ in range(repeats):
            calibration.sample()
        device = calibration.device()
    bandwidth, slowdown = device.bandwidth, device.busy_slowdown
    tp = median_sample(tensor_parallel or [tensor_parallel_sample(model, rig, rows, repeats)])
    return SpeedRig("this CPU rig (measured)", (device, device), FREE_LINK,
                    Link(tp["latency_s"], tp["bandwidth"], "gloo all-reduce of a row-parallel linear in lock step"),
                    host_overlaps=False, sharded_linear_s=tp["sharded_linear_s"], allreduce_waits=tp["waits"],
                    note=f"measured: {bandwidth / 1e9:.3g} GB/s weight streaming ({slowdown:.2f}x slower with both "
                         f"devices busy), {device.host_s_per_op * 1e6:.2f} us per op "
                         f"({device.lock_wait_s_per_op * 1e6:.2f} us more waiting for the interpreter lock with both "
                         f"stage threads busy), all-reduce "
                         f"{tp['latency_s'] * 1e6:.0f} us + bytes / {tp['bandwidth'] / 1e9:.3g} GB/s, waiting "
                         + ", ".join(f"{s * 1e6:.0f} us more after {w * 1e3:.1f} ms of work"
                                     for w, s in tp["waits"][1:])
                         + ", DTensor " + ", ".join(f"{s * 1e6:.0f} us" for _, s in tp["sharded_linear_s"])
                         + " per column-parallel linear of " + ", ".join(f"{r:g}" for r, _ in tp["sharded_linear_s"])
                         + " rows")
