"""DeepSpeed's ZeRO stages accounted against what the course teaches: each rank's memory of weights, gradients and
optimizer state as DeepSpeed's own estimators give it, set term by term against the ZeRO formulas
(`helpers.sizing.state.zero_formula`) and the training planner (no ranks); and the bytes each rank sends per optimizer
step, measured with DeepSpeed's comms logger on two ranks, against the ZeRO paper's volumes (full tier).

Ψ is the parameter count, N the ranks. Mixed precision as the ZeRO paper counts it (Rajbhandari et al. 2020, section
3.1): 2 bytes of 16-bit weights and 2 of gradients, K = 12 bytes of fp32 master weights and Adam's two moments.
DeepSpeed's estimators (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, the functions the `_all_live` ones
print) return bytes per GPU and per node (host).
"""
import os
from fractions import Fraction

import pytest
import torch

from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.sizing.state import zero_formula
from tests.test_deepspeed import deepspeed  # noqa: F401 (a fixture: skips, or fails in CI, without DeepSpeed)

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
BATCH = 8
MIXED = {"weight_bytes": 2, "grad_bytes": 2, "optim_bytes": 12}  # the ZeRO paper's 2 + 2 + K bytes per parameter
FP32_GRAD = 4  # bytes per parameter of the fp32 gradient partition DeepSpeed's optimizer steps on
BUFFER_FACTOR = 1.5  # DeepSpeed's `additional_buffer_factor` (its default): a margin on host memory, no tensor
LLAMA_GPUS = "8 x A100 80GB SXM"  # Llama-3-8B full fine-tuning: 8 ranks, a node of 80 GB GPUs


def _zero_modules():
    """DeepSpeed's ZeRO modules, imported on its CPU accelerator where there is no GPU (as
    helpers.training.deepspeed_zero does: named rather than found, it warns when found)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    return stage_1_and_2, stage3


def _counts(model: torch.nn.Module) -> tuple[int, int]:
    """(Ψ, the largest module's own parameters): what DeepSpeed's `stage3.model_to_params` counts, by identity
    rather than by data pointer, so that a model on the meta device (every pointer 0) is counted too."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def _llama_3_8b() -> tuple[int, int]:
    from helpers.sizing.shape import meta_model, model_shape

    return _counts(meta_model(model_shape("llama-3-8b", "bf16").config))


def test_counting_is_deepspeeds_own_on_a_real_model(deepspeed):
    _, stage3 = _zero_modules()
    model = build_stack(CFG)
    assert _counts(model) == stage3.model_to_params(model)


@pytest.mark.parametrize("model, world", [("tiny", 2), ("llama-3-8b", 8)])
def test_deepspeeds_estimators_are_the_zero_formulas_plus_its_fp32_gradient_partition(deepspeed, model, world):
    """Term by term, bytes per GPU (f: `zero_formula` in mixed precision; L: the largest module's parameters):

    ZeRO-1: DeepSpeed has no estimator (stage_1_and_2.py estimates ZeRO-2 only); ZeRO-1 keeps every rank's 16-bit
    gradients whole (the formula's 2Ψ), which the ZeRO-2 figure does not.

    ZeRO-2, optimizer on the GPU: 2Ψ + 18Ψ/N, and its source itemizes the 18 as 2 (16-bit gradients) + 4 (fp32
    gradients) + 4 (fp32 weights) + 8 (moments). That is the formula's 2Ψ + 2Ψ/N + 12Ψ/N plus 4Ψ/N: the fp32 copy of
    the rank's gradient partition that DeepSpeed's optimizer steps on (stage_1_and_2.py sets it as the `.grad` of
    `single_partition_of_fp32_groups`); the ZeRO paper's K counts the fp32 weights and moments, not an fp32 gradient.
    Offloaded: the GPU keeps the 16-bit weights (the formula's params); the node's host 1.5 x max(4 N Ψ, 16Ψ), where
    16Ψ is every rank's K partition plus its fp32 gradient partition (12Ψ + 4Ψ), 1.5 DeepSpeed's buffer factor, and
    4 bytes per parameter per GPU a term its source gives no reason for (it is larger from five GPUs on).

    ZeRO-3, optimizer on the GPU: 4L + 18Ψ/N. Its source does not itemize this 18; its offload branches do: with the
    optimizer offloaded the GPU keeps 4L + 2Ψ/N (the formula's partition of 16-bit weights) and the host 16Ψ (K plus
    the fp32 gradient partition, as ZeRO-2's), with the weights offloaded too the host 18Ψ (those plus the 16-bit
    weights). Read the same way, 18Ψ/N = 2 (16-bit weights) + 12 (K) + 4 (fp32 gradients): against the formula's
    2 + 2 + 12 it adds the fp32 gradient partition and leaves out the partition of 16-bit gradients (2Ψ/N), though
    stage 3 holds one (`grad_partitions_flat_buffer`, in the gradient-accumulation dtype, where the reduce-scatter
    lands before the copy to fp32); the net is +2Ψ/N. 4L is the largest
    module gathered whole (4 bytes per parameter, not itemized in the source), which the formula, a count of state
    at rest, leaves out: the planner prices the gathered layers as workspace."""
    stage_1_and_2, stage3 = _zero_modules()
    n, largest = _counts(build_stack(CFG)) if model == "tiny" else _llama_3_8b()
    one_node = {"num_gpus_per_node": world, "num_nodes": 1, "additional_buffer_factor": BUFFER_FACTOR}
    assert not hasattr(stage_1_and_2, "estimate_zero1_model_states_mem_needs")

    f = zero_formula("ds_zero2", n, world, **MIXED)
    fp32_grads = FP32_GRAD * n // world
    host, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(n, cpu_offload=False, **one_node)
    assert gpu == f.params + f.grads + f.optimizer + fp32_grads
    host, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(n, cpu_offload=True, **one_node)
    assert gpu == f.params
    assert host == int(max(4 * world * n, world * (f.optimizer + fp32_grads)) * BUFFER_FACTOR)

    f = zero_formula("ds_zero3", n, world, **MIXED)
    gathered = 4 * largest

    def zero3(optimizer_offload: bool, weights_offload: bool) -> tuple[int, int]:
        host, gpu, layer = stage3.estimate_zero3_model_states_mem_needs(
            n, largest, cpu_offload=optimizer_offload, cpu_offload_params=weights_offload, **one_node)
        assert layer == gathered
        return host, gpu

    _, on_gpu = zero3(False, False)
    assert on_gpu == gathered + f.params + f.optimizer + fp32_grads
    assert on_gpu == gathered + f.params + f.grads + f.optimizer + 2 * n // world
    host, gpu = zero3(True, False)
    assert (gpu, host) == (gathered + f.params, int(world * (f.optimizer + fp32_grads) * BUFFER_FACTOR))
    host, gpu = zero3(True, True)
    assert (gpu, host) == (gathered, int(world * (f.params + f.optimizer + fp32_grads) * BUFFER_FACTOR))
    print(f"{model} ({n:,} parameters, largest module {largest:,}) on {world}: ZeRO-3 formula {f}, "
          f"DeepSpeed's ZeRO-3 GPU estimate {on_gpu:,} B")


def test_the_planners_fsdp2_state_is_zero3s_formula_held_as_fsdp2_holds_it(deepspeed):
    """Llama-3-8B, full fine-tuning in mixed precision with FSDP2 on 8 GPUs: the planner's weights, gradients and
    optimizer state per GPU add up to the ZeRO-3 formula's 16Ψ/N, split as FSDP2 holds them: fp32 shards (4Ψ/N,
    twice the formula's 16-bit weights: the shard is the master copy, all-gathered in bf16), fp32 gradients (4Ψ/N:
    reduce-scattered in the state dtype), and Adam's moments only (8Ψ/N: no separate master copy). Against DeepSpeed's
    ZeRO-3 estimate, less its gathered largest module, that is 2Ψ/N less (the fp32 gradient partition DeepSpeed adds
    over the formula, net of the 16-bit gradients it leaves out: see the estimator test)."""
    from helpers.finetune.memory_plan import plan_training

    _, stage3 = _zero_modules()
    plan = plan_training(model="llama-3-8b", method="full", strategy="fsdp2", gpus=LLAMA_GPUS, precision="mixed",
                         suggest=False)
    world, n = len(plan.devices), plan.shape.trainable_params
    n_counted, largest = _llama_3_8b()
    assert n == n_counted == plan.shape.total_params
    f = zero_formula("ds_zero3", n, world, **MIXED)
    for d in plan.devices:
        assert (d.trainable_bytes, d.gradient_bytes, d.optimizer_bytes) == (2 * f.params, 2 * f.grads,
                                                                            f.optimizer - 4 * n // world)
        state = d.trainable_bytes + d.gradient_bytes + d.optimizer_bytes
        assert state == f.params + f.grads + f.optimizer
        _, gpu, gathered = stage3.estimate_zero3_model_states_mem_needs(n, largest, num_gpus_per_node=world,
                                                                        cpu_offload=False)
        assert gpu - gathered == state + 2 * n // world


# --- bytes sent per optimizer step ----------------------------------------------------------------------------------

PAPER = {"ds_zero1": 2, "ds_zero2": 2, "ds_zero3": 3}  # the ZeRO paper's volume per step, in units of (N-1)/N Ψ
ANY_WORLD = {"use_multi_rank_bucket_allreduce": False}  # each bucket reduced to its owner only
RELEASED = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}  # weights freed after forward
CASES = (  # (strategy, zero_optimization entries over the course's ds_config, measured volume in (N-1)/N Ψ)
    ("ds_zero1", {}, 3), ("ds_zero2", {}, 3), ("ds_zero3", {}, 2),
    ("ds_zero1", ANY_WORLD, 2), ("ds_zero2", ANY_WORLD, 2), ("ds_zero3", RELEASED, 3),
)
WORLD = 2
CONTROL_OPS = ("broadcast",)  # ZeRO-3's trace checks: module ids broadcast from rank 0
SCALAR_BYTES = 8  # an all-reduce at most this large is the gradient norm (one fp32 or fp64 scalar), not gradients
TOLERANCE = 0.01  # DeepSpeed pads its flat partitions to an alignment (none for this model: 55,296 elements)
CONTROL_SHARE = 0.02  # the norm and the trace checks, at most this share of Ψ's bytes


def ring_bytes(op: str, msg_bytes: int, world: int) -> Fraction:
    """Bytes one rank sends, averaged over the ranks, for one message the comms logger records (its size: the
    tensor; all_gather_into_tensor's input, one rank's part; reduce_scatter_tensor's input, the whole) on a ring:
    an all-reduce 2(N-1)/N of it, a reduce-scatter, a reduce or a broadcast (N-1)/N (N reduces, one to each owner,
    are one reduce-scatter), an all-gather (N-1) parts."""
    if op == "all_reduce":
        return Fraction(2 * (world - 1), world) * msg_bytes
    if op in ("reduce_scatter_tensor", "reduce", "broadcast"):
        return Fraction(world - 1, world) * msg_bytes
    if op == "all_gather_into_tensor":
        return Fraction(world - 1) * msg_bytes
    raise ValueError(f"no ring volume for DeepSpeed's {op!r}")


def step_traffic(cases) -> list[dict]:
    """On each rank, per case (as in CASES): a DeepSpeed engine over a fresh tiny model, configured by the course's
    ds_config with the case's ZeRO entries and the comms logger on; one Adam step (setup's collectives), the log
    cleared, a second step; its log as op -> message bytes -> count."""
    import torch.distributed as dist

    from helpers.training.deepspeed_zero import ds_config
    from helpers.training.job import TrainJob

    _zero_modules()
    import deepspeed
    from deepspeed.comm.comm import comms_logger

    rank, share = dist.get_rank(), BATCH // WORLD
    inputs, targets = (t[rank * share:(rank + 1) * share] for t in SyntheticTokens(BATCH, CFG.seq_len, CFG.vocab)
                       .batch(0, BATCH))
    logs = []
    for strategy, zero, _ in cases:
        torch.manual_seed(0)
        module = build_stack(CFG)
        config = ds_config(TrainJob(CFG, strategy, batch=BATCH, optimizer="adam"))
        config["zero_optimization"].update(zero)
        config["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False}
        engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config,
                                          optimizer=torch.optim.Adam(module.parameters()), dist_init_required=False)
        for _ in range(2):
            comms_logger.reset_data()
            engine.backward(lm_loss(engine(inputs), targets))
            engine.step()
        logs.append({op: {size: record[0] for size, record in sizes.items()}
                     for op, sizes in comms_logger.comms_dict.items()})
    return logs


def _data_and_control(log: dict) -> tuple[Fraction, Fraction]:
    """(gradients' and weights' bytes, the rest's) one rank sends, from one step's log."""
    data = control = Fraction(0)
    for op, sizes in log.items():
        for size, count in sizes.items():
            sent = ring_bytes(op, size, WORLD) * count
            if op in CONTROL_OPS or (op == "all_reduce" and size <= SCALAR_BYTES):
                control += sent
            else:
                data += sent
    return data, control


@pytest.mark.full
def test_bytes_each_rank_sends_per_step_are_zeros_volumes(deepspeed):
    """Two ranks, fp32, one Adam step of the tiny model, every byte DeepSpeed's comms logger records, on a ring:

    - ZeRO-1 and ZeRO-2 as the course configures them send 3 (N-1)/N Ψ, not the paper's 2: DeepSpeed all-reduces each
      gradient bucket and keeps its partition (`use_multi_rank_bucket_allreduce`, on by default) where the paper
      reduce-scatters; with it off each bucket is reduced to its owner, and the volume is the paper's 2.
    - ZeRO-3 as the course configures it sends 2, not the paper's 3: its prefetch bucket (the job's bucket_mb) holds
      the whole tiny model and `stage3_max_reuse_distance` (DeepSpeed's default, 10^9 parameters) keeps the gathered
      weights from forward to backward, so they are gathered once; with both at 0 the weights are freed after
      forward and gathered again in backward: the paper's 3.

    Tolerance 1% on the gradients' and weights' bytes (DeepSpeed's alignment padding of its flat partitions). Beside
    them, under 2% of Ψ's bytes: the gradient norm's all-reduce (one scalar; DeepSpeed computes it with clipping
    off) and ZeRO-3's trace checks (broadcasts of module ids from rank 0)."""
    from helpers.runtime.launch import run
    from helpers.runtime.rig import cpu_rig

    psi = 4 * sum(p.numel() for p in build_stack(CFG).parameters())  # fp32 bytes
    unit = Fraction(WORLD - 1, WORLD) * psi
    per_rank = run(step_traffic, CASES, nranks=WORLD, rig=cpu_rig())
    for rank_logs in per_rank:
        for (strategy, zero, volume), log in zip(CASES, rank_logs):
            data, control = _data_and_control(log)
            print(f"{strategy} {zero or 'as configured'}: {float(data):,.0f} B of gradients and weights "
                  f"({float(data / unit):.3f} x (N-1)/N Ψ; paper {PAPER[strategy]}, expected {volume}), "
                  f"{float(control):,.0f} B else; log {log}")
            assert abs(data / (volume * unit) - 1) <= TOLERANCE, (strategy, zero, log)
            assert control <= CONTROL_SHARE * psi, (strategy, zero, log)
