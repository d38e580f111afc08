"""Every way the course trains on several devices, as a task graph for the discrete-event core.

Pipelines execute the engines' own action lists (`helpers.pipeline.schedules`), in the order each device runs them,
waiting where `dependencies` says; a device holding several stages (interleaved, ZB-V) runs each action with its
stage's layers, and messages between two stages of one device cost nothing. A split backward (ZB-H1, ZB-V) is a B of
the input-gradient part (`LayerCost.weight_s` aside; on the first stage, whose input needs no gradient, nothing)
and a W of the weight part, which frees the micro-batch's activations. Data parallelism follows PyTorch's engines:
- DDP: gradient accumulation with `no_sync` (no communication until the last micro-batch); in its backward,
  gradients fill buckets in the order they become ready, i.e. reverse layer order (the first bucket 1 MiB, then
  25 MiB: `_DEFAULT_FIRST_BUCKET_BYTES` and `bucket_cap_mb` in torch/nn/parallel/distributed.py; `rebuild_buckets`
  in torch/csrc/distributed/c10d/reducer.cpp), and each bucket's all-reduce starts as soon as its last gradient is
  ready, overlapping the rest of backward. Buckets are filled byte by byte here; DDP adds whole tensors, so its
  buckets can run over the cap by one tensor. Gradients travel in the recipe's gradient dtype.
- ZeRO-1 (`ZeroRedundancyOptimizer` over DDP): DDP's all-reduce, the optimizer on this device's shard, then each
  owner broadcasts its updated parameters, tensor by tensor (PyTorch's default, `parameters_as_bucket_view=False`),
  one broadcast after another on one communicator: every parameter byte crosses a link once, one latency per tensor.
- FSDP2 (`fully_shard` per layer; "zero2" is FSDP2 with `reshard_after_forward=False`, as in helpers.catalog):
  a layer's parameters all-gathered before its forward and, when resharding after forward, again before its
  backward (the last layer too: FSDP2 keeps only the root unit gathered); each layer's gradients reduce-scattered
  after its backward, every micro-batch; all-gathers and reduce-scatters on streams of their own that share the
  link (prefetch, copies and the host's work per collective: `_Builder.run_fsdp2`). Frozen parameters (LoRA's
  base, QLoRA's packed codes: `LayerCost.frozen_bytes`) are gathered with the rest; only trainable ones have
  gradients to reduce-scatter. With `cpu_offload` (FSDP2's CPUOffloadPolicy, pinned) each unit's shard is copied from
  the host into the all-gather's input over the GPU's own PCIe link (`Host.pcie`) before every gather, each reduced
  gradient shard goes back, and the optimizer steps on the host, memory-bound (`Workload.optimizer_bytes` at
  `Host.memory`, which the ranks share).
- DeepSpeed's ZeRO-1 and ZeRO-2 (`ds_zero1`, `ds_zero2`): each full bucket all-reduced on the computing thread (its
  `overlap_comm` is off by default), the step on the rank's partition, the weights all-gathered after it; its
  ZeRO-3 (`ds_zero3`) as FSDP2 resharding after forward (`_Builder.run_deepspeed_zero12`, `run_fsdp2`).
- Activation offload (`activation_offload`, `torch.autograd.graph.save_on_cpu(pin_memory=True)`): what a layer saves
  for its backward (its input alone where it is checkpointed) is copied to the host after its forward and back
  before its backward, on the compute stream (save_on_cpu's copies are issued on the current stream): not overlapped.
- DP x PP: a pipeline per replica, then one flat all-reduce per stage across replicas (as our engine does).
Compute and communication overlap freely (separate streams); communication kernels are not modelled as slowing
compute. Memory per device: weights, gradients and optimizer state by the ZeRO formulas (Rajbhandari et al. 2020)
plus the peak of activations held by in-flight micro-batches, walked in the order each device runs its work.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from helpers.sizing.ledger import DeviceMemory
from helpers.partition import optimal_split
from helpers.pipeline.schedules import (Action, dependencies, layout_of, make_schedule, split_backwards,
                                        weights_in_groups)
from helpers.simulate.events import TaskGraph
from helpers.simulate.job import FREE_HOST, Host, Job
from helpers.hardware import FREE_LINK, Collectives, Link, SharedCores, collective_s
from helpers.dtypes import BYTES
from helpers.simulate.workload import Workload
from helpers.timeline import COMPUTE_KINDS, Event, busy_fraction
from helpers.units import MiB


@dataclass(frozen=True)
class Simulation:
    """One simulated optimizer step: its time, per-device busy fraction, memory and timeline."""

    job: Job
    step_s: float
    events: tuple[Event, ...]
    busy: dict[int, float]
    memory: dict[int, DeviceMemory]  # peak per device (params includes FSDP2's gathered layers)
    in_flight: dict[int, int]  # most micro-batches holding activations at once, per device

    @property
    def samples_per_s(self) -> float:
        return self.job.batch / self.step_s

    @property
    def bubble(self) -> float:
        """Idle share of the devices' time: 1 - mean busy fraction."""
        return 1 - sum(self.busy.values()) / len(self.busy)

    @property
    def peak_bytes(self) -> int:
        """The fullest device's peak: what must fit."""
        return max(m.total for m in self.memory.values())

    def trace(self, path=None) -> dict:
        """The simulated timeline as a Chrome / Perfetto trace, written to `path` if given: the same function as
        measured timelines (`helpers.timeline.chrome_trace`)."""
        from helpers.timeline import chrome_trace

        return chrome_trace(self.events, path)

    def plot(self, ax=None, title: str | None = None):
        """The simulated timeline, drawn by the same function as measured ones."""
        from helpers.timeline import plot_timeline

        return plot_timeline(self.events, ax=ax, title=title or f"simulated: {self.job.label()}")


@dataclass
class _Trace:
    """What one device's compute does to its saved activations, in the order it runs."""

    alive: float = 0.0
    peak: float = 0.0
    holding: set = field(default_factory=set)
    most: int = 0

    def forward(self, held: float, microbatch: int) -> None:
        self.alive += held
        self.peak = max(self.peak, self.alive)
        self.holding.add(microbatch)
        self.most = max(self.most, len(self.holding))

    def backward(self, held: float, transient: float, microbatch: int, last: bool) -> None:
        self.peak = max(self.peak, self.alive + transient)
        self.alive -= held
        if last:
            self.holding.discard(microbatch)


class _Builder:
    """Adds one job's tasks to a graph; keeps each device's activation trace and training state."""

    def __init__(self, workload: Workload, job: Job, link: Link, collective_link: Link | Collectives | None = None,
                 host: Host | None = None):
        if (job.cpu_offload or job.activation_offload) and host is None:
            raise ValueError("an offloading job needs the rig's host (Host: PCIe and host memory bandwidth)")
        self.w, self.job, self.link, self.host = workload, job, link, host or FREE_HOST
        self.coll = collective_link or link
        recompute = job.activation_checkpointing
        if recompute not in (True, False) and max(recompute, default=-1) >= len(workload.layers):
            raise ValueError(f"checkpointed layers {sorted(recompute)} must be indices of the workload's "
                             f"{len(workload.layers)} layers")
        self.layers = workload.layers
        self.graph = TaskGraph()
        self.size = job.samples_per_microbatch  # the pipeline's (equal) micro-batch
        self.sizes = {d: (job.shares[d // job.pp] // job.microbatches if job.shares else self.size)
                      for d in range(job.world)}  # each device's micro-batch: a replica's share / micro-batches
        self.speeds = job.speeds or (1.0,) * job.world
        self.traces = {d: _Trace() for d in range(job.world)}
        self.state: dict[int, DeviceMemory] = {}

    # --- per micro-batch costs of a layer range [a, b) ---------------------------------------------------------
    def _sum(self, a: int, b: int, attr: str) -> float:
        return sum(getattr(layer, attr) for layer in self.layers[a:b])

    def held(self, dev: int, a: int, b: int) -> float:
        """Bytes a micro-batch keeps on the device until its backward: every saved activation, or for a
        checkpointed layer only its input."""
        ck = self.job.checkpoints
        return self.sizes[dev] * sum((self.layers[i - 1].output if i > 0 else 0.0) if ck(i)
                                     else self.layers[i].activations for i in range(a, b))

    def transient(self, dev: int, a: int, b: int) -> float:
        """Extra bytes during backward: one checkpointed layer's recomputed activations at a time."""
        return self.sizes[dev] * max((self.layers[i].activations for i in range(a, b) if self.job.checkpoints(i)),
                               default=0.0)

    def recompute_s(self, dev: int, a: int, b: int) -> float:
        """The forward of the checkpointed layers in [a, b), run again in backward."""
        return self.sizes[dev] * sum(self.layers[i].forward_s for i in range(a, b) if self.job.checkpoints(i))

    def params(self, a: int, b: int) -> int:
        return int(self._sum(a, b, "params"))

    # --- tasks --------------------------------------------------------------------------------------------------
    def compute(self, dev: int, seconds: float, kind: str, after=(), mb: int | None = None,
                stage: int | None = None) -> int:
        """A task on `dev`'s compute stream (the device's own work, in the order it is added); its compute kinds
        (`helpers.timeline.COMPUTE_KINDS`) at the device's speed, copies and receive posts as they are."""
        seconds = seconds / self.speeds[dev] if kind in COMPUTE_KINDS else seconds
        return self.graph.add(seconds, [("compute", dev)], kind, [dev], after, microbatch=mb, stage=stage)

    def forward(self, dev: int, a: int, b: int, mb: int, after, stage: int | None = None) -> int:
        """Forward of layers [a, b) (pipeline `stage`: the device's trace counts each stage's micro-batches); with
        activation offload, then the copy of what it saved to the host."""
        held = self.held(dev, a, b)
        offload = self.job.activation_offload
        self.traces[dev].forward(0.0 if offload else held, mb if stage is None else (stage, mb))
        task = self.compute(dev, self.sizes[dev] * self._sum(a, b, "forward_s"), "forward", after, mb, stage)
        return self.compute(dev, held / self.host.pcie, "offload", [task], mb, stage) if offload else task

    def backward(self, dev: int, a: int, b: int, mb: int, after, last: bool = True, extra_s: float = 0.0,
                 stage: int | None = None, weights_later: bool = False) -> int:
        """Backward of layers [a, b) (recompute first with checkpointing), plus `extra_s` of work the engine does
        inline (DDP's bucket copies); `last` when it frees the micro-batch. With `weights_later`, only the
        input-gradient part, and the activations stay for `backward_weights`."""
        trace, held = self.traces[dev], self.held(dev, a, b)
        if self.job.activation_offload:  # what the forward saved comes back from the host first
            after = [self.compute(dev, held / self.host.pcie, "offload", after, mb, stage)]
            held, transient = 0.0, held + self.transient(dev, a, b)
        else:
            transient = self.transient(dev, a, b)
        if weights_later:
            trace.peak = max(trace.peak, trace.alive + transient)
        else:
            trace.backward(held, transient, mb if stage is None else (stage, mb), last)
        recompute = self.recompute_s(dev, a, b)
        if recompute:
            after = [self.compute(dev, recompute, "recompute", after, mb, stage)]
        seconds = self.sizes[dev] * self._sum(a, b, "backward_s") - (
            self.weight_s(dev, a, b) if weights_later else 0.0)
        return self.compute(dev, seconds + extra_s, "backward", after, mb, stage)

    def weight_s(self, dev: int, a: int, b: int) -> float:
        """The weight-gradient part of layers [a, b)'s backward; all of it for a stage whose input needs no
        gradient (the first: it gets token ids), which has no input gradient to compute first."""
        return self.sizes[dev] * self._sum(a, b, "backward_s" if a == 0 else "weight_s")

    def backward_weights(self, dev: int, a: int, b: int, mb: int, after, stage: int) -> int:
        """The weight gradients a split backward left for later; they free the micro-batch's activations. Where the
        stage's input needs a gradient (not the first: its weight pass is its whole backward, one call), the split
        costs the workload's `split_overhead` of the backward beyond it, paid in the weight pass. Weight passes
        batched (`Job.batched_weights`) run back to back, each priced as alone: one product over k micro-batches'
        rows does the same FLOPs, and on the CPU rig measured within 2% of k products (docs/bench.md); on a GPU it
        saves only where a micro-batch's rows leave the product memory-bound (`roofline.weight_gradient_s`)."""
        self.traces[dev].backward(self.held(dev, a, b), 0.0, (stage, mb), True)
        overhead = self.w.split_overhead * self.sizes[dev] * self._sum(a, b, "backward_s") if a > 0 else 0.0
        return self.compute(dev, self.weight_s(dev, a, b) + overhead, "weight", after, mb, stage)

    def copy_s(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` on a device (0 when the workload's copies are free)."""
        return nbytes / self.w.copy_bandwidth

    def pcie(self, dev: int, direction: str, nbytes: float, after) -> int:
        """A copy between `dev` and pinned host memory over its own PCIe link, on a copy stream of that direction
        (h2d, d2h)."""
        return self.graph.add(nbytes / self.host.pcie, [(direction, dev)], direction, [dev], after)

    def copy(self, dev: int, nbytes: float, after) -> int:
        """A memory copy the engine does on the device's own compute (into or out of a communication buffer)."""
        return self.compute(dev, self.copy_s(nbytes), "copy", after)

    def optimizer(self, dev: int, share: float, after) -> int:
        return self.compute(dev, self.w.optimizer_s * share, "optimizer", after)

    def send(self, src: int, dst: int, nbytes: float, mb: int, after: int) -> int:
        return self.graph.add(self.link.seconds(nbytes), [("send", src, dst)], "send", [src], [after],
                              links=[("link", src, dst)], microbatch=mb)

    def post_receive(self, dev: int, mb: int, stage: int | None = None) -> int:
        """The device's thread posting a receive (`Link.receive_s`), in its own order on its compute stream: it
        waits, off the cores, before it can wait for the message."""
        return self.compute(dev, self.link.receive_s, "recv", (), mb, stage)

    def collective(self, kind: str, group: list[int], seconds: float, stream: str, after,
                   holds_compute: bool = False) -> int:
        """One collective over `group` (a ring: it holds every link i -> i+1 of the group); `holds_compute`: the
        thread that computes waits for it, so it also holds every member's compute stream."""
        ring = [("link", group[i], group[(i + 1) % len(group)]) for i in range(len(group))] if len(group) > 1 else []
        streams = [(stream, d) for d in group] + ([("compute", d) for d in group] if holds_compute else [])
        return self.graph.add(seconds, streams, kind, group, after, links=ring)

    # --- strategies ---------------------------------------------------------------------------------------------
    def ranges(self) -> list[tuple[int, int]]:
        """[(first, end)) layers of each model stage (devices x stages per device of them)."""
        p, n = self.job.layout.stages, len(self.layers)
        if self.job.boundaries is None:  # time-balanced on the first replica's devices, at their speeds
            layout = self.job.layout
            cut = optimal_split(self.w.time_costs(), p,
                                speeds=[self.speeds[layout.device_of(j)] for j in range(p)]).boundaries
        else:
            cut = tuple(self.job.boundaries)
            if len(cut) != p - 1 or list(cut) != sorted(set(cut)) or (cut and not 0 < cut[0] <= cut[-1] < n):
                raise ValueError(f"boundaries {cut} must give {p - 1} increasing first-layer indices between 1 and "
                                 f"{n - 1} for {p} stages of {n} layers")
        edges = [0, *cut, n]
        return list(zip(edges, edges[1:]))

    def state_for(self, params: int, shard: int = 1) -> DeviceMemory:
        """Weights, gradients and optimizer state of `params` parameters, optimizer state sharded `shard` ways."""
        w, g, o = self.w.bytes_per_param
        return DeviceMemory(w * params, g * params, int(o * params / shard))

    def pipeline(self, schedule: str, microbatches: int, devices: list[int], ranges) -> list[int]:
        """Run the schedule's action lists on `devices` (`ranges`: the layers of each model stage); return each
        device's last compute task."""
        p = len(devices)
        actions = weights_in_groups(make_schedule(schedule, p, microbatches), self.job.batched_weights)
        layout = layout_of(actions)
        split = [split_backwards(a) for a in actions]
        done: dict[tuple[int, Action], int] = {}
        message: dict[tuple[int, Action], int] = {}  # the send carrying an action's result to another device
        position = [0] * p
        while any(position[s] < len(actions[s]) for s in range(p)):
            for s in range(p):
                while position[s] < len(actions[s]):
                    action = actions[s][position[s]]
                    deps = dependencies(s, action, layout)
                    if not all(d in done for d in deps):
                        break
                    stage, dev, mb = layout.stage(s, action.chunk), devices[s], action.microbatch
                    after = [done[d] if d[0] == s else message[d] for d in deps]
                    if self.link.receive_s and any(d[0] != s for d in deps):
                        after.append(self.post_receive(dev, mb, stage))
                    a, b = ranges[stage]
                    if action.kind == "F":
                        done[(s, action)] = task = self.forward(dev, a, b, mb, after, stage)
                        to = layout.device_of(stage + 1) if stage < layout.stages - 1 else s
                        nbytes = self.size * self.layers[b - 1].output
                    elif action.kind == "B":
                        done[(s, action)] = task = self.backward(dev, a, b, mb, after, stage=stage,
                                                                 weights_later=(action.chunk, mb) in split[s])
                        to = layout.device_of(stage - 1) if stage > 0 else s
                        nbytes = self.size * self.layers[a - 1].output if a > 0 else 0.0
                    else:
                        done[(s, action)] = task = self.backward_weights(dev, a, b, mb, after, stage)
                        to = s
                    if to != s:
                        message[(s, action)] = self.send(dev, devices[to], nbytes, mb, task)
                    position[s] += 1
        return [done[(s, actions[s][-1])] for s in range(p)]

    def device_params(self, ranges, device: int) -> int:
        """Parameters of the model stages the pipeline's `device` holds."""
        return sum(self.params(*ranges[k]) for k in self.job.layout.stages_of(device))

    def run_single(self) -> None:
        n = len(self.layers)
        for k in range(self.job.microbatches):
            self.forward(0, 0, n, k, [])
            self.backward(0, 0, n, k, [])
        self.optimizer(0, 1.0, [])
        self.state[0] = self.state_for(self.w.n_params)

    def buckets(self, first_mb: float | None = None) -> list[tuple[int, float]]:
        """DDP's buckets in launch order: (the layer whose backward completes it, its gradient bytes); the first one
        `first_mb` (DDP's first_bucket_mb; DeepSpeed's are all bucket_mb)."""
        grad_bytes = self.w.bytes_per_param[1]
        first = self.job.first_bucket_mb if first_mb is None else first_mb
        cap, full_cap = int(first * MiB), int(self.job.bucket_mb * MiB)
        out, fill, last_layer = [], 0, None
        for i in reversed(range(len(self.layers))):
            remaining = self.layers[i].params * grad_bytes
            while remaining > 0:
                take = min(remaining, cap - fill)
                fill, remaining, last_layer = fill + take, remaining - take, i
                if fill >= cap:
                    out.append((i, fill))
                    fill, cap = 0, full_cap
        if fill:
            out.append((last_layer, fill))
        return out

    def local_steps(self, devices: list[int], copy_passes: int = 0) -> dict[tuple[int, int], int]:
        """Forward and per-layer backward of every micro-batch on every replica; the last micro-batch's backward
        task per (device, layer). In the last (synchronising) micro-batch each layer's backward also makes
        `copy_passes` passes over its gradient bytes (our hook divides the bucket; without bucket views DDP also
        copies each gradient into its bucket)."""
        n, m = len(self.layers), self.job.microbatches
        g = self.w.bytes_per_param[1]
        last = {}
        for dev in devices:
            for k in range(m):
                self.forward(dev, 0, n, k, [])
                for i in reversed(range(n)):
                    extra = self.copy_s(copy_passes * g * self.layers[i].params) if k == m - 1 else 0.0
                    last[(dev, i)] = self.backward(dev, i, i + 1, k, [], last=i == 0, extra_s=extra)
        return last

    def run_ddp(self, zero1: bool) -> None:
        devices = list(range(self.job.dp))
        r = len(devices)
        views, g = self.job.bucket_views, self.w.bytes_per_param[1]
        cast = self.job.wire != "auto" and BYTES[self.job.wire] != g
        on_wire = BYTES[self.job.wire] / g if cast else 1.0
        # [into its bucket,] the hook's division[, its cast to the wire's dtype]
        ready = self.local_steps(devices, copy_passes=1 + (not views) + cast)
        reduced, back = [], {d: [] for d in devices}
        for layer, nbytes in self.buckets():
            reduced.append(self.collective("allreduce", devices, collective_s(self.coll, "allreduce",
                                                                              nbytes * on_wire, r),
                                           "comm", [ready[(d, layer)] for d in devices]))
            if cast:  # each device copies the reduced bucket back into its gradients' dtype
                back = {d: [self.copy(d, nbytes, reduced[-1:])] for d in devices}
        grads = 0 if views else g * self.w.n_params  # buckets copied back into the grads
        copied = [self.copy(d, grads, reduced[-1:] + back[d]) for d in devices]
        updates = [self.optimizer(d, 1 / r if zero1 else 1.0, [c]) for d, c in zip(devices, copied)]
        if zero1:  # each owner broadcasts its updated parameters, tensor by tensor, one after another
            w = self.w.bytes_per_param[0]
            for layer in self.layers:
                if layer.params:
                    self.collective("broadcast", devices, collective_s(self.coll, "broadcast", w * layer.params, r,
                                                                        layer.tensors), "comm", updates)
        for d in devices:
            self.state[d] = self.state_for(self.w.n_params, shard=r if zero1 else 1)

    def run_deepspeed_zero12(self, stage: int) -> None:
        """DeepSpeed's ZeRO-1 and ZeRO-2 (its stage_1_and_2.py) with its defaults: each gradient copied into the
        reduce bucket (contiguous_gradients), each full bucket all-reduced as backward fills it, every rank keeping
        its partition (use_multi_rank_bucket_allreduce: 2 (N-1)/N of the bucket, where the ZeRO paper's reduce to
        the owners is (N-1)/N: measured in tests/test_deepspeed_accounting.py), on the thread that computes
        (overlap_comm is off by default, so the reduction holds the compute); the optimizer steps the rank's
        partition; the updated weights are all-gathered before the next forward. Gradients held: the whole (ZeRO-1)
        or the rank's partition (ZeRO-2)."""
        devices = list(range(self.job.dp))
        r = len(devices)
        ready = self.local_steps(devices, copy_passes=1)
        reduced = [self.collective("allreduce", devices, collective_s(self.coll, "allreduce", nbytes, r),
                                   "comm", [ready[(d, layer)] for d in devices], holds_compute=True)
                   for layer, nbytes in self.buckets(first_mb=self.job.bucket_mb)]
        updates = [self.optimizer(d, 1 / r, reduced[-1:]) for d in devices]
        weights = self.w.bytes_per_param[0] * self.w.n_params
        self.collective("allgather", devices, collective_s(self.coll, "allgather", weights, r), "comm", updates,
                        holds_compute=True)
        for d in devices:
            state = self.state_for(self.w.n_params, shard=r)
            self.state[d] = DeviceMemory(state.params, state.grads // (r if stage == 2 else 1), state.optimizer)

    @property
    def reshards(self) -> bool:
        """The weights released after each layer's forward and gathered again in backward: FSDP2's
        reshard_after_forward, and DeepSpeed's ZeRO-3 (which keeps no such knob off)."""
        return self.job.entry.reshard_after_forward is not False

    def run_fsdp2(self) -> None:
        """FSDP2 as `fully_shard` runs it: before a layer computes, its parameters are all-gathered (copied into the
        all-gather's input, gathered, copied out into the layer's parameters); after a layer's backward its
        gradients are copied into the reduce-scatter's input and reduce-scattered. Copies run on the device.
        Prefetch (at most two layers gathered): in backward FSDP2 issues the next layer's gather before computing
        the current one; in forward it does so implicitly on GPUs, where the host issues the next gather while the
        device still computes (`forward_prefetch=True`); on the CPU rig the host computes each layer itself, so the
        next gather starts only as that layer begins (`forward_prefetch=False`).
        Where the host computes, the collectives also hold it (`host_waits=True`): FSDP2 issues them with
        async_op=False (`unshard_async_op` in torch/distributed/fsdp/_fully_shard), which on gloo waits in the
        calling thread, so nothing overlaps compute (docs/bench.md, `run_fsdp2`).
        Before each collective the host does `fsdp2_host_s` of work of its own (DTensor dispatch, the collectives'
        wrappers: measured in the same run by `calibrate.fsdp2_host_samples`); it holds the compute where the host
        computes, and runs beside the device elsewhere.
        A layer's gathered bytes are its trainable parameters' and its frozen ones (`LayerCost.frozen_bytes`); only the
        trainable ones are reduce-scattered. With `cpu_offload` the copy into the all-gather's input is the shard's
        copy from pinned host memory (FSDP2 copies the host shard into it), on the device's host-to-device link, each
        gradient shard is copied back to the host after its reduce-scatter, and the optimizer steps there once every
        gradient has arrived."""
        devices = list(range(self.job.dp))
        r, n = len(devices), len(self.layers)
        w, g, o = self.w.bytes_per_param
        offload = self.job.cpu_offload

        def weight_bytes(i: int) -> float:
            """What layer i's all-gather carries: its trainable parameters and its frozen bytes."""
            return w * self.layers[i].params + self.layers[i].frozen_bytes

        def issue(kind: str, full: float, nbytes: float, after: dict[int, list[int]], from_host: bool = False) -> int:
            """One of FSDP2's collectives of `full` bytes on its own stream (all-gathers and reduce-scatters have one
            each): on each device the host's work for it, which waits for nothing on the device, then the copy of
            `nbytes` into its input after `after[device]` (`from_host`: from pinned host memory), then the
            collective."""
            copied = []
            for d in devices:
                deps = list(after.get(d, []))
                if self.job.fsdp2_host_s:
                    host = "compute" if self.job.host_waits else "host"
                    deps.append(self.graph.add(self.job.fsdp2_host_s, [(host, d)], "host", [d]))
                copied.append(self.pcie(d, "h2d", nbytes, deps) if from_host else self.copy(d, nbytes, deps))
            return self.collective(kind, devices, collective_s(self.coll, kind, full, r), kind, copied,
                                   holds_compute=self.job.host_waits)

        def unshard(i: int) -> int:
            """Copy-in of this device's shard (from the host: as the host keeps it), then the all-gather."""
            shard = (self.w.host_bytes_per_param or w) * self.layers[i].params + self.layers[i].frozen_bytes
            return issue("allgather", weight_bytes(i), (shard if offload else weight_bytes(i)) / r, {},
                         from_host=offload)

        scattered = []
        for k in range(self.job.microbatches):
            gathered = {0: unshard(0)} if weight_bytes(0) else {}
            for i in range(n):
                if i not in gathered and weight_bytes(i):  # no prefetch: gathered as the layer starts
                    gathered[i] = unshard(i)
                if self.job.forward_prefetch and i + 1 < n and weight_bytes(i + 1):
                    gathered[i + 1] = unshard(i + 1)  # issued before this layer computes
                for d in devices:
                    ready = [self.copy(d, weight_bytes(i), [gathered[i]])] if i in gathered else []
                    self.forward(d, i, i + 1, k, ready)
            bwd: dict[tuple[int, int], int] = {}
            regathered = {}
            reshard = lambda i: weight_bytes(i) and self.reshards  # noqa: E731
            if reshard(n - 1):  # the last layer too: only the root unit stays gathered after forward
                regathered[n - 1] = unshard(n - 1)
            for i in reversed(range(n)):
                if i >= 1 and reshard(i - 1):  # FSDP2's backward prefetch: the next layer's gather, issued first
                    regathered[i - 1] = unshard(i - 1)
                for d in devices:
                    ready = [self.copy(d, weight_bytes(i), [regathered[i]])] if i in regathered else []
                    bwd[(d, i)] = self.backward(d, i, i + 1, k, ready, last=i == 0)
                if self.layers[i].params:
                    grads = g * self.layers[i].params
                    scattered.append(issue("reducescatter", grads, grads, {d: [bwd[(d, i)]] for d in devices}))
                    if offload:  # each device's reduced shard to the host
                        scattered += [self.pcie(d, "d2h", grads / r, scattered[-1:]) for d in devices]
        self.sharded_step(devices, scattered)

    def sharded_step(self, devices: list[int], scattered: list[int]) -> None:
        """FSDP2's optimizer step once every gradient shard is reduced (on the host with `cpu_offload`), and what
        each device then holds: its shards (none offloaded) and, at the peak, the gathered layers."""
        r, offload = len(devices), self.job.cpu_offload
        w, g, o = self.w.bytes_per_param
        for d in devices:
            if offload:  # every rank steps its shard at once on the host's shared memory: all bytes at its bandwidth
                self.graph.add(self.w.optimizer_bytes / self.host.memory, [("compute", d)], "host step", [d],
                               scattered)
            else:
                self.optimizer(d, 1 / r, scattered[-1:])
        sizes = [layer.params + layer.frozen_bytes / w for layer in self.layers]  # in trainable parameters' bytes
        gathered = sum(sizes) if not self.reshards else max(
            a + b for a, b in zip(sizes, sizes[1:] + [0]))
        total, trainable = sum(sizes), self.w.n_params
        for d in devices:
            self.state[d] = DeviceMemory(int(w * ((0 if offload else total / r) + gathered)),
                                         int(g * ((0 if offload else trainable / r) + max(layer.params
                                                                                          for layer in self.layers))),
                                         int(0 if offload else o * trainable / r))

    def run_pipelines(self) -> None:
        """A pipeline per replica; with several replicas, then one flat all-reduce per stage across them."""
        p, r = self.job.pp, self.job.dp
        ranges = self.ranges()
        last = [self.pipeline(self.job.pipeline_schedule, self.job.microbatches, [rep * p + s for s in range(p)],
                              ranges) for rep in range(r)]
        n = self.w.n_params or 1
        for s in range(p):
            params = self.device_params(ranges, s)
            group, after = [rep * p + s for rep in range(r)], [last[rep][s] for rep in range(r)]
            if r > 1:
                seconds = collective_s(self.coll, "allreduce", self.w.bytes_per_param[1] * params, r)
                after = [self.collective("allreduce", group, seconds, "comm", after)]
            for dev in group:
                self.optimizer(dev, params / n, after)
                self.state[dev] = self.state_for(params)

    def memory(self) -> dict[int, DeviceMemory]:
        return {d: DeviceMemory(s.params, s.grads, s.optimizer, int(self.traces[d].peak))
                for d, s in sorted(self.state.items())}

    def build(self) -> None:
        entry = self.job.entry
        if entry.pipeline:
            self.run_pipelines()
        elif entry.bucketed:
            self.run_ddp(zero1=entry.name == "zero1")
        elif entry.fully_sharded or entry.shards[0]:  # DeepSpeed's ZeRO-3 gathers and reduces layer by layer too
            self.run_fsdp2()
        elif entry.library == "deepspeed":
            self.run_deepspeed_zero12(stage=2 if entry.shards[1] else 1)
        else:
            self.run_single()


def simulate_memory(workload: Workload, job: Job) -> dict[int, DeviceMemory]:
    """Peak memory per device of `job`, without timing it (the order of work decides what is held, not the
    clock): cheap enough to screen many configurations."""
    builder = _Builder(workload, job, FREE_LINK, host=FREE_HOST)
    builder.build()
    return builder.memory()


def simulate(workload: Workload, job: Job, link: Link = FREE_LINK, collective_link: Link | Collectives | None = None,
             cores: SharedCores | None = None, host: Host | None = None) -> Simulation:
    """Simulate one optimizer step of `job` on `workload` with devices joined pairwise by `link` (point-to-point
    messages; also the collectives, by the ring's costs, unless `collective_link` models them: a Link, e.g.
    `fit_collective_link` of a measured all-reduce, or measured `Collectives`). `cores`: the devices share a pool
    of processors (the CPU rig), see `SharedCores`. `host`: the rig's PCIe and host memory (`Host`), which a job
    that offloads needs."""
    builder = _Builder(workload, job, link, collective_link, host)
    builder.build()
    step = builder.graph.run(cores)
    events = builder.graph.events()
    busy = busy_fraction(events, COMPUTE_KINDS)
    memory = builder.memory()
    return Simulation(job, step, tuple(events), {d: busy.get(d, 0.0) for d in memory}, memory,
                      {d: builder.traces[d].most for d in memory})
