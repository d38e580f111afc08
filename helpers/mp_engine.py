"""The multi-process pipeline engine: one rank per device, activations and gradients sent between ranks.

`run_pipeline_job` checks the job, then starts one rank per stage through the launcher. Each rank builds the same
seeded model and data, keeps its own stage, and executes its action list of the schedule with send/recv
(blocking), or with every receive posted up front and sends in flight while it computes (`overlap=True`,
isend/irecv). `engine="torch"` runs the same stages with `torch.distributed.pipelining` (ScheduleGPipe /
Schedule1F1B) instead, its timeline taken from its stage's per-micro-batch methods. Every rank records the common timeline events.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from helpers.pipeline.comm import Wire
from helpers.runtime.launch import rank_device, run
from helpers.memory import ledger_for
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.pipeline.schedules import Schedule, make_schedule, validate
from helpers.pipeline.stages import StageExecutor, stage_ranges
from helpers.timeline import Event, Recorder, gather_events

ENGINES = ("ours", "torch")


@dataclass(frozen=True)
class PipelineJob:
    """Everything a rank needs to rebuild the same model, data and schedule."""

    cfg: StackConfig
    boundaries: tuple[int, ...]
    schedule: str = "gpipe"
    microbatches: int = 4
    batch: int = 32
    engine: str = "ours"
    wire: str = "fp32"
    overlap: bool = True
    steps: int = 3  # timed steps (after one warm-up)
    model_seed: int = 0
    data_seed: int = 0
    return_grads: bool = False

    @property
    def stages(self) -> int:
        return len(self.boundaries) + 1


@dataclass
class PipelineResult:
    loss: float
    step_s: float  # median over steps of the slowest rank's step time
    step_times: list[float]  # every timed step (slowest rank), for pooling rounds
    events: list[Event]
    peak_activations: list[int]  # per rank (device)
    grads: list[torch.Tensor] = field(default_factory=list)  # in model.parameters() order, if asked for


def check_job(job: PipelineJob, max_ranks: int | None = None) -> Schedule:
    """Refuse a job that cannot run, with the numbers, before any process starts."""
    if job.engine not in ENGINES:
        raise ValueError(f"unknown engine {job.engine!r}; choose one of {ENGINES}")
    n_layers = job.cfg.n_blocks + 2
    stage_ranges(n_layers, job.boundaries)
    if max_ranks is not None and job.stages > max_ranks:
        raise ValueError(f"{job.stages} stages need {job.stages} ranks, but the rig hosts {max_ranks}: "
                         "one stage per device")
    if job.batch % job.microbatches:
        raise ValueError(f"global batch {job.batch} is not divisible by {job.microbatches} micro-batches")
    Wire.of(job.wire)
    if job.engine == "torch" and job.wire != "fp32":
        raise ValueError("torch.distributed.pipelining sends in the compute dtype: use wire='fp32' with it")
    if job.schedule == "1f1b" and not job.overlap and job.engine == "ours":
        raise ValueError("1F1B with blocking sends deadlocks: stage 0 blocks sending the next activation while "
                         "stage 1 blocks sending a gradient back. Use overlap=True (isend/irecv), as every "
                         "real 1F1B implementation does")
    schedule = make_schedule(job.schedule, job.stages, job.microbatches)
    validate(schedule, job.microbatches)
    return schedule


def run_pipeline_job(job: PipelineJob, rig, timeout: float = 300.0) -> PipelineResult:
    """Run `job` on one rank per stage and combine what the ranks return."""
    check_job(job, rig.max_ranks)
    parts = run(pipeline_worker, job, nranks=job.stages, rig=rig, timeout=timeout)
    per_step = [max(p["times"][i] for p in parts) for i in range(len(parts[0]["times"]))]
    return PipelineResult(loss=parts[-1]["loss"], step_s=statistics.median(per_step), step_times=per_step,
                          events=parts[0]["events"],
                          peak_activations=[p["peak_activations"] for p in parts],
                          grads=[g for p in parts for g in p["grads"]])


# --- inside a rank ---------------------------------------------------------------------------------------------

def _boundary_shape(layers: list[nn.Module], upto: int, x_mb: torch.Tensor) -> torch.Size:
    with torch.no_grad():
        h = x_mb
        for layer in layers[:upto]:
            h = layer(h)
    return h.shape


def pipeline_groups(pipelines: list[list[int]]) -> dict[tuple[int, int], object]:
    """One process group per direction of every link: (a, b) carries a -> b. Every rank calls this with the same
    pipelines (lists of global ranks, stage order). NCCL runs all operations of one communicator in order on one
    stream, so on a shared pair a gradient send would queue behind an activation receive that waits for it: one
    communicator per direction keeps each direction in order and cannot deadlock. Gloo is happy either way."""
    groups = {}
    for ranks in pipelines:
        for a, b in zip(ranks, ranks[1:]):
            groups[(a, b)] = dist.new_group([a, b])
            groups[(b, a)] = dist.new_group([a, b])
    return groups


class _Links:
    """Send/recv of one stage's activations (tag 2*mb) and gradients (tag 2*mb+1) to its neighbours.

    `rank` is the stage index; `peers[i]` the global rank of stage i; `groups` from `pipeline_groups`.
    """

    def __init__(self, rank: int, p: int, shape_in, shape_out, wire: Wire, device, overlap: bool, m: int,
                 recorder: Recorder, peers: list[int], groups: dict[tuple[int, int], object]):
        self.rank, self.p, self.wire, self.device, self.overlap, self.m = rank, p, wire, device, overlap, m
        self.peers, self.groups, self.me = peers, groups, peers[rank]
        # gloo sends CPU tensors only: two ranks sharing one GPU (the one-GPU rig) stage through host memory
        self.wire_device = torch.device("cpu") if dist.get_backend() == "gloo" else device
        self.shape_in, self.shape_out, self.rec = shape_in, shape_out, recorder
        self.sends: list = []
        self.posted: dict[tuple[str, int], tuple] = {}

    def _buffer(self, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self.wire.dtype, device=self.wire_device)

    def _irecv(self, buf: torch.Tensor, src: int, tag: int):
        return dist.irecv(buf, src, group=self.groups[(src, self.me)], tag=tag)

    def post_receives(self) -> None:
        """Overlap mode: every receive of the step posted before any compute, so data lands while we work."""
        if not self.overlap:
            return
        for mb in range(self.m):
            if self.rank > 0:
                buf = self._buffer(self.shape_in)
                self.posted[("act", mb)] = (buf, self._irecv(buf, self.peers[self.rank - 1], 2 * mb))
            if self.rank < self.p - 1:
                buf = self._buffer(self.shape_out)
                self.posted[("grad", mb)] = (buf, self._irecv(buf, self.peers[self.rank + 1], 2 * mb + 1))

    def _recv(self, kind: str, mb: int, src: int, shape, tag: int) -> torch.Tensor:
        with self.rec.span("recv", mb):
            if self.overlap:
                buf, work = self.posted.pop((kind, mb))
            else:
                buf = self._buffer(shape)
                work = self._irecv(buf, src, tag)
            work.wait()
        return self.wire.unpack(buf.to(self.device))

    def _send(self, t: torch.Tensor, dst: int, tag: int, mb: int) -> None:
        data = self.wire.pack(t.detach()).to(self.wire_device).contiguous()
        work = dist.isend(data, dst, group=self.groups[(self.me, dst)], tag=tag)
        if self.overlap:
            self.sends.append((data, work))
        else:
            with self.rec.span("send", mb):
                work.wait()

    def recv_activation(self, mb: int) -> torch.Tensor:
        return self._recv("act", mb, self.peers[self.rank - 1], self.shape_in, 2 * mb)

    def recv_grad(self, mb: int) -> torch.Tensor:
        return self._recv("grad", mb, self.peers[self.rank + 1], self.shape_out, 2 * mb + 1)

    def send_activation(self, t: torch.Tensor, mb: int) -> None:
        self._send(t, self.peers[self.rank + 1], 2 * mb, mb)

    def send_grad(self, t: torch.Tensor, mb: int) -> None:
        self._send(t, self.peers[self.rank - 1], 2 * mb + 1, mb)

    def finish(self) -> None:
        for _, work in self.sends:
            work.wait()
        self.sends.clear()


def _our_step(ex: StageExecutor, actions, links: _Links, xs, ys, m: int) -> float | None:
    rank, p = links.rank, links.p
    losses = []
    links.post_receives()
    for action in actions:
        mb = action.microbatch
        if action.kind == "F":
            inp = xs[mb] if rank == 0 else links.recv_activation(mb)
            out = ex.forward(mb, inp, ys[mb] if rank == p - 1 else None)
            if rank == p - 1:
                losses.append(out.detach())
            else:
                links.send_activation(out, mb)
        else:
            grad = None if rank == p - 1 else links.recv_grad(mb)
            g = ex.backward(mb, grad, loss_scale=1.0 / m)
            if rank > 0:
                links.send_grad(g, mb)
    links.finish()
    return torch.stack(losses).mean().item() if losses else None


def _instrument_stage(pstage, rec: Recorder) -> None:
    """Put torch.distributed.pipelining's per-micro-batch work on our timeline: its stage runs each micro-batch
    through forward_one_chunk / backward_one_chunk, so wrapping those two methods records every span (the library's
    sends and receives happen outside them and stay invisible)."""
    forward, backward = pstage.forward_one_chunk, pstage.backward_one_chunk

    def forward_one_chunk(fwd_chunk_id: int, *args, **kwargs):
        with rec.span("forward", fwd_chunk_id):
            return forward(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id: int, *args, **kwargs):
        with rec.span("backward", bwd_chunk_id):
            return backward(bwd_chunk_id, *args, **kwargs)

    pstage.forward_one_chunk, pstage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def _torch_schedule(job: PipelineJob, stage: nn.Module, rank: int, device, xs_full, ys_full, rec: Recorder):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pstage = PipelineStage(stage, rank, job.stages, device)
    _instrument_stage(pstage, rec)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[job.schedule]
    sched = cls(pstage, job.microbatches, loss_fn=lm_loss)

    def step() -> float | None:
        if rank == 0:
            sched.step(xs_full)
            return None
        if rank == job.stages - 1:
            losses: list[torch.Tensor] = []
            sched.step(target=ys_full, losses=losses)
            return torch.stack([l.detach() for l in losses]).mean().item()
        sched.step()
        return None

    return step


def pipeline_worker(job: PipelineJob) -> dict:
    """One rank of a pipeline job (runs in a process started by the launcher, or under torchrun)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if p != job.stages:
        raise ValueError(f"the job has {job.stages} stages but the world has {p} ranks")
    device = rank_device()
    layers = list(build_stack(job.cfg, seed=job.model_seed))
    a, b = stage_ranges(len(layers), job.boundaries)[rank]
    stage = nn.Sequential(*layers[a:b]).to(device)
    x, y = SyntheticTokens(job.batch, job.cfg.seq_len, job.cfg.vocab, seed=job.data_seed).batch(0, job.batch)
    x, y = x.to(device), y.to(device)
    xs, ys = list(x.chunk(job.microbatches)), list(y.chunk(job.microbatches))
    label = f"rank{rank}"
    ledger = ledger_for([stage], [label])
    rec = Recorder(rank, device)
    if job.engine == "ours":
        ex = StageExecutor(stage, device, rank, rec, ledger.trackers()[0], lm_loss if rank == p - 1 else None)
        actions = make_schedule(job.schedule, p, job.microbatches)[rank]
        shape_in = _boundary_shape(layers, a, xs[0]) if rank > 0 else None
        shape_out = _boundary_shape(layers, b, xs[0]) if rank < p - 1 else None
        links = _Links(rank, p, shape_in, shape_out, Wire.of(job.wire), device, job.overlap, job.microbatches, rec,
                       list(range(p)), pipeline_groups([list(range(p))]))
        step = lambda: _our_step(ex, actions, links, xs, ys, job.microbatches)  # noqa: E731
    else:
        torch_step = _torch_schedule(job, stage, rank, device, x, y, rec)

        def step():
            with ledger.track_activations(label):
                return torch_step()
    times, loss = [], None
    for i in range(1 + job.steps + 1):  # warm-up, timed steps, one recorded step
        stage.zero_grad(set_to_none=False)
        if i == job.steps + 1:
            rec.clear()
            ledger.reset_peaks()
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if 0 < i <= job.steps:
            times.append(time.perf_counter() - t0)
    events = gather_events(rec.events())
    grads = [q.grad.detach().cpu().clone() for q in stage.parameters()] if job.return_grads else []
    return {"loss": loss, "times": times, "events": events, "grads": grads,
            "peak_activations": ledger.device(label).activations}
