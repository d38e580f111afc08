import copy

import pytest
import torch

from helpers.check import assert_same_grads
from helpers.pipeline.interpreter import Message, check_exchanges, check_p2p_plan, comm_plan, communication_plan
from helpers.pipeline.threaded import ThreadedPipeline, split_batch
from helpers.precision import Precision, max_relative_diff
from helpers.memory import ledger_for
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.pipeline.schedules import Action, bubble_fraction, gpipe, make_schedule, one_f_one_b, peak_in_flight, validate
from helpers.pipeline.stages import split_model

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
CPU2 = [torch.device("cpu")] * 2


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 13])
def test_schedules_are_valid(p, m):
    validate(gpipe(p, m), m)
    assert all(peak_in_flight(stage) == m for stage in gpipe(p, m))
    if m >= p:
        sched = one_f_one_b(p, m)
        validate(sched, m)
        assert [peak_in_flight(stage) for stage in sched] == [p - s for s in range(p)]


def test_deadlocking_schedule_is_refused():
    bad = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
           [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        validate(bad, 2)
    with pytest.raises(ValueError, match="exactly once"):
        validate([[Action("F", 0)]], 1)


def test_bad_pipeline_input():
    with pytest.raises(ValueError, match="m=1 < p=2"):
        one_f_one_b(2, 1)
    with pytest.raises(ValueError, match="global batch 30 is not divisible by 4 micro-batches"):
        split_batch(torch.zeros(30, 2), torch.zeros(30, 2), 4)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zb", 2, 2)
    assert bubble_fraction(2, 4) == pytest.approx(0.2)


@pytest.mark.parametrize("schedule, m", [("gpipe", 1), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)])
def test_threaded_pipeline_equals_one_device(schedule, m):
    model = build_stack(CFG)
    x, y = SyntheticTokens(8, CFG.seq_len, CFG.vocab).batch(0, 8)
    split = split_model(copy.deepcopy(model), 3, CPU2)
    pipe = ThreadedPipeline(split, schedule, m)
    loss = pipe.step(x, y)
    ref = lm_loss(model(x), y)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    assert_same_grads(model, split)
    events = pipe.events()
    assert sum(e.kind == "forward" for e in events) == 2 * m
    assert sum(e.kind == "backward" for e in events) == 2 * m


def test_1f1b_holds_fewer_activations_than_gpipe():
    model = build_stack(CFG)
    x, y = SyntheticTokens(16, CFG.seq_len, CFG.vocab).batch(0, 16)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        split = split_model(copy.deepcopy(model), 3, CPU2)
        ledger = ledger_for(split.stages, ["d0", "d1"])
        ThreadedPipeline(split, schedule, 8, ledger).step(x, y)
        peaks[schedule] = ledger.device("d0").activations
    assert peaks["1f1b"] * 3 <= peaks["gpipe"]  # 2 of 8 micro-batches in flight instead of 8


def test_stage_error_reaches_caller():
    split = split_model(build_stack(CFG), 3, CPU2)
    pipe = ThreadedPipeline(split, "gpipe", 2)
    x, y = SyntheticTokens(4, CFG.seq_len, CFG.vocab).batch(0, 4)
    with pytest.raises(RuntimeError, match="stage 1 failed"):
        pipe.step(x, y[:, :3])  # targets of the wrong shape fail in the last stage's loss


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_communication_plans_cannot_deadlock_on_nccl(name):
    """Every exchange posts the previous action's sends with the next action's receives (Megatron, picotron and
    torch.distributed.pipelining do the same): replayed under NCCL's in-order rules, no stage count and no
    micro-batch count can hang or misdeliver."""
    for p in range(1, 7):
        for m in range(p if name == "1f1b" else 1, 17):
            check_p2p_plan(make_schedule(name, p, m))


def test_the_plan_checker_finds_the_old_deadlock_and_misdeliveries():
    """The previous engine posted every receive of a step up front on one communicator per link: on NCCL that
    waits forever (stage 0 blocks on gradients before it has sent an activation)."""
    act = [Message("act", i) for i in range(2)]
    grad = [Message("grad", i) for i in range(2)]
    up_front = [[([], grad), ([act[0]], []), ([act[1]], []), ([], [])],
                [([], act), ([], []), ([grad[0]], []), ([grad[1]], [])]]
    with pytest.raises(ValueError, match="deadlocks on NCCL"):
        check_exchanges(up_front)
    crossed = [[Action("F", 0), Action("F", 1), Action("B", 1), Action("B", 0)],
               [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]
    with pytest.raises(ValueError, match="wrong receive"):
        check_exchanges([comm_plan(actions, s, 2) for s, actions in enumerate(crossed)])
    # posted as soon as they are sent, the receives take the sender's order: stage 0 waits for grad1 in its own buffer
    early = communication_plan(crossed)
    assert [str(m) for ex in early[0] for m in ex[1]] == ["grad0@0", "grad1@0"]


@pytest.mark.parametrize("precision", [Precision(autocast="bf16"), Precision(dtype="bf16"), Precision(dtype="fp64")],
                         ids=str)
def test_threaded_pipeline_in_every_precision(precision):
    """bf16 weights used to fail in stage 1 (the boundary was cast back to fp32) and fp64 was rounded to fp32 on
    the way: the wire now carries the dtype each stage computed."""
    model = build_stack(CFG).to(precision.weights)
    x, y = SyntheticTokens(8, CFG.seq_len, CFG.vocab).batch(0, 8)
    split = split_model(copy.deepcopy(model), 3, CPU2)
    loss = ThreadedPipeline(split, "1f1b", 4, precision=precision).step(x, y)
    with precision.context(torch.device("cpu")):
        ref = lm_loss(model(x), y)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-3 * ref.item()
    grads = [p.grad.float() for p in split.parameters()]
    assert max_relative_diff([p.grad.float() for p in model.parameters()], grads) <= precision.tolerance


def test_stages_of_different_dtypes_are_refused():
    split = split_model(build_stack(CFG), 3, CPU2)
    split.stages[1].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"different dtypes \(stage 0: torch.float32; stage 1: torch.bfloat16\)"):
        ThreadedPipeline(split, "gpipe", 2)
