"""Every multi-process strategy against one device, the meta-device stage construction, and the refusals."""
from pathlib import Path

import pytest
import torch

from helpers.catalog import BEYOND_1F1B, DATA_PARALLEL, DEEPSPEED, TRAINED, strategy as catalog_entry
from helpers.check import grads_of, max_grad_diff
from helpers.models import StackConfig, StackModel, SyntheticTokens, build_stack, count_params, lm_loss
from helpers.models.layered import boundary_shapes, is_meta, owned_layers
from helpers.partition import proportional_shares
from helpers.pipeline.schedules import make_schedule
from helpers.precision import Precision, max_relative_diff
from helpers.runtime.rig import Rig, cpu_rig
from helpers.training.job import TrainJob, check_job
from helpers.training.loop import run_training
from helpers.sizing.gpus import gpu
from helpers.sizing.state import zero_formula
from helpers.training.support import engines_for, support, support_rows

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
BATCH = 8


@pytest.fixture(scope="module")
def reference():
    model = build_stack(CFG)
    x, y = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), grads_of(model.parameters()), count_params(model)


FULL = pytest.mark.full  # the full tier (pytest --full): the fast tier keeps one run of each engine and strategy
PIPELINES = [pytest.param(dict(schedule="gpipe", microbatches=1), marks=FULL),  # the naive split, one process each
             pytest.param(dict(schedule="gpipe", microbatches=4, overlap=False), marks=FULL),
             dict(schedule="gpipe", microbatches=4),
             dict(schedule="1f1b", microbatches=4),
             pytest.param(dict(schedule="1f1b", microbatches=4, overlap=False), marks=FULL),  # no longer deadlocks
             pytest.param(dict(schedule="gpipe", microbatches=4, engine="torch"), marks=FULL),
             dict(schedule="1f1b", microbatches=4, engine="torch")]


@pytest.mark.parametrize("kw", PIPELINES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_pipelines_equal_one_device(kw, reference):
    loss, grads, _ = reference
    res = run_training(TrainJob(CFG, pp=2, boundaries=(3,), batch=BATCH, timed_steps=1, return_grads=True, **kw),
                       cpu_rig())
    assert abs(res.loss - loss) < 1e-5
    assert max_grad_diff(grads, res.grads) <= 1e-5
    assert {e.device for e in res.events} == {0, 1}
    assert sum(e.kind == "forward" for e in res.events) == 2 * kw["microbatches"]
    # every timed step's forward and backward seconds, both ranks together (the bench's drift columns)
    assert len(res.phase_times) == len(res.step_times) == 1
    assert 0 < res.phase_times[0]["forward"] < res.step_times[0] * 2
    assert res.recorded_step_s > 0  # the recorded step is timed too (one more sample of the step: the bench's)
    assert all(p > 0 for p in res.peak_activations)
    if kw.get("overlap", True):
        assert not any(e.kind == "send" for e in res.events), "overlapped sends never block"


@FULL
@pytest.mark.parametrize("engine", ["ours", "torch"])
@pytest.mark.parametrize("schedule", BEYOND_1F1B)
def test_pipelines_past_1f1b_equal_one_device(schedule, engine, reference):
    """Two stages per device (interleaved, the V shapes: four stages of one block stack) or a split backward (ZB-H1,
    ZB-V, DualPipeV's ramps), ours and torch.distributed.pipelining's, one process per device: one device's loss and
    gradients; the weight passes on the timeline."""
    loss, grads, _ = reference
    res = run_training(TrainJob(CFG, pp=2, schedule=schedule, microbatches=4, batch=BATCH, timed_steps=1, engine=engine,
                                return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-5
    assert max_grad_diff(grads, res.grads) <= 1e-5
    chunks = catalog_entry(schedule).chunks
    assert sum(e.kind == "forward" for e in res.events) == 2 * chunks * 4
    assert {e.stage for e in res.events if e.kind == "forward"} == set(range(2 * chunks))
    assert (schedule == "interleaved") == (not any(e.kind == "weight" for e in res.events))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_batched_weight_passes_on_processes_equal_one_device(schedule, reference):
    """Our engine with weight passes two micro-batches at a time (each linear layer's weight gradient one product
    over their rows): one device's loss and gradients, fewer weight spans than weight passes."""
    loss, grads, _ = reference
    res = run_training(TrainJob(CFG, schedule, microbatches=4, batch=BATCH, timed_steps=1, batched_weights=2,
                                return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-5
    assert max_grad_diff(grads, res.grads) <= 1e-5
    spans = sum(e.kind == "weight" for e in res.events)
    passes = sum(a.kind == "W" for actions in make_schedule(schedule, 2, 4) for a in actions)
    assert 0 < spans < passes


@FULL
def test_jobs_launched_together_equal_one_device(reference):
    """`run_trainings`: several jobs on the same two ranks, one after the other (one start-up for a comparison)."""
    from helpers.training.loop import run_trainings

    loss, grads, _ = reference
    jobs = [TrainJob(CFG, pp=2, schedule=s, microbatches=4, batch=BATCH, timed_steps=1, engine=e, return_grads=True)
            for s, e in (("1f1b", "ours"), ("zbv", "torch"))]
    results = run_trainings(jobs, cpu_rig())
    assert [r.loss for r in results] == pytest.approx([loss, loss], abs=1e-5)
    assert all(max_grad_diff(grads, r.grads) <= 1e-5 for r in results)
    with pytest.raises(ValueError, match="one world size"):
        run_trainings([jobs[0], TrainJob(CFG, dp=2, pp=2, schedule="1f1b", microbatches=2, batch=BATCH)], cpu_rig())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_jobs_launched_together_leave_no_process_group_behind():
    """A job's groups (its mesh's, its tied weights') are destroyed when it ends: before, every job of one launch left
    its groups and their gloo threads standing (3 a job: 99 threads in a rank after the bench's 31-job launch)."""
    from helpers.runtime.launch import run
    from tests.workers import threads_after_each_job

    jobs = [TrainJob(CFG, pp=2, schedule="1f1b", microbatches=2, batch=BATCH, timed_steps=1, engine=e)
            for e in ("ours", "torch", "ours")] + [TrainJob(CFG, dp=2, batch=BATCH, timed_steps=1)]
    for counts in run(threads_after_each_job, jobs, rig=cpu_rig()):
        assert len(set(counts)) == 1, f"the rank's threads grew job by job: {counts}"


@FULL
def test_three_stages_on_two_cores_with_oversubscribe(reference):
    loss, grads, _ = reference
    job = TrainJob(CFG, pp=3, boundaries=(2, 4), schedule="1f1b", microbatches=4, batch=BATCH, timed_steps=1,
                   return_grads=True)
    with pytest.raises(ValueError, match="oversubscribe=True"):
        run_training(job, _two_core_rig())
    res = run_training(job, _two_core_rig(), oversubscribe=True)
    assert abs(res.loss - loss) < 1e-5 and max_grad_diff(grads, res.grads) <= 1e-5


def _two_core_rig() -> Rig:
    """The CPU rig as a 2-core laptop sees it, whatever this machine has."""
    from dataclasses import replace

    return replace(cpu_rig(threads=1), max_ranks=2)


@FULL
def test_bf16_wire_trains_close_to_fp32(reference):
    loss, grads, _ = reference
    res = run_training(TrainJob(CFG, pp=2, boundaries=(3,), microbatches=2, batch=BATCH, wire="bf16", timed_steps=1,
                                return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-2
    assert 0 < max_grad_diff(grads, res.grads) < 1e-2  # rounded, not exact


def test_ddp_gradients_sent_in_bf16_stay_close_to_one_device(reference):
    """wire="bf16" on DDP: each gradient bucket crosses the link in bf16 (PyTorch's bf16_compress_hook, on gloo too)
    and comes back into the fp32 gradients: one device's gradients to bf16's rounding; FSDP2 refuses it."""
    loss, grads, _ = reference
    res = run_training(TrainJob(CFG, dp=2, batch=BATCH, wire="bf16", timed_steps=1, return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-5  # the first step's loss: before any reduced gradient is used
    scale = max(g.abs().max().item() for g in grads)
    assert 0 < max_grad_diff(grads, res.grads) <= Precision(autocast="bf16").tolerance * scale
    assert all(g.dtype == torch.float32 for g in res.grads)
    with pytest.raises(ValueError, match="reduce_dtype"):
        check_job(TrainJob(CFG, dp=2, data_parallel="fsdp2", batch=BATCH, wire="bf16"), cpu_rig())
    with pytest.raises(ValueError, match="gradient buckets cross the link"):  # before any process starts
        check_job(TrainJob(CFG, dp=2, batch=BATCH, wire="int8"), cpu_rig())
    with pytest.raises(ValueError, match="flushes small gradients to zero unless the loss is scaled"):
        check_job(TrainJob(CFG, dp=2, batch=BATCH, wire="fp16"), cpu_rig())
    check_job(TrainJob(CFG, dp=2, batch=BATCH, wire="fp16", autocast="fp16"), cpu_rig())  # its scaler scales them


@pytest.mark.parametrize("strategy", [s for s in DATA_PARALLEL if s not in DEEPSPEED])  # tests/test_deepspeed.py
def test_data_parallel_equals_one_device_and_matches_zero_formulas(strategy, reference):
    loss, grads, n = reference
    res = run_training(TrainJob(CFG, dp=2, data_parallel=strategy, batch=BATCH, timed_steps=1, return_grads=True,
                                optimizer="adam"), cpu_rig())
    assert abs(res.loss - loss) < 1e-5
    assert max_grad_diff(grads, res.grads) <= 1e-5
    formula = zero_formula(strategy, n, 2)
    for mem in res.memory:  # measured at rest, after a step
        assert mem.grads == formula.grads
        expected_params = n * 4 // 2 if catalog_entry(strategy).fully_sharded else n * 4  # FSDP2 keeps shards at rest
        assert mem.params == expected_params
    # ZeroRedundancyOptimizer shards whole tensors: the shards add up to the state, each close to half of it
    world_opt = sum(m.optimizer for m in res.memory)
    expected = formula.optimizer * (1 if strategy == "ddp" else 2)
    assert 0 <= world_opt - expected * (2 if strategy == "ddp" else 1) <= 2 * 8 * len(grads)
    if strategy in ("ddp", "zero1"):
        assert any(e.kind == "allreduce" for e in res.events), "DDP buckets appear on the timeline"


@FULL
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_gradient_accumulation_equals_one_device(strategy, reference):
    loss, grads, _ = reference
    res = run_training(TrainJob(CFG, dp=2, data_parallel=strategy, microbatches=2, batch=BATCH, timed_steps=1,
                                return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-5 and max_grad_diff(grads, res.grads) <= 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_unequal_replica_batches_equal_one_device(strategy, reference):
    """A faster card takes a larger share of the global batch (proportional_shares): the loss is normalised by the
    global batch's tokens, so gradients still equal one device's on the same global batch (DDP and FSDP2 average over
    replicas; each rank's loss is scaled to undo it)."""
    loss, grads, _ = reference
    shares = proportional_shares(BATCH, [1.0, 2.0], unit=2)
    assert shares[0] < shares[1]
    res = run_training(TrainJob(CFG, dp=2, data_parallel=strategy, microbatches=2, batch=BATCH, shares=shares,
                                timed_steps=1, return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-5 and max_grad_diff(grads, res.grads) <= 1e-5


def test_an_emulated_slower_rank_computes_the_same_gradients(reference):
    """slowdown= stretches rank 1's compute spans (a card half as fast), nothing else: one device's gradients."""
    loss, grads, _ = reference
    res = run_training(TrainJob(CFG, "1f1b", microbatches=2, batch=BATCH, slowdown=(1.0, 2.0), timed_steps=1,
                                return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-5 and max_grad_diff(grads, res.grads) <= 1e-5
    with pytest.raises(ValueError, match="2 factors >= 1"):
        check_job(TrainJob(CFG, "1f1b", microbatches=2, batch=BATCH, slowdown=(2.0,)), cpu_rig())


@pytest.mark.parametrize("fields, msg", [({"shares": (4, 2)}, "add up to 6"), ({"shares": (BATCH,)}, "give 2"),
                                         ({"shares": (3, BATCH - 3), "microbatches": 2}, "divide into 2"),
                                         ({"shares": (4, BATCH - 4), "pp": 2, "dp": 1}, "dp >= 2 and pp = 1")])
def test_bad_shares_are_refused_before_launch(fields, msg):
    fields = {"dp": 2, **fields}
    with pytest.raises(ValueError, match=msg):
        check_job(TrainJob(CFG, batch=BATCH, **fields), cpu_rig())


def test_dp_x_pp_on_a_2x2_mesh_equals_one_device(reference):
    loss, grads, _ = reference
    res = run_training(TrainJob(CFG, dp=2, pp=2, schedule="1f1b", microbatches=2, batch=BATCH, timed_steps=1,
                                return_grads=True), cpu_rig(), oversubscribe=True)
    assert abs(res.loss - loss) < 1e-5
    assert max_grad_diff(grads, res.grads) <= 1e-5
    assert len(res.peak_activations) == 4


def test_a_rank_materialises_only_its_own_layers():
    """Layers a rank does not own stay on the meta device: using one by mistake fails on the CPU rig, as it
    would on a GPU (the old engine ran them on the CPU to find shapes: a device mismatch on every CUDA rig)."""
    model = StackModel(CFG)
    layers = owned_layers(model, range(3, 6), torch.device("cpu"))
    reference = build_stack(CFG)
    assert [is_meta(l) for l in layers] == [True, True, True, False, False, False]
    for i in range(3, 6):
        for a, b in zip(layers[i].parameters(), reference[i].parameters()):
            assert torch.equal(a, b), "the owned layers carry exactly one device's weights"
    x, _ = SyntheticTokens(2, CFG.seq_len, CFG.vocab).batch(0, 2)
    with pytest.raises((RuntimeError, NotImplementedError)):
        h = x
        for layer in layers:  # the accidental use: run the whole model on real data
            h = layer(h)
        h.sum().item()
    assert boundary_shapes(model, [3], 4, CFG.seq_len) == [((4, CFG.seq_len, CFG.hidden), torch.float32)]


@pytest.mark.parametrize("job, msg", [
    (TrainJob(CFG, pp=2, batch=30, microbatches=4), "global batch 30 is not divisible by 4 micro-batches"),
    (TrainJob(CFG, dp=2, batch=12, microbatches=4),
     r"each replica's batch 6 \(global 12 over 2 replicas\) is not divisible by 4 micro-batches"),
    (TrainJob(CFG, pp=2, schedule="1f1b", microbatches=1, batch=8), "m=1 < p=2"),
    (TrainJob(CFG, pp=2, wire="int8"), "cannot send activations as int8"),
    (TrainJob(CFG, pp=2, boundaries=(9,)), "split point 9 is outside"),
    (TrainJob(CFG, pp=3, boundaries=(3,)), "1 boundaries give 2 stages, but pp=3"),
    (TrainJob(CFG, pp=2, engine="torch", wire="bf16"), "use wire='auto'"),
    (TrainJob(CFG, dp=2, batch=9), "global batch 9 is not divisible by the data-parallel size 2"),
    (TrainJob(CFG, dp=2, data_parallel="zero9"), "unknown data-parallel strategy"),
    (TrainJob(CFG, dp=2, pp=2, data_parallel="fsdp2"), "DP x PP here averages"),
    (TrainJob(CFG, microbatches=0), "microbatches must be a whole number >= 1"),
    (TrainJob(CFG, batch=0), "batch must be a whole number >= 1"),
    (TrainJob(CFG, timed_steps=0), "steps must be a whole number >= 1"),
    (TrainJob(CFG, optimizer="lion"), "unknown optimizer"),
    (TrainJob(CFG, dp=2, pp=2, batch=8), "oversubscribe=True"),
    (TrainJob(CFG, "zbv", microbatches=4, engine="torch", batched_weights=2), "engine='ours'"),
    (TrainJob(CFG, "1f1b", microbatches=4, batched_weights=2), "has none with 4 micro-batches"),
    (TrainJob(CFG, "zbv", microbatches=4, batched_weights=0), "batched_weights=0"),
    (TrainJob(CFG, "ddp", batched_weights=2), "runs no pipeline"),
])
def test_bad_jobs_are_refused_before_spawning(job, msg):
    with pytest.raises(ValueError, match=msg):
        check_job(job, _two_core_rig())


def test_ddp_of_a_model_too_big_points_to_sharding():
    from dataclasses import replace

    small = replace(cpu_rig(), capacity_bytes=(1000, 1000))
    with pytest.raises(ValueError, match="Shard it .* or split it into pipeline stages"):
        check_job(TrainJob(CFG, dp=2), small)
    check_job(TrainJob(CFG, dp=2, data_parallel="fsdp2"), small)  # sharding is the way out, not refused


def _gpu_rig(kind: str, n: int) -> Rig:
    """A GPU rig described without touching CUDA: what `detect_rig` returns on such a machine."""
    dev = [torch.device(f"cuda:{i}") for i in range(n)] if kind == "two_gpus" else [torch.device("cuda:0")] * 2
    return Rig(kind=kind, devices=tuple(dev), names=("NVIDIA GeForce RTX 3090",) * len(dev),
               capacity_bytes=(gpu("RTX 3090").capacity_bytes,) * len(dev), backend="nccl" if kind == "two_gpus" else "gloo",
               max_ranks=n if kind == "two_gpus" else 2)


def test_every_rig_strategy_engine_works_or_says_why():
    rigs = {"cpu": _two_core_rig(), "one GPU": _gpu_rig("one_gpu", 1), "two GPUs": _gpu_rig("two_gpus", 2)}
    rows = support_rows(rigs)
    assert len(rows) == sum(len(engines_for(s)) for s in TRAINED)
    refused = {name: {(r["strategy"], r["engine"]) for r in rows if r[name].startswith("no: ")} for name in rigs}
    torch_pipelines = {(s, "torch") for s in ("gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev")}
    four_ranks = {("dp_x_pp", "processes"), ("dp_x_pp", "torch")}
    deepspeed = {(s, "processes") for s in DEEPSPEED}
    assert refused == {"cpu": set(), "one GPU": torch_pipelines | {("zero2", "processes"), ("fsdp2", "processes")}
                       | deepspeed | four_ranks, "two GPUs": four_ranks}
    for row in rows:
        for name in rigs:
            verdict, _, reason = row[name].partition(": ")
            assert verdict in ("yes", "yes*", "no") and (verdict == "no") == bool(reason), row
            assert verdict != "no" or len(reason.split()) >= 5, row  # a refusal says why, in words
    assert {(r["strategy"], r["engine"]) for r in rows if r["cpu"] == "yes*"} == four_ranks  # 4 ranks on 2 cores
    assert not support(rigs["one GPU"], "gpipe", "torch").ok
    assert "stages them through host memory" in support(rigs["one GPU"], "gpipe", "torch").reason
    assert not support(rigs["one GPU"], "fsdp2", "processes").ok
    assert support(rigs["one GPU"], "ddp", "processes").ok
    assert not support(rigs["two GPUs"], "dp_x_pp", "processes").ok
    assert support(rigs["cpu"], "dp_x_pp", "processes").ok
    with pytest.raises(ValueError, match="cannot run here: .*gloo cannot carry CUDA tensors"):
        check_job(TrainJob(CFG, pp=2, engine="torch", microbatches=2), rigs["one GPU"])
    with pytest.raises(ValueError, match="need 4 GPUs"):
        check_job(TrainJob(CFG, dp=2, pp=2), rigs["two GPUs"])


def _reference_with(precision, padding="none"):
    """One device, same data, same precision: the loss and fp32 gradients every engine is compared with."""
    model = build_stack(CFG).to(precision.weights)
    x, y, _ = SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab, padding=padding).masked_batch(0, BATCH)
    with precision.context(torch.device("cpu")):
        loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.float() for p in model.parameters()]


PADDED = [dict(padding="right", pp=2, boundaries=(3,), microbatches=4),
          dict(padding="left", dp=2, microbatches=2),
          dict(padding="right", dp=2, pp=2, schedule="1f1b", microbatches=2)]


@FULL
@pytest.mark.parametrize("kw", PADDED, ids=["pipeline", "ddp-accumulation", "dp-x-pp"])
def test_padded_batches_give_one_devices_loss(kw):
    """Micro-batches and replicas hold different numbers of real tokens: the loss is weighted by tokens, not by
    micro-batch (a mean of micro-batch means would be off by ~1e-2 here)."""
    loss, grads = _reference_with(Precision(), kw["padding"])
    res = run_training(TrainJob(CFG, batch=BATCH, timed_steps=1, return_grads=True, **kw), cpu_rig(),
                       oversubscribe=True)
    assert abs(res.loss - loss) < 1e-5 and max_grad_diff(grads, res.grads) <= 1e-5


# Tolerances (relative to each gradient tensor's largest entry): bf16 keeps 8 mantissa bits, so regrouping the
# same products into micro-batches or shards moves gradients by ~1e-2; fp16 keeps 11 bits: ~1e-3. FSDP2's
# MixedPrecisionPolicy casts every parameter (norms included), not only autocast's matmuls: bf16 up to ~2e-2.
PRECISIONS = [dict(autocast="bf16", pp=2, boundaries=(3,), microbatches=4),
              dict(autocast="bf16", pp=2, boundaries=(3,), microbatches=4, engine="torch"),
              dict(autocast="bf16", dp=2),
              dict(autocast="bf16", dp=2, data_parallel="fsdp2"),
              dict(autocast="fp16", pp=2, boundaries=(3,), microbatches=4, optimizer="adam"),
              dict(autocast="fp16", dp=2, data_parallel="zero1", optimizer="adam"),
              dict(dtype="bf16", pp=2, boundaries=(3,), microbatches=4),
              dict(dtype="bf16", dp=2, data_parallel="zero2")]


@FULL
@pytest.mark.parametrize("kw", PRECISIONS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_mixed_precision_in_every_strategy_stays_close_to_one_device(kw):
    job = TrainJob(CFG, batch=BATCH, timed_steps=2, return_grads=True, **kw)
    loss, grads = _reference_with(job.precision)
    res = run_training(job, cpu_rig())
    assert abs(res.loss - loss) < 1e-3 * abs(loss)
    assert max_relative_diff(grads, res.grads) <= job.precision.tolerance
    if job.optimizer == "adam":  # fp16 with loss scaling trains: every rank took (or skipped) the same steps
        assert res.losses[-1] < res.losses[0]


def test_a_ranks_slice_of_token_windows_is_its_own_tensor():
    """On the CPU rig `.to(device)` returns the very tensor: a replica's slice of the token windows must still be
    copied, or the ledger counts the whole corpus among the activations when an embedding that trains saves its
    input ids."""
    from helpers.training.loop import _replica_batch

    rows = torch.randint(0, 64, (100, 17))
    job = TrainJob(StackConfig(vocab=64, seq_len=16), dp=2, data_parallel="fsdp2", batch=8, microbatches=2)
    batch = _replica_batch(job, 1, torch.device("cpu"), 3, rows)
    for mb in batch.microbatches:
        assert mb.inputs.untyped_storage().nbytes() == mb.targets.untyped_storage().nbytes() == 4 * 16 * 8


def test_ddp_gradients_are_views_of_its_buckets():
    """apply_ddp asks DDP for gradients that are views of its communication buckets: no copy of every gradient
    into a bucket before the all-reduce and back after it (on the CPU rig they cost about 5% of a rank's CPU
    seconds per step of the bench's DDP row, measured with thread_time), and the averaged buckets are the grads."""
    import torch.distributed as dist

    from helpers.timeline import Recorder
    from helpers.training.strategies import apply_ddp

    store = dist.HashStore()
    group_existed = dist.is_initialized()
    if not group_existed:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = build_stack(CFG)
        ddp = apply_ddp(model, dist.group.WORLD, torch.device("cpu"), 25.0, Recorder(0))
        x, y = SyntheticTokens(2, CFG.seq_len, CFG.vocab).batch(0, 2)
        lm_loss(ddp(x), y).backward()
        reference = build_stack(CFG)
        lm_loss(reference(x), y).backward()
        assert ddp.gradient_as_bucket_view
        assert max_grad_diff(grads_of(reference.parameters()), grads_of(model.parameters())) <= 1e-6
    finally:
        if not group_existed:
            dist.destroy_process_group()


def test_activation_checkpointing_is_named_apart_from_training_checkpoints_and_the_old_name_still_works():
    """`activation_checkpointing` (recompute in backward) and `checkpoint` (training state on disk) are two words;
    the old `checkpointing=` keyword, flag and module keep working for a release, with a DeprecationWarning."""
    import importlib
    import sys

    from helpers.training.api import job_fields
    from helpers.training.job import job_for

    with pytest.warns(DeprecationWarning, match="activation_checkpointing"):
        job = job_for(CFG, "ddp", checkpointing=True)
    assert job.activation_checkpointing is True
    with pytest.warns(DeprecationWarning):
        assert job.checkpointing is True
    with pytest.raises(TypeError, match="activation_checkpointing= only"):
        job_fields({"checkpointing": True, "activation_checkpointing": False})
    with pytest.raises(TypeError, match="unknown option.*'lr'"):  # refused with the fields a job has
        job_fields({"learning_rate": 0.1})
    with pytest.raises(TypeError, match="unknown option.*'max_chars'"):  # train's strategy argument sets it
        job_fields({"strategy": "ddp"})
    sys.modules.pop("helpers.checkpointing", None)
    with pytest.warns(DeprecationWarning, match="helpers.activation_checkpointing"):
        old = importlib.import_module("helpers.checkpointing")
    from helpers.activation_checkpointing import checkpoint_layers
    assert old.checkpoint_layers is checkpoint_layers
    sys.modules.pop("helpers.simulate.hardware", None)  # moved a floor down, to helpers.hardware
    with pytest.warns(DeprecationWarning, match="helpers.hardware"):
        moved = importlib.import_module("helpers.simulate.hardware")
    from helpers.hardware import Link
    assert moved.Link is Link


def test_the_scripts_and_the_planner_take_the_new_flag_and_the_old_one():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from _common import parse
    finally:
        sys.path.pop(0)
    argv = sys.argv
    for flag in ("--activation-checkpointing", "--checkpointing"):
        sys.argv = ["finetune_lora.py", "--model", "m", flag]
        try:
            assert parse("x", lora=True).activation_checkpointing is True
        finally:
            sys.argv = argv
    from helpers.plan import _parser
    for flag, value in (("--activation-checkpointing", True), ("--no-checkpointing", False)):
        assert _parser().parse_args(["--train", "--model", "llama-2-7b", flag]).activation_checkpointing is value
    for flag in ("--microbatches", "--grad-accum"):
        assert _parser().parse_args(["--train", "--model", "llama-2-7b", flag, "3"]).microbatches == 3


@pytest.mark.parametrize("name", TRAINED)
def test_a_job_is_keyed_by_the_catalogs_strategy_name(name):
    """TrainJob(model, name) fills the layout the catalog's entry implies, and the layout names it back: one job,
    whether a learner names the strategy or spells out dp, pp, data_parallel and schedule."""
    entry = catalog_entry(name)
    m = 1 if name == "naive" else 4
    job = TrainJob(CFG, name, microbatches=m, batch=8)
    assert job.strategy == name
    assert (job.pp > 1, job.dp > 1) == (entry.pipeline, entry.data_parallel)
    spelled = TrainJob(CFG, dp=job.dp, pp=job.pp, data_parallel=job.data_parallel, schedule=job.schedule,
                       microbatches=m, batch=8)
    assert spelled == job and spelled.strategy == name
    wrong = {"pp": 1} if entry.pipeline else {"pp": 2}
    with pytest.raises(ValueError, match=f"strategy '{name}' runs on|{name} has no pipeline"):
        TrainJob(CFG, name, microbatches=m, batch=8, **wrong)


def test_a_job_refuses_a_layout_that_names_another_strategy():
    with pytest.raises(ValueError, match="runs data_parallel='fsdp2', not 'ddp'"):
        TrainJob(CFG, "fsdp2", data_parallel="ddp")
    with pytest.raises(ValueError, match="runs schedule='1f1b', not 'gpipe'"):
        TrainJob(CFG, "1f1b", schedule="gpipe", microbatches=2)
    with pytest.raises(ValueError, match="one-device reference|runs on one device"):
        TrainJob(CFG, "single")
    assert TrainJob(CFG, "dp_x_pp", schedule="gpipe", microbatches=2).schedule == "gpipe"  # any schedule inside
