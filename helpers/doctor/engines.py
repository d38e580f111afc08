"""One training step of every engine and strategy this rig supports, against one device (the doctor's section 4):
PASS within fp32's (or the precision's) tolerance, FAIL, or REFUSED with the support matrix's reason.

The strategies and their engines are the catalog's (helpers.catalog): every trained strategy on every engine it
lists gets a check (`strategy_checks`), so a strategy or schedule added there is checked at the next doctor run
without an edit here. Beside them, `variant_checks` runs chosen strategies with one feature each (blocking sends,
16-bit precision, gradient compression, a Hugging Face model, generation): those are about the feature, not the
strategy, and name their strategy for the support matrix's verdict."""
from __future__ import annotations

from typing import Callable

import torch

from helpers.catalog import CATALOG, Strategy
from helpers.check import max_grad_diff
from helpers.doctor.checks import Check, run_check
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.precision import Precision, max_relative_diff
from helpers.runtime.rig import Rig
from helpers.training.support import Support, support

CFG = StackConfig(hidden=64, n_blocks=4, heads=2, seq_len=16, vocab=128)  # small: each check takes seconds
BATCH = 8
CUT = (3,)
TOLERANCE = 1e-5  # fp32: same loss, gradients within 1e-5
Reference = Callable[..., tuple]  # a precision (default fp32) -> one device's loss and gradients at it


def _reference(device: torch.device, precision: Precision) -> tuple[float, list[torch.Tensor]]:
    """One device's loss and gradients for CFG's batch at `precision`: what every check is held to."""
    model = build_stack(CFG, device=device).to(precision.weights)
    x, y = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH)
    with precision.context(device):
        loss = lm_loss(model(x.to(device)), y.to(device))
    loss.backward()
    return loss.item(), [p.grad.detach().float().cpu() for p in model.parameters()]


def _compare(reference, loss: float, grads, precision: Precision) -> str:
    """fp32: gradients within 1e-5 of one device's; 16-bit: within the precision's relative tolerance."""
    ref_loss, ref_grads = reference
    if precision.compute == "fp32":
        diff, allowed, what = max_grad_diff(ref_grads, grads), TOLERANCE, "differ by"
    else:
        diff, allowed, what = max_relative_diff(ref_grads, grads), precision.tolerance, "differ (relative) by"
    if not (abs(loss - ref_loss) <= 1e-3 * abs(ref_loss) and diff <= allowed):
        raise AssertionError(f"loss {loss:.6f} vs one device {ref_loss:.6f}; gradients {what} {diff:.1e} "
                             f"(allowed {allowed:.0e}, {precision})")
    return f"loss diff {abs(loss - ref_loss):.1e}, grad diff {diff:.1e}"


def schedule_cut(schedule: str) -> tuple[int, ...]:
    """Where the checks cut CFG's six layers for `schedule`: in two (CUT), or in four stages for a schedule with two
    stages per device (the bench's cut: each device holds as many blocks whichever stages it gets)."""
    from helpers.bench import bench_cut

    return bench_cut(schedule, CFG.n_blocks + 2)


def schedule_label(schedule: str) -> str:
    """How check names spell a schedule: GPipe and 1F1B as their papers do, the others by their catalog names."""
    return {"gpipe": "GPipe", "1f1b": "1F1B"}.get(schedule, schedule)


def _threads(rig: Rig, schedule: str, m: int, reference, precision: Precision = Precision()) -> str:
    """`schedule` at `m` micro-batches on the threaded engine (one thread a device, this process) against one
    device's `reference`, and which kinds of span its timeline recorded."""
    from helpers.pipeline.schedules import layout_for
    from helpers.pipeline.stages import split_model
    from helpers.pipeline.threaded import ThreadedPipeline, stage_devices

    devices = stage_devices(rig.devices, layout_for(schedule, len(rig.devices)))
    split = split_model(build_stack(CFG).to(precision.weights), list(schedule_cut(schedule)), devices)
    x, y = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH)
    pipe = ThreadedPipeline(split, schedule, m, precision=precision)
    loss = pipe.step(x.to(rig.devices[0]), y.to(rig.devices[-1])).item()
    if rig.is_cuda:
        torch.cuda.synchronize()
    kinds = {e.kind for e in pipe.events()}
    return _compare(reference, loss, [p.grad.detach().float().cpu() for p in split.parameters()], precision) + \
        f"; timeline {sorted(kinds)}"


def _processes(rig: Rig, reference, *jobs: dict, compare_as: Precision | None = None) -> str:
    """`jobs` (their fields) as TrainJobs on processes against one device's `reference` (`_run_jobs`)."""
    from helpers.training.job import TrainJob

    return _run_jobs(rig, reference, [TrainJob(CFG, batch=BATCH, timed_steps=1, return_grads=True, **fields)
                                      for fields in jobs], compare_as)


def _run_jobs(rig: Rig, reference, jobs: list, compare_as: Precision | None = None) -> str:
    """`TrainJob`s on processes against one device's `reference`, each to its precision's tolerance (or
    `compare_as`'s: DDP's gradients sent in bf16 round them as bf16 autocast would). Several run in one launch, one
    after the other on the same ranks, as the bench runs them: each job's process groups are destroyed when it ends
    and the next job makes its own (on GPUs, NCCL communicators torn down and made again in the same processes)."""
    from helpers.training.loop import run_trainings

    results = run_trainings(jobs, rig, oversubscribe=rig.is_cpu)
    return "; ".join(_compare(reference, res.loss, res.grads, compare_as or job.precision) +
                     f"; step {res.step_s * 1e3:.1f} ms" for job, res in zip(jobs, results))


def _hf(rig: Rig, strategy: str, engine: str, workdir: str) -> str:
    """A tied GPT-2 (embedding and head on different stages, right-padded batch) through `strategy` on `engine`,
    four Adam steps, against one device doing the same: the path a user's own Hugging Face model takes."""
    from helpers.models.hf import hf_config, save_hf_model
    from helpers.models.layered import Stage, owned_layers
    from helpers.training import train

    model = save_hf_model(hf_config("gpt2", 2, 64, 4, CFG.vocab, CFG.seq_len, tie_embeddings=True),
                          f"{workdir}/gpt2-tied")
    layers = owned_layers(model, range(model.n_layers), rig.devices[0])
    stage = Stage(layers)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3)
    x, y, mask = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab, padding="right").masked_batch(0, BATCH)
    x, y, mask = x.to(rig.devices[0]), y.to(rig.devices[0]), mask.to(rig.devices[0])
    for _ in range(4):
        opt.zero_grad()
        lm_loss(stage(x, model.context(x, mask)), y).backward()
        opt.step()
    out = train(model, strategy, engine, steps=4, batch=BATCH, seq_len=CFG.seq_len, microbatches=4, rig=rig,
                padding="right")
    diff = max((p.detach().cpu() - out.state[i][name]).abs().max().item()
               for i, layer in enumerate(layers) for name, p in layer.named_parameters())
    if not diff <= 1e-4:
        raise AssertionError(f"after 4 Adam steps the weights differ from one device's by {diff:.1e}")
    if not torch.equal(out.state[0]["tok.weight"], out.state[len(layers) - 1]["weight"]):
        raise AssertionError("the tied embedding and head copies drifted apart")
    return f"4 Adam steps, weights within {diff:.1e} of one device's, tied copies identical"


def _generation(rig: Rig, engine: str, workdir: str) -> str:
    """Greedy tokens of a small Llama (grouped-query attention, left-padded prompts) across the rig's devices, equal
    to Hugging Face's generate on one device: the layer split, pipelined requests, or tensor parallelism."""
    from helpers.inference.generate import LayerSplit, OneDevice, make_requests, same_tokens, stages_from_cuts
    from helpers.inference.pipelined import Pipelined
    from helpers.inference.tensor_parallel import run_tensor_parallel
    from helpers.models.hf import hf_config, save_hf_model

    model = save_hf_model(hf_config("llama", 4, 64, 4, CFG.vocab, 64, kv_heads=2), f"{workdir}/llama-{engine}")
    requests = make_requests(2, CFG.vocab, per_request=2, lengths=(3, 9), seed=1)
    reference = OneDevice(model, rig.devices[0]).generate(requests, 6).tokens
    if engine == "tensor parallel":
        tokens = run_tensor_parallel(model, requests, 6, rig, repeats=1, warmup=0).tokens
    else:
        cls = LayerSplit if engine == "layer split" else Pipelined
        tokens = cls(model, stages_from_cuts(model, [3]), rig.devices).generate(requests, 6).tokens
    if not same_tokens(tokens, reference):
        raise AssertionError("greedy tokens differ from generate on one device")
    return f"{sum(t.numel() for t in tokens)} tokens equal to generate on one device"


def _cuda_paths(rig: Rig) -> str:
    """The pieces that only exist on GPUs: CUDA-event spans, the memory panel's NVML and allocator readings."""
    from helpers.sizing.ledger import ledger_for
    from helpers.monitor import MemoryMonitor
    from helpers.timeline import Recorder

    device = rig.devices[0]
    rec = Recorder(0, device)
    a = torch.randn(1024, 1024, device=device)
    with rec.span("forward", 0):
        (a @ a).sum()
    (event,) = rec.events()
    if not event.duration > 0:
        raise AssertionError(f"a CUDA-event span measured {event.duration} s")
    model = build_stack(CFG, device=device)
    readings = MemoryMonitor(rig, ledger_for([model], [rig.labels[0]])).readings()
    return (f"CUDA-event span {event.duration * 1e6:.0f} us; panel: allocated {readings[0].allocated}, "
            f"nvidia-smi {readings[0].nvml if readings[0].nvml is not None else 'N/A'}")


def strategy_job(entry: Strategy, engine: str):
    """The `TrainJob` a parity check runs for a catalog strategy on `engine` (`job_for`: two devices a dimension):
    pipelines at 4 micro-batches (the naive split at one, as it is defined), DP x PP at 2 a replica, each cut as the
    bench cuts it; data parallelism with Adam, whose state ZeRO and FSDP2 shard."""
    from helpers.training.job import job_for

    fields: dict = dict(batch=BATCH, timed_steps=1, return_grads=True)
    if entry.pipeline:
        fields.update(microbatches=2 if entry.data_parallel else 4, boundaries=schedule_cut(entry.schedule))
    else:
        fields["optimizer"] = "adam"
    return job_for(CFG, entry.name, engine, **fields)


def strategy_check_name(job, engine: str) -> str:
    """'threads: 1F1B m=4', 'processes: naive split', 'processes: fsdp2', 'torch: DP x PP 2 x 2, 1F1B'."""
    if job.strategy == "dp_x_pp":
        return f"{engine}: DP x PP {job.dp} x {job.pp}, {schedule_label(job.schedule)}"
    if job.pp == 1:
        return f"{engine}: {job.strategy}"
    return f"{engine}: " + ("naive split" if job.strategy == "naive" else
                            f"{schedule_label(job.schedule)} m={job.microbatches}")


def strategy_checks(rig: Rig, reference: Reference) -> list[tuple[str, str, str, Callable[[], str]]]:
    """(name, strategy, engine, run) for every strategy of the catalog that `train()` runs, on every engine it
    lists: threads in this process, processes (our interpreter, or PyTorch's wrappers for data parallelism) and
    torch.distributed.pipelining."""
    out = []
    for entry in CATALOG:
        for engine in entry.engines:
            job = strategy_job(entry, engine)
            run = (lambda job=job: _threads(rig, job.schedule, job.microbatches, reference())) \
                if engine == "threads" else (lambda job=job: _run_jobs(rig, reference(), [job]))
            out.append((strategy_check_name(job, engine), entry.name, engine, run))
    return out


def variant_checks(rig: Rig, reference: Reference, workdir: str) -> list[tuple[str, str, str, Callable[[], str]]]:
    """(name, strategy, engine, run) for a feature each, on the strategy that shows it (`workdir` holds the models
    they save)."""
    bf16, fp16, bf16_weights = Precision(autocast="bf16"), Precision(autocast="fp16"), Precision(dtype="bf16")
    pipe = dict(pp=2, boundaries=CUT)
    onefoneb = dict(schedule="1f1b", microbatches=4, **pipe)
    return [
        ("processes: GPipe m=4, blocking sends", "gpipe", "processes",
         lambda: _processes(rig, reference(), dict(microbatches=4, overlap=False, **pipe))),
        ("processes: 1F1B, DDP, 1F1B in one launch (each job's groups destroyed as it ends)", "1f1b", "processes",
         lambda: _processes(rig, reference(), onefoneb, dict(dp=2, data_parallel="ddp"), onefoneb)),
        ("threads: 1F1B m=4, bf16 weights", "1f1b", "threads",
         lambda: _threads(rig, "1f1b", 4, reference(bf16_weights), bf16_weights)),
        ("processes: 1F1B m=4, bf16 autocast", "1f1b", "processes",
         lambda: _processes(rig, reference(bf16), dict(autocast="bf16", **onefoneb))),
        ("processes: ZB-V m=4, weight passes two at a time", "zbv", "processes",
         lambda: _processes(rig, reference(), dict(schedule="zbv", pp=2, microbatches=4, batched_weights=2,
                                                   boundaries=schedule_cut("zbv")))),
        ("processes: 1F1B m=4, fp16 autocast + loss scaling", "1f1b", "processes",
         lambda: _processes(rig, reference(fp16), dict(autocast="fp16", **onefoneb))),
        ("processes: ddp, gradients sent in bf16", "ddp", "processes",
         lambda: _processes(rig, reference(), dict(dp=2, wire="bf16", optimizer="adam"), compare_as=bf16)),
        ("processes: ddp, fp16 autocast + loss scaling", "ddp", "processes",
         lambda: _processes(rig, reference(fp16), dict(dp=2, autocast="fp16", optimizer="adam"))),
        ("processes: fsdp2, bf16 MixedPrecisionPolicy", "fsdp2", "processes",
         lambda: _processes(rig, reference(bf16), dict(dp=2, data_parallel="fsdp2", autocast="bf16"))),
        *[(f"Hugging Face tied GPT-2, padded: {strategy} on {engine}", strategy, engine,
           (lambda strategy=strategy, engine=engine: _hf(rig, strategy, engine, workdir)))
          for strategy, engine in (("1f1b", "threads"), ("1f1b", "processes"), ("gpipe", "torch"),
                                   ("fsdp2", "processes"))],
        *[(f"generation: {engine}", "naive", "threads", (lambda engine=engine: _generation(rig, engine, workdir)))
          for engine in ("layer split", "pipelined requests")],
    ]


def plan_checks(rig: Rig, workdir: str) -> list[tuple[str, Support, Callable[[], str]]]:
    """(name, whether this rig can run it, run) for every check (`workdir` holds the models the checks save)."""
    from helpers.inference.tensor_parallel import tensor_parallel_support

    references: dict[Precision, tuple] = {}

    def reference(precision: Precision = Precision()) -> tuple:
        if precision not in references:
            references[precision] = _reference(rig.devices[0], precision)
        return references[precision]

    checks = [(name, support(rig, strategy, engine), fn) for name, strategy, engine, fn in
              strategy_checks(rig, reference) + variant_checks(rig, reference, workdir)]
    checks.append(("generation: tensor parallel", tensor_parallel_support(rig),
                   lambda: _generation(rig, "tensor parallel", workdir)))
    checks.append(("CUDA paths: event timing, memory panel", Support(rig.is_cuda, "no CUDA on this rig: the CPU rig "
                   "times with the wall clock and counts memory itself"), lambda: _cuda_paths(rig)))
    return checks


def parity_checks(rig: Rig, workdir: str, progress: bool = True,
                  wanted: Callable[[str], bool] = lambda name: True) -> list[Check]:
    """Every check of `plan_checks` that `wanted` keeps, run or refused, each printed as it ends."""
    checks = []
    for name, verdict, fn in plan_checks(rig, workdir):
        if not wanted(name):
            continue
        checks.append(run_check(name, verdict, fn))
        if progress:
            print(f"  {checks[-1].status:<8} {name}", flush=True)
    return checks
