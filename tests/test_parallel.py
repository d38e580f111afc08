import pytest

from helpers.check import grads_of, max_grad_diff
from helpers.models import StackConfig, SyntheticTokens, build_stack, count_params, lm_loss
from helpers.parallel import (DPJob, HybridJob, check_dp_job, check_hybrid_job, run_data_parallel, run_dp_x_pp,
                              shardable_children, zero_formula)
from helpers.runtime.rig import cpu_rig

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)


@pytest.fixture(scope="module")
def reference():
    model = build_stack(CFG)
    x, y = SyntheticTokens(8, CFG.seq_len, CFG.vocab).batch(0, 8)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), grads_of(model.parameters()), count_params(model)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp2"])
def test_data_parallel_equals_one_device_and_matches_zero_formulas(strategy, reference):
    loss, grads, n = reference
    res = run_data_parallel(DPJob(strategy, CFG, batch=8, steps=1, return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-5
    assert max_grad_diff(grads, res.grads) <= 1e-5
    formula = zero_formula(strategy, n, 2)
    for mem in res.memory:  # measured at rest, after a step
        assert mem.grads == formula.grads
        expected_params = n * 4 // 2 if strategy in ("zero2", "fsdp2") else n * 4  # FSDP2 keeps shards at rest
        assert mem.params == expected_params
    # ZeroRedundancyOptimizer shards whole tensors: the shards add up to the state, each close to half of it
    world_opt = sum(m.optimizer for m in res.memory)
    expected = formula.optimizer * (1 if strategy == "ddp" else 2)
    assert 0 <= world_opt - expected * (2 if strategy == "ddp" else 1) <= 2 * 8 * len(grads)
    if strategy in ("ddp", "zero1"):
        assert any(e.kind == "allreduce" for e in res.events), "DDP buckets appear on the timeline"


def test_dp_x_pp_on_a_2x2_mesh_equals_one_device(reference):
    loss, grads, _ = reference
    res = run_dp_x_pp(HybridJob(CFG, dp=2, pp=2, batch=8, microbatches=2, steps=1, return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-5
    assert max_grad_diff(grads, res.grads) <= 1e-5
    assert len(res.peak_activations) == 4


@pytest.mark.parametrize("job, world, msg", [
    (DPJob("ddp", CFG, batch=9), 2, "global batch 9 is not divisible by the data-parallel size 2"),
    (DPJob("zero9", CFG), 2, "unknown strategy"),
])
def test_bad_dp_jobs(job, world, msg):
    with pytest.raises(ValueError, match=msg):
        check_dp_job(job, world)


def test_ddp_of_a_model_too_big_points_to_sharding():
    with pytest.raises(ValueError, match="Shard it .* or split it into pipeline stages"):
        check_dp_job(DPJob("ddp", CFG), 2, capacity_bytes=1000)
    check_dp_job(DPJob("fsdp2", CFG), 2, capacity_bytes=1000)  # sharding is the way out, not refused


def test_mesh_must_match_world():
    with pytest.raises(ValueError, match="a 2 x 2 mesh has 4 devices but the world has 2 ranks"):
        check_hybrid_job(HybridJob(CFG, dp=2, pp=2), 2)
    with pytest.raises(ValueError, match="global batch 31 is not divisible by the data-parallel size 2"):
        check_hybrid_job(HybridJob(CFG, batch=31), 4)


def test_fsdp_needs_layers_with_parameters():
    import torch.nn as nn

    with pytest.raises(ValueError, match="no child layers with parameters"):
        shardable_children(nn.Sequential(nn.ReLU(), nn.GELU()))


def test_two_gpu_plan_prefers_the_simplest_that_fits():
    from helpers.parallel import choose_two_gpus, plan_two_gpus

    gib = 2**30
    small = plan_two_gpus(10**8, 1e6, 16, 24 * gib, 0.05)
    assert choose_two_gpus(small).startswith("DDP")
    huge = plan_two_gpus(10**10, 1e6, 16, 24 * gib, 0.05)
    assert choose_two_gpus(huge).startswith("does not fit")
    mid = plan_two_gpus(2 * 10**9, 50e6, 16, 24 * gib, 0.05)  # 32 GB of state: only halved state fits
    assert not mid[0].fits and any(o.fits for o in mid[1:])
