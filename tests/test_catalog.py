"""The catalog (helpers.catalog) walked entry by entry: every list of the library derives from it, so a schedule or
strategy added there is generated, laid out, supported, simulated, labelled and trained, or these tests say where
it is missing."""
import pytest
from torch.distributed import pipelining

from helpers.catalog import (BEYOND_1F1B, CATALOG, DATA_PARALLEL, PIPELINES, TRAINED, names, schedules,
                             strategy as catalog_entry)
from helpers.check import max_grad_diff, one_device_grads
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.pipeline.schedules import LAYOUTS, SCHEDULES, layout_for, layout_of, make_schedule, validate
from helpers.runtime.rig import cpu_rig
from helpers.simulate import Job, Link, Workload, simulate
from helpers.training.job import check_job, job_for
from helpers.training.support import reference_rigs, support_markdown, support_rows

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
BATCH = 8
PAIRS = [(e.name, engine) for e in CATALOG for engine in e.engines]


def test_names_are_unique_and_kinds_partition_the_catalog():
    assert len(names()) == len(set(names())) == len(CATALOG)
    assert set(PIPELINES) | set(DATA_PARALLEL) | {"single", "dp_x_pp"} == set(names())
    assert TRAINED == tuple(n for n in names() if n != "single")
    with pytest.raises(ValueError, match="unknown strategy 'zero3'; choose one of single, naive"):
        catalog_entry("zero3")


@pytest.mark.parametrize("entry", schedules(), ids=lambda e: e.name)
def test_every_schedule_has_a_generator_its_layout_and_torchs_class(entry):
    """The generator registered under the name builds valid action lists laid out as the catalog says, and
    torch.distributed.pipelining has the class the torch engine runs."""
    assert entry.name in SCHEDULES and LAYOUTS[entry.name] == (entry.chunks, entry.shape)
    p = 2
    m = 2 * p * entry.chunks  # enough micro-batches for every schedule (ZB-V and DualPipeV need 2p - 1 and 2p)
    actions = make_schedule(entry.name, p, m)
    validate(actions, m)
    assert layout_of(actions) == layout_for(entry.name, p)
    assert issubclass(getattr(pipelining, entry.torch_class), pipelining.schedules._PipelineSchedule)


def test_generators_and_catalog_name_the_same_schedules():
    assert set(SCHEDULES) == {e.name for e in schedules()} == set(LAYOUTS)
    assert {e.schedule for e in CATALOG if e.schedule} <= set(SCHEDULES)
    assert set(BEYOND_1F1B) <= set(SCHEDULES)


def test_support_matrix_and_readme_list_every_strategy_and_engine():
    rows = support_rows(reference_rigs())
    assert [(r["strategy"], r["engine"]) for r in rows] == PAIRS
    table = support_markdown()
    for name, engine in PAIRS:
        assert f"| {name} | {engine} |" in table


@pytest.mark.parametrize("entry", CATALOG, ids=lambda e: e.name)
def test_every_entry_is_simulated_and_labelled(entry):
    work = Workload.from_lists([1e-3] * 4, [2e-3] * 4, params=[1000] * 4, activations=[100.0] * 4,
                               output=[10.0] * 4)
    m = 1 if entry.name == "naive" else 4
    job = Job(entry.name, batch=8, microbatches=m)
    sim = simulate(work, job)
    assert sim.step_s > 0 and job.label().startswith(entry.label)
    assert len(sim.memory) == job.world == (2 if entry.pipeline else 1) * (2 if entry.data_parallel else 1)


def test_zero2_is_fsdp2_keeping_the_gathered_weights():
    """The simulator's zero2 is FSDP2 with reshard_after_forward=False: fewer all-gathers, the whole model gathered
    at the peak."""
    work, link = Workload.from_lists([1e-3] * 4, [2e-3] * 4, params=[1000] * 4), Link(1e-3, 1e6)
    zero2, fsdp2 = simulate(work, Job("zero2", batch=2), link), simulate(work, Job("fsdp2", batch=2), link)
    assert zero2.step_s < fsdp2.step_s
    assert zero2.memory[0].params > fsdp2.memory[0].params


@pytest.mark.parametrize("name, engine", PAIRS)
def test_every_strategy_and_engine_makes_a_job_that_names_it(name, engine):
    job = job_for(CFG, name, engine, batch=BATCH, microbatches=2 if catalog_entry(name).data_parallel else 4)
    assert job.strategy == name
    check_job(job, cpu_rig(), oversubscribe=True)
    sim = Job.from_train_job(job)  # the simulator reads the training job, by the same names
    assert (sim.strategy, sim.pp, sim.dp, sim.world, sim.microbatches, sim.batch) == \
        (name, job.pp, job.dp, job.world, job.microbatches, job.batch)
    assert sim.layout == job.layout and (sim.boundaries or ()) == job.cut()


def test_the_simulator_and_the_training_job_speak_one_vocabulary():
    """One name for each idea: the simulator's Job and TrainJob share theirs (and the old ones are gone)."""
    from dataclasses import fields

    from helpers.training.job import TrainJob

    shared = {"batch", "microbatches", "pp", "dp", "boundaries", "activation_checkpointing", "schedule", "bucket_mb"}
    assert shared <= {f.name for f in fields(Job)} & {f.name for f in fields(TrainJob)}
    assert not {"stages", "replicas", "cut", "checkpoint", "checkpointing"} & {f.name for f in fields(Job)}
    assert Job("ddp", batch=4).world == TrainJob(CFG, dp=2).world == 2


def test_unknown_choices_are_refused_with_the_catalogs_words():
    with pytest.raises(ValueError, match="unknown strategy 'pipedream'"):
        job_for(CFG, "pipedream")
    with pytest.raises(ValueError, match="ddp runs with engine processes, not 'torch'"):
        job_for(CFG, "ddp", "torch")
    with pytest.raises(ValueError, match="one-device reference"):
        job_for(CFG, "single")


@pytest.mark.full
def test_every_strategy_and_engine_trains_like_one_device():
    """Every multi-process entry of the catalog, on every engine it lists, computes one device's loss and gradients
    (jobs of one world size share one launch; the threaded engine runs every schedule in
    tests/test_schedules_engine.py)."""
    from helpers.training.loop import run_trainings

    loss, grads = one_device_grads(build_stack(CFG), *SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab).batch(0, BATCH),
                                   lm_loss)
    jobs = [job_for(CFG, name, engine, batch=BATCH, microbatches=2 if catalog_entry(name).data_parallel else 4,
                    timed_steps=1, return_grads=True) for name, engine in PAIRS if engine != "threads"]
    for world in sorted({job.world for job in jobs}):
        batch = [job for job in jobs if job.world == world]
        for job, res in zip(batch, run_trainings(batch, cpu_rig(), oversubscribe=True)):
            assert abs(res.loss - loss) < 1e-5, job.strategy
            assert max_grad_diff(grads, res.grads) <= 1e-5, job.strategy


def test_every_strategy_the_cpu_rig_runs_reaches_the_doctor_and_the_bench():
    """The doctor's checks and the bench's rows derive from the catalog and the support matrix, by construction:
    every strategy and engine the CPU rig supports has a parity check of the doctor and a row of the bench's
    --precise run (threads: a pipeline timed in the bench's process; processes and torch: a job). The lists are
    computed; nothing runs."""
    from helpers.bench.jobs import bench_engine, bench_jobs, default_config, threaded_pipelines
    from helpers.doctor.engines import plan_checks, strategy_checks
    from helpers.training.support import support

    rig = cpu_rig()
    supported = {(name, engine) for name, engine in PAIRS if support(rig, name, engine).ok}
    assert supported == set(PAIRS)  # the CPU rig runs every pair (4 ranks oversubscribed)
    doctor = {(name, engine): check for check, name, engine, _ in strategy_checks(rig, reference=None)}
    assert set(doctor) == supported
    assert set(doctor.values()) <= {name for name, _, _ in plan_checks(rig, "unused")}
    config = default_config("precise", rig)
    bench = {(entry.name, "threads") for entry, _ in threaded_pipelines(config)}
    bench |= {(job.strategy, bench_engine(job)) for job in bench_jobs(config, rig)}
    assert bench == supported
