import copy
from collections import Counter

import pytest
import torch

from helpers.catalog import BEYOND_1F1B
from helpers.check import assert_same_grads, max_grad_diff
from helpers.pipeline.interpreter import Message, check_exchanges, check_p2p_plan, comm_plan, communication_plan
from helpers.partition import equal_count_split
from helpers.pipeline.threaded import ThreadedPipeline, split_batch, stage_devices
from helpers.precision import Precision, max_relative_diff
from helpers.sizing.ledger import ledger_for
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.pipeline.schedules import Action, bubble_fraction, gpipe, make_schedule, one_f_one_b, peak_in_flight, validate
from helpers.pipeline.schedules import (Schedule, chunks_of, dual_pipe_v, interleaved_1f1b, layout_for, layout_of,
                                        zero_bubble_h1, zero_bubble_v)
from helpers.pipeline.stages import split_model

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)
CFG6 = StackConfig(hidden=32, n_blocks=6, heads=2, seq_len=8, vocab=64)  # 8 layers: 4 stages of 2
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


def _step_equals_one_device(model, split, schedule: str, m: int, x, y) -> list:
    """One threaded step of `split` against `model`'s own step: same loss, same gradients. Returns its events."""
    pipe = ThreadedPipeline(split, schedule, m)
    loss = pipe.step(x, y)
    ref = lm_loss(model(x), y)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    assert_same_grads(model, split)
    return pipe.events()


@pytest.mark.parametrize("schedule, m", [("gpipe", 1), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)])
def test_threaded_pipeline_equals_one_device(schedule, m):
    model = build_stack(CFG)
    x, y = SyntheticTokens(8, CFG.seq_len, CFG.vocab).batch(0, 8)
    events = _step_equals_one_device(model, split_model(copy.deepcopy(model), 3, CPU2), schedule, m, x, y)
    assert sum(e.kind == "forward" for e in events) == 2 * m
    assert sum(e.kind == "backward" for e in events) == 2 * m


def _activation_peaks(schedules: tuple[str, ...]) -> dict[str, list[int]]:
    """Each schedule's peak saved activations per device (8 micro-batches, threads), and that every graph was freed."""
    model = build_stack(CFG)
    x, y = SyntheticTokens(16, CFG.seq_len, CFG.vocab).batch(0, 16)
    peaks = {}
    for schedule in schedules:
        split = split_model(copy.deepcopy(model), 3, CPU2)
        ledger = ledger_for(split.stages, ["d0", "d1"])
        ThreadedPipeline(split, schedule, 8, ledger).step(x, y)
        peaks[schedule] = [ledger.device(d).activations for d in ("d0", "d1")]
        assert all(ledger.live_activations(d) == 0 for d in ("d0", "d1")), "every graph freed after the step"
    return peaks


def test_1f1b_holds_fewer_activations_than_gpipe():
    peaks = _activation_peaks(("gpipe", "1f1b"))
    assert peaks["1f1b"][0] * 3 <= peaks["gpipe"][0]  # 2 of 8 micro-batches in flight instead of 8


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


# --- past 1F1B: interleaved 1F1B, ZB-H1, ZB-V, DualPipeV --------------------------------------------------------

BEYOND = BEYOND_1F1B  # notebook 06b's schedules (helpers.catalog)


def _fits(name: str, p: int, m: int) -> bool:
    return {"interleaved": m % p == 0, "zbh1": m >= p, "zbv": m >= 2 * p - 1, "dualpipev": m >= 2 * p}[name]


@pytest.mark.parametrize("name", BEYOND)
def test_new_schedules_are_valid_and_safe_on_nccl(name):
    """Every device runs F and B of every micro-batch on each of its chunks once (W at most once), no dependency
    cycle, and the communication plan can neither deadlock on NCCL nor misdeliver."""
    for p in range(1, 5):
        for m in range(1, 13):
            if _fits(name, p, m):
                sched = make_schedule(name, p, m)
                validate(sched, m)
                check_p2p_plan(sched)
                assert len(sched) == p and layout_of(sched).stages == p * chunks_of(name)


def test_new_schedules_keep_their_memory_promises():
    """Micro-batches (per chunk) whose activations a device holds at once: ZB-H1 p on every device (1F1B: p - d),
    ZB-V 2p chunk-halves (1F1B's first stage), interleaved more during its longer warm-up."""
    p, m = 4, 8
    assert [peak_in_flight(a) for a in zero_bubble_h1(p, m)] == [p] * p
    assert [peak_in_flight(a) for a in zero_bubble_v(p, m)] == [2 * p] * p
    assert [peak_in_flight(a) for a in interleaved_1f1b(2, 8)] == [5, 3]
    # the split backward: a W for every B of ZB-H1 and ZB-V; DualPipeV splits only its ramps
    for name in ("zbh1", "zbv"):
        sched = make_schedule(name, p, m)
        assert all(sum(a.kind == "W" for a in actions) == sum(a.kind == "B" for a in actions) for actions in sched)
    assert [sum(a.kind == "W" for a in actions) for actions in dual_pipe_v(2, 8)] == [3, 2]


def test_broken_new_schedules_are_refused():
    good = zero_bubble_h1(2, 2)
    w_first = [list(good[0]), [Action("F", 0), Action("W", 0), Action("B", 0), Action("F", 1), Action("B", 1),
                                Action("W", 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        validate(w_first, 2)
    twice = [list(good[0]), list(good[1]) + [Action("W", 1)]]
    with pytest.raises(ValueError, match="W at most once"):
        validate(twice, 2)
    inter = interleaved_1f1b(2, 2)
    no_chunk_1 = Schedule([[a for a in actions if a.chunk == 0] for actions in inter], inter.layout)
    with pytest.raises(ValueError, match="on each of its 2 chunks"):
        validate(no_chunk_1, 2)
    assert [str(a) for a in inter[1][2:4]] == ["F0c1", "B0c1"]
    swapped = Schedule([inter[0], [*inter[1][:2], inter[1][3], inter[1][2], *inter[1][4:]]], inter.layout)
    with pytest.raises(ValueError, match="deadlocks"):
        validate(swapped, 2)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        interleaved_1f1b(2, 3)
    with pytest.raises(ValueError, match="at least 2 chunks"):
        interleaved_1f1b(2, 2, chunks=1)
    with pytest.raises(ValueError, match="2p-1 = 3"):
        zero_bubble_v(2, 2)
    with pytest.raises(ValueError, match="2p = 4"):
        dual_pipe_v(2, 3)
    with pytest.raises(ValueError, match="m=1 < p=2"):
        zero_bubble_h1(2, 1)


def test_the_v_turns_on_one_device_and_interleaved_needs_early_receives():
    """ZB-V: device 0 holds stages 0 and 3, device 1 stages 1 and 2, so boundary 1 (stage 1 -> 2) never goes over
    the wire. Interleaved 1F1B: Megatron's plan (previous sends with the next receives) deadlocks on NCCL, both
    devices sending while the matching receives wait behind those sends; posted early, the receives are safe.
    GPipe and 1F1B keep Megatron's plan."""
    zbv = zero_bubble_v(2, 4)
    assert [zbv.layout.stages_of(d) for d in range(2)] == [[0, 3], [1, 2]]
    wire = {m.boundary for plan in communication_plan(zbv) for ex in plan for m in ex[0] + ex[1]}
    assert wire == {0, 2}
    inter = interleaved_1f1b(2, 4)
    with pytest.raises(ValueError, match="deadlocks on NCCL"):
        check_exchanges([comm_plan(a, d, inter.layout) for d, a in enumerate(inter)], inter.layout)
    early = communication_plan(inter)
    assert all(len(ex) == 3 for plan in early for ex in plan)
    for name in ("gpipe", "1f1b", "zbh1"):
        sched = make_schedule(name, 3, 6)
        assert communication_plan(sched) == [comm_plan(a, d, 3) for d, a in enumerate(sched)]


@pytest.mark.parametrize("name", BEYOND)
def test_new_schedules_on_threads_equal_one_device(name):
    model = build_stack(CFG6)
    x, y = SyntheticTokens(8, CFG6.seq_len, CFG6.vocab).batch(0, 8)
    layout = layout_for(name, 2)
    split = split_model(copy.deepcopy(model), list(equal_count_split(len(model), layout.stages)),
                        stage_devices(CPU2, layout))
    events = _step_equals_one_device(model, split, name, 4, x, y)
    assert sum(e.kind == "forward" for e in events) == 4 * layout.stages
    weights = sum(a.kind == "W" for actions in make_schedule(name, 2, 4) for a in actions)
    assert sum(e.kind == "weight" for e in events) == weights
    assert {(e.device, e.stage) for e in events if e.kind == "forward"} == \
        {(layout.device_of(k), k) for k in range(layout.stages)}


def test_zero_bubble_holds_the_graph_until_w():
    """ZB-H1's last stage keeps each micro-batch's graph (its activations) from B until W: two micro-batches at
    its peak where 1F1B's last stage holds one, measured with the ledger."""
    peaks = _activation_peaks(("1f1b", "zbh1"))
    assert peaks["zbh1"][0] == peaks["1f1b"][0]
    assert peaks["zbh1"][1] == pytest.approx(2 * peaks["1f1b"][1], rel=0.02)


class _SharedWeight(torch.nn.Module):
    """One linear layer used twice with a nonlinearity between: its weight is behind two forks of the spine."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.lin(torch.tanh(self.lin(x))))


def _flops(fn) -> int:
    """The FLOPs `fn` runs (torch's FlopCounterMode): what tells a backward split in two from one run twice."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _pieces(module: torch.nn.Module) -> list[tuple]:
    """`module` as `forward_cut`'s pieces: the shared-weight module cut between its two uses of `lin` (a weight on
    both sides of a cut, as a tie inside one stage), a block stack block by block."""
    if isinstance(module, _SharedWeight):
        return [(lambda h: torch.tanh(module.lin(h)), module.lin.parameters()),
                (lambda h: module.norm(module.lin(h)), module.parameters())]
    return [(block, block.parameters()) for block in module]


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "layer-by-layer"])
@pytest.mark.parametrize("make", [_SharedWeight, lambda: build_stack(CFG)[1:3]], ids=["shared", "blocks"])
def test_split_backward_is_the_backward_in_two_halves(make, cut):
    """B gives the input gradient and leaves .grad untouched; W adds exactly what backward() would have, whether the
    forward ran whole or cut into pieces (`forward_cut`: each piece's weight pass adds its own uses' gradients)."""
    from helpers.pipeline.split_backward import backward_input, backward_input_cut, forward_cut

    torch.manual_seed(0)
    module = make()
    x = torch.randn(4, CFG.seq_len, 8 if isinstance(module, _SharedWeight) else CFG.hidden)
    inp = x.clone().requires_grad_()
    out = module(inp)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    inp2 = x.clone().requires_grad_()
    if cut:
        got, weights = backward_input_cut(forward_cut(_pieces(module), inp2), grad)
    else:
        got, weights = backward_input(module(inp2), grad, inp2, module.parameters())
    assert torch.allclose(got, inp.grad, atol=1e-6)
    assert all(p.grad is None for p in module.parameters())
    weights.run()
    assert max_grad_diff(ref, module) < 1e-6


def test_a_stage_split_layer_by_layer_is_the_same_backward_in_fewer_calls():
    """Run layer by layer (each block's input cut from the previous block's output), the split backward gives the
    same input gradient and weight gradients as one plain backward, with the same FLOPs, and its weight pass makes one
    autograd call per fork of a block (6: two norms, four linear layers), not one per fork of the stage (18): the k-th
    fork of every block runs in one call, since the blocks' graphs share no node."""
    from helpers.pipeline.split_backward import backward_input, backward_input_cut, forward_cut

    torch.manual_seed(0)
    stage = build_stack(CFG)[1:4]
    x = torch.randn(4, CFG.seq_len, CFG.hidden)
    grad = torch.randn(4, CFG.seq_len, CFG.hidden)

    inp = x.clone().requires_grad_()
    out = stage(inp)
    plain = _flops(lambda: out.backward(grad))
    ref = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    whole = x.clone().requires_grad_()
    assert len(backward_input(stage(whole), grad, whole, stage.parameters())[1].calls) == 18
    cuts = forward_cut([(block, block.parameters()) for block in stage], x.clone().requires_grad_())
    assert [c.inp.is_leaf for c in cuts] == [True] * 3 and torch.equal(cuts[-1].out, out)
    halves = {}
    halves["input"] = _flops(lambda: halves.setdefault("split", backward_input_cut(cuts, grad)))
    got, weights = halves["split"]
    assert torch.allclose(got, inp.grad, atol=1e-6) and all(p.grad is None for p in stage.parameters())
    assert len(weights.calls) == 6
    halves["weight"] = _flops(weights.run)
    assert halves["input"] + halves["weight"] == plain
    assert max_grad_diff(ref, stage) <= 1e-6


def test_a_first_stage_defers_its_whole_backward():
    """Token ids need no gradient: B computes nothing and W is the whole backward."""
    from helpers.pipeline.split_backward import backward_input

    stage = build_stack(CFG)[:2]
    x, _ = SyntheticTokens(2, CFG.seq_len, CFG.vocab).batch(0, 2)
    out = stage(x)
    grad = torch.randn_like(out)
    out.backward(grad, retain_graph=True)
    ref = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    got, weights = backward_input(out, grad, None, stage.parameters())
    assert got is None and all(p.grad is None for p in stage.parameters())
    weights.run()
    assert max_grad_diff(ref, stage) == 0


def test_the_split_backward_computes_what_a_plain_backward_does_and_frees_the_graph():
    """The input pass and the weight pass together run exactly the FLOPs of one plain backward (no stretch of the
    spine computed twice), accumulate into .grad as backward() does, and the weight pass's last group frees the
    graph it passes through: a second backward through it fails, as after a plain backward. (The old weight pass kept
    the graph and its activations alive to the end and added gradients of its own into .grad.)"""
    from helpers.pipeline.split_backward import backward_input

    torch.manual_seed(0)
    module = build_stack(CFG)[1:3]
    x = torch.randn(4, CFG.seq_len, CFG.hidden)

    inp = x.clone().requires_grad_()
    out = module(inp)
    grad = torch.randn_like(out)
    plain = _flops(lambda: out.backward(grad))
    ref = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=False)
    inp2 = x.clone().requires_grad_()
    out2 = module(inp2)
    halves = {}
    halves["input"] = _flops(lambda: halves.setdefault("split", backward_input(out2, grad, inp2, module.parameters())))
    halves["weight"] = _flops(halves["split"][1].run)
    assert plain > 0 and halves["input"] + halves["weight"] == plain
    assert max_grad_diff(ref, module) <= 1e-6
    with pytest.raises(RuntimeError, match="second time"):
        out2.backward(grad)


def _mm_calls(fn) -> int:
    """How many matrix products (`mm`, `addmm`) `fn` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return len(calls)


@pytest.mark.parametrize("make", [_SharedWeight, lambda: build_stack(CFG)[1:3]], ids=["shared", "blocks"])
def test_weight_passes_of_several_microbatches_run_as_one_product_per_linear_layer(make):
    """`run_batched` over three micro-batches' weight halves adds what three plain backwards would, with each plain
    linear layer's weight gradient one product over the micro-batches' rows: a block's four linear layers take 4
    products where one pass per micro-batch takes 12. A weight used by two pieces of the cut forward (a tie) gets
    one product over all its uses' rows."""
    from helpers.pipeline.split_backward import backward_input_cut, forward_cut, run_batched

    torch.manual_seed(0)
    module = make()
    width = 8 if isinstance(module, _SharedWeight) else CFG.hidden
    xs = [torch.randn(2, CFG.seq_len, width) for _ in range(3)]
    grads = []
    for x in xs:
        out = module(x.clone().requires_grad_())
        grads.append(torch.randn_like(out))
        out.backward(grads[-1])
    ref = [p.grad.clone() for p in module.parameters()]

    def halves():
        module.zero_grad(set_to_none=True)
        return [backward_input_cut(forward_cut(_pieces(module), x.clone().requires_grad_()), g)[1]
                for x, g in zip(xs, grads)]

    one_by_one = halves()
    separate = _mm_calls(lambda: [w.run() for w in one_by_one])
    batched = halves()
    together = _mm_calls(lambda: run_batched(batched))
    assert max_grad_diff(ref, module) <= 1e-6 * max(r.abs().max().item() for r in ref)  # fp32, summed in another order
    assert not any(p.grad.requires_grad for p in module.parameters()), "a gradient, not a graph (a cut input needs one)"
    if isinstance(module, _SharedWeight):  # cut between its two uses: each piece's use is a plain linear layer
        assert (separate, together) == (3 * 2, 1)
    else:
        assert (separate, together) == (3 * 8, 8)  # 2 blocks x 4 linear layers


@pytest.mark.parametrize("name", [n for n in BEYOND if any(a.kind == "W" for d in make_schedule(n, 2, 4) for a in d)])
@pytest.mark.parametrize("k", [2, 3])
def test_weight_passes_in_groups_keep_every_schedule_valid_and_safe_on_nccl(name, k):
    """Each W waits for the next k-1 of its chunk: still a valid schedule whose communication plan cannot deadlock on
    NCCL, its Ws in runs of at least k back to back (but a chunk's last), at most k-1 more micro-batches held per
    chunk."""
    from helpers.pipeline.schedules import weight_groups, weights_in_groups

    for p, m in ((2, 4), (2, 8), (3, 6)):
        plain = make_schedule(name, p, m)
        grouped = weights_in_groups(plain, k)
        validate(grouped, m)
        check_p2p_plan(grouped)
        for before, after in zip(plain, grouped):
            assert sorted(map(str, before)) == sorted(map(str, after))
            assert [a for a in after if a.kind != "W"] == [a for a in before if a.kind != "W"]
            per_chunk = Counter(a.chunk for a in after if a.kind == "W")
            assert len(weight_groups(after)) <= sum(-(-n // k) for n in per_chunk.values())
            assert peak_in_flight(after) <= peak_in_flight(before) + (k - 1) * layout_for(name, p).chunks


@pytest.mark.parametrize("name", ["zbh1", "zbv"])
def test_batched_weight_passes_on_threads_equal_one_device(name):
    """The threaded engine with weight passes two micro-batches at a time: same loss and gradients as one device,
    half as many weight spans, every graph freed after the step, and the activations the ledger counts at the
    peak as many more as the grouped schedule holds micro-batches (`peak_in_flight`, within 10%)."""
    from helpers.pipeline.schedules import weights_in_groups

    model = build_stack(CFG6)
    x, y = SyntheticTokens(8, CFG6.seq_len, CFG6.vocab).batch(0, 8)
    layout = layout_for(name, 2)
    peaks = {}
    for k in (1, 2):
        split = split_model(copy.deepcopy(model), list(equal_count_split(len(model), layout.stages)),
                            stage_devices(CPU2, layout))
        devices = [torch.nn.ModuleList([split.stages[j] for j in layout.stages_of(d)]) for d in range(2)]
        ledger = ledger_for(devices, ["d0", "d1"])
        pipe = ThreadedPipeline(split, name, 4, ledger, batched_weights=k)
        loss = pipe.step(x, y)
        assert all(ledger.live_activations(d) == 0 for d in ("d0", "d1")), "every graph freed after the step"
        peaks[k] = [ledger.device(d).activations for d in ("d0", "d1")]
    ref = lm_loss(model(x), y)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    assert_same_grads(model, split)
    weights = sum(a.kind == "W" for actions in make_schedule(name, 2, 4) for a in actions)
    assert sum(e.kind == "weight" for e in pipe.events()) == weights // 2
    units = {k: [peak_in_flight(a) for a in weights_in_groups(make_schedule(name, 2, 4), k)] for k in (1, 2)}
    for d in range(2):
        assert peaks[2][d] / peaks[1][d] == pytest.approx(units[2][d] / units[1][d], rel=0.1)
