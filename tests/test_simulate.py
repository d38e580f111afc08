"""The simulator against answers computed by hand: equal stages, exact costs, links whose every message is known."""
import math
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.facts import load_data  # noqa: E402
from helpers.sizing.state import BYTES_PER_PARAM  # noqa: E402
from helpers.sizing.activations import transformer_activation_bytes  # noqa: E402
from helpers.sizing.gpus import gpu, runtime_reserve_bytes  # noqa: E402
from helpers.models import build_hf_model, hf_layers  # noqa: E402
from helpers.pipeline.schedules import bubble_fraction  # noqa: E402
from helpers.profile import LayerProfile, Profile  # noqa: E402
from helpers.simulate import (FREE_LINK, MODELS, Job, Knobs, Link, Playground, SharedCores, Workload,  # noqa: E402
                              allgather_s, allreduce_s, broadcast_s, collective_s,
                              fit_collective_link, fit_collectives, fit_link,
                              efficiency, gpu_named, layer_flops, on_gpu,
                              predictions_vs_published, recommend_model, reducescatter_s, resnet50_workload,
                              simulate, simulate_memory, target_rig, target_rigs, transformer_workload)
from helpers.timeline import Event, plot_timeline  # noqa: E402

F, B = 1.0, 2.0  # per micro-batch and stage: binary fractions, so every sum below is exact
MiB = 2**20


def equal_stages(p: int, params: int = 0, activations: float = 0.0, output: float = 0.0) -> Workload:
    return Workload.from_lists([F] * p, [B] * p, params=[params] * p, activations=[activations] * p,
                               output=[output] * p)


# --- pipelines ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (3, 5), (4, 8), (4, 16)])
def test_gpipe_step_is_m_plus_p_minus_1_slots(p, m):
    sim = simulate(equal_stages(p), Job("gpipe", batch=m, microbatches=m, pp=p))
    assert sim.step_s == (m + p - 1) * (F + B)
    assert sim.bubble == pytest.approx(bubble_fraction(p, m))
    assert sim.in_flight == {s: m for s in range(p)}


def test_a_2_to_1_pair_balanced_by_speed_gains_what_the_arithmetic_says():
    """Twelve equal layers on a card twice as fast as the other (speeds 1 : 0.5), free links. Balanced, the fast
    card takes 8 layers: both take 8 units of time where the equal split's take 6 and 12. A plain layer split (naive:
    one micro-batch, the stages one after the other) is then 1.125x faster (18 units against 16); 1F1B tends to 1.5x
    as micro-batches grow (its slowest stage sets the pace: 12 against 8); data parallelism with shares by speed is
    1.5x equal shares (each replica waits for the slower one's share)."""
    work = Workload.from_lists([F] * 12, [B] * 12)
    speeds = (1.0, 0.5)

    def ratio(strategy: str, m: int) -> float:
        equal = simulate(work, Job(strategy, batch=m, microbatches=m, boundaries=(6,), speeds=speeds))
        balanced = simulate(work, Job(strategy, batch=m, microbatches=m, speeds=speeds))
        return equal.step_s / balanced.step_s

    assert ratio("naive", 1) == pytest.approx(9 / 8)
    assert ratio("1f1b", 64) == pytest.approx(1.5, rel=0.02) and ratio("1f1b", 4) < ratio("1f1b", 64) < 1.5
    dp_equal = simulate(work, Job("ddp", batch=12, speeds=speeds))
    dp_shares = simulate(work, Job("ddp", batch=12, shares=(8, 4), speeds=speeds))
    assert dp_equal.step_s / dp_shares.step_s == pytest.approx(1.5, rel=0.02)


def test_speeds_and_shares_are_refused_unless_they_fit_the_job():
    with pytest.raises(ValueError, match="2 positive relative speeds"):
        Job("1f1b", batch=4, microbatches=4, speeds=(1.0,))
    with pytest.raises(ValueError, match="adding up to 12"):
        Job("ddp", batch=12, shares=(8, 5))


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (3, 5), (4, 8)])
def test_1f1b_same_time_and_p_minus_s_in_flight(p, m):
    act = 1000.0
    sim = simulate(equal_stages(p, activations=act), Job("1f1b", batch=m, microbatches=m, pp=p))
    assert sim.step_s == (m + p - 1) * (F + B)
    assert sim.in_flight == {s: p - s for s in range(p)}
    assert {s: mem.activations for s, mem in sim.memory.items()} == {s: (p - s) * act for s in range(p)}
    gpipe = simulate(equal_stages(p, activations=act), Job("gpipe", batch=m, microbatches=m, pp=p))
    assert all(mem.activations == m * act for mem in gpipe.memory.values())


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 6), (4, 8)])
def test_past_1f1b_the_bubbles_shrink_as_the_papers_say(p, m):
    """Equal stages, free links, F = 1 and B = 2 per stage (a split backward: 1 for the input, 1 for the weights):
    interleaved 1F1B's bubble is (p-1)/(2m+p-1) (Narayanan et al. 2021), ZB-H1's (p-1)(F+B-W) beside m(F+B+W)
    (Qi et al. 2024), and the V shapes' smaller still. Memory follows the action lists' peak in flight."""
    from helpers.pipeline.schedules import make_schedule, peak_in_flight, zero_bubble_h1_fraction

    sims = {}
    for name in ("1f1b", "interleaved", "zbh1", "zbv", "dualpipev"):
        v = 2 if name in ("interleaved", "zbv", "dualpipev") else 1
        work = Workload.from_lists([F / v] * (p * v), [B / v] * (p * v), params=[1] * (p * v),
                                   activations=[1024.0 / v] * (p * v))
        sims[name] = simulate(work, Job(name, batch=m, microbatches=m, pp=p))
        actions = make_schedule(name, p, m)
        assert sims[name].in_flight == {d: peak_in_flight(a) for d, a in enumerate(actions)}
        assert {d: mem.activations for d, mem in sims[name].memory.items()} == \
            {d: peak_in_flight(a) * 1024.0 / v for d, a in enumerate(actions)}
    assert sims["1f1b"].bubble == pytest.approx(bubble_fraction(p, m))
    assert sims["interleaved"].bubble == pytest.approx(bubble_fraction(p, m, chunks=2))
    assert sims["zbh1"].bubble == pytest.approx(zero_bubble_h1_fraction(p, m, F, B / 2, B / 2))
    assert sims["zbv"].step_s < sims["zbh1"].step_s < sims["interleaved"].step_s < sims["1f1b"].step_s
    assert sims["dualpipev"].step_s == sims["zbv"].step_s
    assert {e.kind for e in sims["zbh1"].events} == {"forward", "backward", "weight"}


def test_the_first_stage_defers_its_whole_backward_and_local_messages_are_free():
    """The first stage's input (token ids) needs no gradient: its B is empty and its W the whole backward. In the V
    the message from stage 1 to stage 2 stays on device 1: with a slow link, only boundaries 0 and 2 cost."""
    work = Workload.from_lists([F] * 4, [B] * 4, params=[1] * 4, output=[1.0] * 4)
    sim = simulate(work, Job("zbv", batch=4, microbatches=4, pp=2))
    assert not [e for e in sim.events if e.stage == 0 and e.kind == "backward"]  # empty tasks are left out
    assert {e.duration for e in sim.events if e.kind == "weight" and e.stage == 0} == {B}
    assert {e.duration for e in sim.events if e.kind == "weight" and e.stage != 0} == {B / 2}
    slow = Link(latency_s=0.0, bandwidth=1.0)  # one second per byte
    sends = [e for e in simulate(work, Job("zbv", batch=4, microbatches=4, pp=2), slow).events
             if e.kind == "send"]
    assert len(sends) == 2 * 4 * 2  # boundaries 0 and 2, each way, each micro-batch


@pytest.mark.parametrize("name", ["zbh1", "zbv"])
def test_batched_weight_passes_run_the_grouped_schedule_at_the_same_cost(name):
    """A job whose weight passes take two micro-batches at a time simulates `weights_in_groups`' action lists: the
    same weight seconds in all (a batched pass priced as its passes' sum), each W where its group's last stood,
    and more activations held at the peak (the deferred Ws keep theirs)."""
    from helpers.pipeline.schedules import make_schedule, peak_in_flight, weights_in_groups

    v = 2 if name == "zbv" else 1
    work = Workload.from_lists([F / v] * (2 * v), [B / v] * (2 * v), params=[1] * (2 * v),
                               activations=[1024.0 / v] * (2 * v))
    plain, batched = (simulate(work, Job(name, batch=8, microbatches=8, pp=2, batched_weights=k)) for k in (1, 2))
    weight_s = lambda sim: sum(e.duration for e in sim.events if e.kind == "weight")  # noqa: E731
    assert weight_s(batched) == pytest.approx(weight_s(plain))
    grouped = weights_in_groups(make_schedule(name, 2, 8), 2)
    assert batched.in_flight == {d: peak_in_flight(a) for d, a in enumerate(grouped)}
    assert max(batched.in_flight.values()) > max(plain.in_flight.values())


def test_a_batched_weight_gradient_pays_on_a_gpu_only_below_its_ridge():
    """The roofline's price of one linear layer's weight gradient over two micro-batches (Llama-3-8B's MLP,
    4096 x 14336, bf16, an RTX 3090): one product over the stacked rows is cheaper where a micro-batch has few rows
    (the product memory-bound: reading and writing the 4096 x 14336 gradient dominates), dearer where it has many
    (compute-bound: the same FLOPs, plus the copy that stacks the rows)."""
    from helpers.simulate.roofline import weight_gradient_s

    few, many = (weight_gradient_s("RTX 3090", rows, 4096, 14336, 2) for rows in (64, 2048))
    assert few[1] < 0.8 * few[0]
    assert many[0] < many[1] < 1.1 * many[0]


def test_a_split_backward_pays_its_measured_overhead_in_the_weight_pass():
    """Workload.split_overhead (measured by calibrate.split_backward_overhead): every weight pass of a stage whose
    input needs a gradient costs that share of the stage's backward more; the first stage's weight pass (its whole
    backward, one autograd call) and every schedule without split backwards cost the same as before."""
    from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
    from helpers.simulate.calibrate_model import split_backward_overhead

    work = Workload.from_lists([F] * 4, [B] * 4, params=[1] * 4, output=[1.0] * 4)
    costly = replace(work, split_overhead=0.25)
    base, split = (simulate(w, Job("zbv", batch=4, microbatches=4, pp=2)) for w in (work, costly))
    assert {e.duration for e in split.events if e.kind == "weight" and e.stage == 0} == {B}
    assert {e.duration for e in split.events if e.kind == "weight" and e.stage != 0} == {B / 2 + 0.25 * B}
    assert split.step_s > base.step_s
    assert simulate(costly, Job("1f1b", batch=4, microbatches=4)).step_s == \
        simulate(work, Job("1f1b", batch=4, microbatches=4)).step_s
    with pytest.raises(ValueError, match="overhead"):
        replace(work, split_overhead=-0.1)
    cfg = StackConfig(hidden=32, n_blocks=2, seq_len=8, vocab=32)
    x, y = SyntheticTokens(2, cfg.seq_len, cfg.vocab).batch(0, 2)
    model = build_stack(cfg)
    overhead = split_backward_overhead(model, x, y, lm_loss, rounds=3)
    assert overhead >= 0 and math.isfinite(overhead) and all(p.grad is None for p in model.parameters())


def test_a_receive_posted_after_its_rank_computed_delays_what_needs_it():
    """`Link.receive_s`: posting a receive costs the receiving device's thread that long, in its own order. Posted
    while the device waits anyway (its first receive, the naive split's), it hides; posted right after computing,
    with the message already there, it delays the work that needs the message."""
    r = 0.25
    link = Link(0.0, math.inf, receive_s=r)
    naive = simulate(equal_stages(2), Job("naive", batch=1), link)
    assert naive.step_s == 2 * (F + B)
    gpipe = simulate(equal_stages(2), Job("gpipe", batch=2, microbatches=2), link)
    # stage 2's second forward waits for its post (the message arrived meanwhile); stage 1's second backward too
    assert gpipe.step_s == 3 * (F + B) + 2 * r
    posts = [e for e in gpipe.events if e.kind == "recv"]
    assert sorted(e.device for e in posts) == [0, 0, 1, 1] and all(e.end - e.start == r for e in posts)
    assert not any(e.kind == "recv" for e in simulate(equal_stages(2), Job("gpipe", batch=2, microbatches=2),
                                                      Link(0.0, math.inf)).events)
    with pytest.raises(ValueError, match="posting"):
        Link(0.0, 1e9, receive_s=-1.0)


def test_the_rig_calibration_refuses_a_model_that_is_not_a_layer_stack_before_any_rank_starts():
    from helpers.runtime.rig import detect_rig
    from helpers.simulate.calibrate import process_calibration

    with pytest.raises(ValueError, match="stack of layers"):
        process_calibration(detect_rig(), torch.nn.Linear(4, 4), torch.zeros(2, 4), torch.zeros(2), None, [1024])


def test_naive_two_stages_is_twice_one_stage():
    sim = simulate(equal_stages(2), Job("naive", batch=1))
    assert sim.step_s == 2 * (F + B)
    assert sim.bubble == 0.5


def test_link_adds_exactly_its_messages_on_the_critical_path():
    latency, bandwidth, sent = 0.125, 1e6, 250_000.0  # one message: 0.125 + 0.25 s, shorter than F and B
    c = latency + sent / bandwidth
    link = Link(latency, bandwidth)
    work = equal_stages(2, output=sent)
    # naive: activation across, gradient back, nothing overlaps
    assert simulate(work, Job("naive", batch=1), link).step_s == 2 * (F + B) + 2 * c
    # GPipe m=2: the first activation and the last gradient are exposed, the others hide behind compute
    assert simulate(work, Job("gpipe", batch=2, microbatches=2), link).step_s == 3 * (F + B) + 2 * c
    # messages scale with the micro-batch's samples: 2 samples per micro-batch send twice the bytes
    big = simulate(work, Job("naive", batch=2), link)
    assert big.step_s == pytest.approx(2 * 2 * (F + B) + 2 * (latency + 2 * sent / bandwidth))


def test_unbalanced_cut_is_bounded_by_the_slowest_stage():
    work = Workload.from_lists([F, F, F], [B, B, B])
    sim = simulate(work, Job("gpipe", batch=4, microbatches=4, boundaries=(1,)))  # stage 1 holds two layers
    assert sim.step_s == (F + B) + 4 * 2 * (F + B)
    with pytest.raises(ValueError, match="increasing first-layer indices"):
        simulate(work, Job("gpipe", batch=4, microbatches=4, boundaries=(3,)))


def test_checkpointing_recomputes_the_forward_and_holds_only_inputs():
    work = equal_stages(2, activations=1000.0, output=10.0)
    sim = simulate(work, Job("gpipe", batch=4, microbatches=4, activation_checkpointing=True))
    assert sim.step_s == 5 * (F + F + B)
    # stage 0 holds nothing of its (only) layer's input, stage 1 the 10 bytes it received; + one recompute
    assert [m.activations for m in sim.memory.values()] == [1000.0, 4 * 10.0 + 1000.0]
    assert sum(e.kind == "recompute" for e in sim.events) == 8


def test_checkpointing_chosen_layers_recomputes_only_those():
    work = Workload.from_lists([F] * 4, [B] * 4, activations=[1000.0] * 4, output=[10.0] * 4)
    sim = simulate(work, Job("gpipe", batch=2, microbatches=2, boundaries=(2,), activation_checkpointing=(1, 3)))
    # each stage recomputes one layer's forward per micro-batch: (m + p - 1) slots of 2F + F + 2B
    assert sim.step_s == 3 * (3 * F + 2 * B)
    # a checkpointed layer keeps its 10-byte input instead of its 1000 bytes; one recompute's worth is transient
    assert [m.activations for m in sim.memory.values()] == [2 * (1000 + 10) + 1000, 2 * (10 + 1000) + 1000]
    everything = simulate(work, Job("gpipe", batch=2, microbatches=2, boundaries=(2,), activation_checkpointing=(0, 1, 2, 3)))
    assert everything.step_s == \
        simulate(work, Job("gpipe", batch=2, microbatches=2, boundaries=(2,), activation_checkpointing=True)).step_s
    assert simulate(work, Job("gpipe", batch=2, microbatches=2, activation_checkpointing=())).step_s == 3 * 2 * (F + B)
    with pytest.raises(ValueError, match="indices of the workload's 4 layers"):
        simulate(work, Job("gpipe", batch=2, microbatches=2, activation_checkpointing=(4,)))
    with pytest.raises(ValueError, match="tuple of layer indices"):
        Job("gpipe", batch=2, microbatches=2, activation_checkpointing=[1])


# --- devices sharing cores (the CPU rig) ----------------------------------------------------------------------------

def test_shared_cores_divide_fairly_and_slow_when_both_busy():
    work = Workload.from_lists([F] * 2, [B] * 2)
    ddp = Job("ddp", batch=2)
    alone = simulate(work, ddp).step_s
    assert alone == 2 * (F + B)
    # a core per device and no slowdown: the same step as devices of their own
    assert simulate(work, ddp, cores=SharedCores(2)).step_s == pytest.approx(alone, rel=1e-12)
    # both devices busy the whole step: 1.25x slower
    assert simulate(work, ddp, cores=SharedCores(2, 1.25)).step_s == pytest.approx(1.25 * alone, rel=1e-12)
    # two replicas on one core take turns: twice the time
    assert simulate(work, ddp, cores=SharedCores(1)).step_s == pytest.approx(2 * alone, rel=1e-12)
    # DP x PP's four devices on two cores: all four always have work (1F1B, m = 8 >> p), so ~2x, never less
    dpp = simulate(work, Job("dp_x_pp", batch=16, microbatches=8), cores=SharedCores(2)).step_s
    free = simulate(work, Job("dp_x_pp", batch=16, microbatches=8)).step_s
    assert 1.6 * free < dpp <= 2 * free + 1e-9


def test_shared_cores_slow_only_what_overlaps():
    # naive split: one stage computes at a time, so busy-core slowdown never applies
    naive = Job("naive", batch=1)
    work = equal_stages(2)
    assert simulate(work, naive, cores=SharedCores(2, 1.5)).step_s == pytest.approx(2 * (F + B), rel=1e-12)
    # GPipe m=2, p=2: of its 3 slots of F and of B the middle one has both stages busy
    gpipe = simulate(work, Job("gpipe", batch=2, microbatches=2), cores=SharedCores(2, 1.5))
    assert gpipe.step_s == pytest.approx(2 * F + 1.5 * F + 2 * B + 1.5 * B, rel=1e-12)
    # links are not cores: a message costs the same
    link = Link(0.125, 1e6)
    sent = simulate(equal_stages(2, output=1e5), naive, link, cores=SharedCores(2, 1.5)).step_s
    assert sent == pytest.approx(2 * (F + B) + 2 * link.seconds(1e5), rel=1e-12)
    with pytest.raises(ValueError, match="slowdown"):
        SharedCores(2, 0.5)
    with pytest.raises(ValueError, match="core count"):
        SharedCores(0)


def test_collective_link_fitted_from_all_reduce_times():
    latency, bandwidth = 2e-4, 1e9  # a measured all-reduce of n bytes: latency + n / bandwidth
    sizes = [2**k for k in range(12, 26, 2)]
    link = fit_collective_link(sizes, [latency + n / bandwidth for n in sizes])
    for n in sizes:
        assert allreduce_s(link, n, 2) == pytest.approx(latency + n / bandwidth, rel=1e-9)
        assert allgather_s(link, n, 2) == pytest.approx((latency + n / bandwidth) / 2, rel=1e-9)
    point = Link(1.0, 1.0)  # simulate() uses it for sends, `collective_link` for the all-reduce
    work = Workload.from_lists([F] * 2, [B] * 2, params=[MiB // 4] * 2)
    sim = simulate(work, Job("ddp", batch=2, bucket_mb=100, first_bucket_mb=100), point, collective_link=link)
    assert sim.step_s == pytest.approx(2 * (F + B) + latency + 2 * MiB / bandwidth, rel=1e-9)
    with pytest.raises(ValueError, match="at least 2 devices"):
        fit_collective_link(sizes, [1.0] * len(sizes), devices=1)


def test_measured_collectives_replace_the_ring():
    lines = {"allreduce": (2e-4, 1e9), "allgather": (2e-4, 1e9), "reducescatter": (3e-4, 0.5e9),
             "broadcast": (1e-4, 2e9)}
    sizes = [2**k for k in range(12, 26, 2)]
    coll = fit_collectives({k: (sizes, [lat + n / bw for n in sizes]) for k, (lat, bw) in lines.items()})
    for kind, (lat, bw) in lines.items():
        assert collective_s(coll, kind, MiB, 2) == pytest.approx(lat + MiB / bw, rel=1e-9)
    assert collective_s(coll, "broadcast", MiB, 2, messages=3) == pytest.approx(3e-4 + MiB / 2e9, rel=1e-9)
    ring = Link(1e-4, 1e9)  # a Link keeps the ring's costs
    assert collective_s(ring, "allgather", MiB, 2) == allgather_s(ring, MiB, 2)
    assert collective_s(ring, "broadcast", MiB, 2, 3) == broadcast_s(ring, MiB, 2, 3) == pytest.approx(3e-4 + MiB / 1e9)
    # FSDP2 with measured collectives: nothing to hide behind when compute is free, so the step is all collectives
    work = Workload.from_lists([1e-9] * 2, [1e-9] * 2, params=[MiB // 4] * 2)
    sim = simulate(work, Job("zero2", batch=2), collective_link=coll)
    gathers, scatters = 2 * collective_s(coll, "allgather", MiB, 2), 2 * collective_s(coll, "reducescatter", MiB, 2)
    assert sim.step_s >= max(gathers, scatters)
    with pytest.raises(ValueError, match="measured over 2 devices"):
        coll.seconds("allreduce", MiB, 4)
    with pytest.raises(ValueError, match="no measurements of"):
        fit_collectives({"allreduce": (sizes, sizes)})


def test_rescaled_workload_keeps_the_profile_shape():
    work = Workload.from_lists([1.0, 3.0], [2.0, 6.0])
    scaled = work.rescaled(8.0, 4.0)
    assert [layer.forward_s for layer in scaled.layers] == [2.0, 6.0]
    assert [layer.backward_s for layer in scaled.layers] == [1.0, 3.0]
    with pytest.raises(ValueError, match="positive"):
        work.rescaled(0.0, 1.0)


def test_timeline_is_the_measured_format_and_plots_unchanged():
    sim = simulate(equal_stages(2, output=1e6), Job("1f1b", batch=4, microbatches=4), Link(1e-3, 1e9))
    assert all(isinstance(e, Event) for e in sim.events)
    assert {e.kind for e in sim.events} == {"forward", "backward", "send"}
    assert sum(e.kind == "forward" for e in sim.events) == 8
    ax = plot_timeline(sim.events)
    assert len(ax.patches) == len(sim.events)
    drawn = sim.plot()  # the same bars, under the simulated job's title
    assert len(drawn.patches) == len(sim.events) and drawn.get_title() == f"simulated: {sim.job.label()}"


# --- data parallelism -----------------------------------------------------------------------------------------------

LAYERS, PARAMS = 4, MiB // 4  # fp32 + Adam: 1 MiB of gradients per layer


def ddp_workload(optimizer_s: float = 0.0) -> Workload:
    return Workload.from_lists([F] * LAYERS, [B] * LAYERS, params=[PARAMS] * LAYERS, optimizer_s=optimizer_s)


def test_ddp_one_bucket_adds_the_whole_all_reduce():
    link = Link(0.05, MiB / 0.5)
    sim = simulate(ddp_workload(), Job("ddp", batch=2, bucket_mb=100, first_bucket_mb=100), link)
    assert sim.step_s == pytest.approx(LAYERS * (F + B) + allreduce_s(link, LAYERS * MiB, 2), rel=1e-12)
    assert allreduce_s(link, LAYERS * MiB, 2) == pytest.approx(2 * 0.05 + LAYERS * 0.5)


def test_ddp_buckets_hide_behind_backward_except_the_last():
    link = Link(0.05, MiB / 0.5)  # a 1 MiB bucket takes 0.6 s < one layer's backward
    sim = simulate(ddp_workload(), Job("ddp", batch=2, bucket_mb=1, first_bucket_mb=1), link)
    assert sim.step_s == pytest.approx(LAYERS * (F + B) + allreduce_s(link, MiB, 2), rel=1e-12)
    assert sum(e.kind == "allreduce" for e in sim.events if e.device == 0) == LAYERS
    # gradient accumulation: no communication until the last micro-batch
    acc = simulate(ddp_workload(), Job("ddp", batch=8, microbatches=4, bucket_mb=1, first_bucket_mb=1), link)
    assert acc.step_s == pytest.approx(4 * LAYERS * (F + B) + allreduce_s(link, MiB, 2), rel=1e-12)
    assert sum(e.kind == "allreduce" for e in acc.events if e.device == 0) == LAYERS


def test_ddp_default_buckets_follow_pytorch():
    link = Link(1e-6, 1e12)
    sim = simulate(Workload.from_lists([F] * 3, [B] * 3, params=[3 * MiB] * 3), Job("ddp", batch=2), link)
    # a 2-device all-reduce of n bytes takes 2 * latency + n / bandwidth: read each bucket's size off its duration
    sizes = [round((e.duration - 2 * link.latency_s) * link.bandwidth) for e in sim.events
             if e.device == 0 and e.kind == "allreduce"]
    assert sizes == [MiB, 25 * MiB, 10 * MiB]  # 36 MiB of fp32 gradients: 1 MiB first, then 25 MiB buckets


def test_ddp_gradients_sent_in_bf16_cross_in_half_the_bytes_and_pay_two_casts():
    link = Link(0.05, MiB / 0.5)
    job = Job("ddp", batch=2, bucket_mb=100, first_bucket_mb=100, wire="bf16")
    free = simulate(ddp_workload(), job, link)  # copies cost nothing unless the rig's copy speed is given
    assert free.step_s == pytest.approx(LAYERS * (F + B) + allreduce_s(link, LAYERS * MiB / 2, 2), rel=1e-12)
    assert simulate(ddp_workload(), replace(job, wire="fp32"), link).step_s == pytest.approx(
        simulate(ddp_workload(), replace(job, wire="auto"), link).step_s)  # fp32 gradients: nothing cast
    # with copies at 1 MiB per 0.1 s: each layer's 1 MiB of gradients cast in the backward (+0.1 s each) and the
    # reduced 4 MiB bucket copied back (+0.4 s), against the all-reduce's 2 MiB fewer (-1.0 s)
    costly = replace(ddp_workload(), copy_bandwidth=MiB / 0.1)
    assert simulate(costly, job, link).step_s - simulate(costly, replace(job, wire="auto"), link).step_s == \
        pytest.approx(LAYERS * 0.1 + LAYERS * 0.1 - 1.0)
    with pytest.raises(ValueError, match="wire"):
        Job("ddp", batch=2, wire="int8")


def test_zero1_shards_the_optimizer_and_broadcasts_the_weights():
    link = Link(0.05, MiB / 0.5)
    sim = simulate(ddp_workload(optimizer_s=1.0), Job("zero1", batch=2, bucket_mb=1, first_bucket_mb=1), link)
    # PyTorch's ZeroRedundancyOptimizer: each owner broadcasts its parameters, tensor by tensor, in turn: every
    # byte crosses once, one latency per tensor (here one tensor per layer)
    assert sim.step_s == pytest.approx(LAYERS * (F + B) + allreduce_s(link, MiB, 2) + 1.0 / 2
                                       + LAYERS * (0.05 + 0.5), rel=1e-12)
    two = Workload.from_lists([F] * LAYERS, [B] * LAYERS, params=[PARAMS] * LAYERS, optimizer_s=1.0)
    two = replace(two, layers=tuple(replace(layer, tensors=2) for layer in two.layers))  # weight and bias
    sim2 = simulate(two, Job("zero1", batch=2, bucket_mb=1, first_bucket_mb=1), link)
    assert sim2.step_s == pytest.approx(sim.step_s + LAYERS * 0.05, rel=1e-12)
    n = LAYERS * PARAMS
    assert sim.memory[0].params == 4 * n and sim.memory[0].grads == 4 * n and sim.memory[0].optimizer == 8 * n / 2
    ddp = simulate(ddp_workload(optimizer_s=1.0), Job("ddp", batch=2), link)
    assert ddp.memory[0].optimizer == 8 * n


def test_fsdp2_hides_its_collectives_when_they_are_shorter_than_compute():
    link = Link(0.0, MiB / 0.4)  # a 1 MiB layer of fp32 weights: all-gather 0.2 s, reduce-scatter 0.2 s
    sim = simulate(ddp_workload(optimizer_s=1.0), Job("fsdp2", batch=2), link)
    gather, scatter = allgather_s(link, MiB, 2), reducescatter_s(link, MiB, 2)
    assert gather == scatter == 0.2
    # first layer's all-gather, all forward compute, the last layer's gather again (FSDP2 reshards every unit but
    # the root after forward, so backward starts by regathering: torchtitan keeps its last block gathered for this
    # reason), all backward compute, the first layer's reduce-scatter, the sharded optimizer step
    assert sim.step_s == pytest.approx(2 * gather + LAYERS * (F + B) + scatter + 1.0 / 2, rel=1e-12)
    # forward gathers every layer, backward again, reduce-scatter per layer
    kinds = [e.kind for e in sim.events if e.device == 0]
    assert kinds.count("allgather") == 2 * LAYERS and kinds.count("reducescatter") == LAYERS
    n = LAYERS * PARAMS
    assert sim.memory[0].params == 4 * (n / 2 + 2 * PARAMS)  # shard + two gathered layers
    assert sim.memory[0].optimizer == 8 * n / 2


def test_fsdp2_forward_waits_for_all_gathers_slower_than_compute():
    link = Link(0.0, MiB / 3.0)  # all-gather 1.5 s > F
    sim = simulate(ddp_workload(), Job("fsdp2", batch=2), link)
    gather = allgather_s(link, MiB, 2)
    forwards = [e for e in sim.events if e.device == 0 and e.kind == "forward"]
    assert forwards[-1].end == pytest.approx(LAYERS * gather + F)
    kept = simulate(ddp_workload(), Job("zero2", batch=2), link)
    assert [e.kind for e in kept.events if e.device == 0].count("allgather") == LAYERS
    assert kept.memory[0].params == 4 * (LAYERS * PARAMS / 2 + LAYERS * PARAMS)


def test_fsdp2_without_forward_prefetch_exposes_every_forward_gather():
    link = Link(0.0, MiB / 0.4)  # all-gather 0.2 s per layer, shorter than F: hidden with prefetch, not without
    gather = allgather_s(link, MiB, 2)
    hidden = simulate(ddp_workload(), Job("fsdp2", batch=2), link)
    exposed = simulate(ddp_workload(), Job("fsdp2", batch=2, forward_prefetch=False), link)
    assert exposed.step_s == pytest.approx(hidden.step_s + (LAYERS - 1) * gather, rel=1e-12)


def test_fsdp2_collectives_that_hold_the_host_overlap_nothing():
    # the CPU rig: FSDP2 waits for every all-gather and reduce-scatter in the thread that computes, so a step is
    # the sum of its parts: LAYERS gathers in forward, LAYERS again in backward, LAYERS reduce-scatters (on a ring
    # as long as a gather), and the compute
    link = Link(0.0, MiB / 0.4)
    sim = simulate(ddp_workload(), Job("fsdp2", batch=2, forward_prefetch=False, host_waits=True), link)
    gather = allgather_s(link, MiB, 2)
    assert sim.step_s == pytest.approx(LAYERS * (F + B) + 3 * LAYERS * gather, rel=1e-12)
    overlapped = simulate(ddp_workload(), Job("fsdp2", batch=2, forward_prefetch=False), link)
    assert overlapped.step_s < sim.step_s


def test_fsdp2_host_work_adds_to_every_collective_where_the_host_computes():
    link = Link(0.0, MiB / 0.4)
    job = Job("fsdp2", batch=2, forward_prefetch=False, host_waits=True)
    bare = simulate(ddp_workload(), job, link)
    sim = simulate(ddp_workload(), replace(job, fsdp2_host_s=0.01), link)
    assert sim.step_s == pytest.approx(bare.step_s + 3 * LAYERS * 0.01, rel=1e-12)
    assert [e.kind for e in sim.events if e.device == 0].count("host") == 3 * LAYERS
    # a host that runs ahead of its device (GPUs) does this work beside the compute: only the first gather's, with
    # nothing before it to hide behind, shows
    ahead = simulate(ddp_workload(), replace(job, host_waits=False, fsdp2_host_s=0.01), link)
    assert ahead.step_s == pytest.approx(simulate(ddp_workload(), replace(job, host_waits=False), link).step_s
                                         + 0.01, rel=1e-12)
    with pytest.raises(ValueError, match="host work per collective"):
        Job("fsdp2", batch=2, fsdp2_host_s=-1.0)


def test_data_parallel_engines_copy_gradients_and_parameters_on_the_device():
    work = replace(ddp_workload(), copy_bandwidth=MiB / 0.125)  # copying 1 MiB takes 0.125 s
    link = Link(0.0, 1e15)
    copies = simulate(work, Job("ddp", batch=2, bucket_mb=100, first_bucket_mb=100, bucket_views=False), link)
    # PyTorch's default DDP: each layer's backward copies its 1 MiB of gradients into the bucket and divides it (2
    # passes); after the all-reduce the bucket is copied back into the gradients (1 pass over all of them)
    assert copies.step_s == pytest.approx(LAYERS * (F + B) + LAYERS * 2 * 0.125 + LAYERS * 0.125, rel=1e-9)
    # apply_ddp's gradients are views of the buckets: only the hook's division is left
    ddp = simulate(work, Job("ddp", batch=2, bucket_mb=100, first_bucket_mb=100), link)
    assert ddp.step_s == pytest.approx(LAYERS * (F + B) + LAYERS * 0.125, rel=1e-9)
    free = simulate(ddp_workload(), Job("zero2", batch=2), link)
    fsdp = simulate(work, Job("zero2", batch=2), link)
    # per layer: shard in (half a MiB) and parameters out (1 MiB) before its forward, gradients in (1 MiB) after its
    # backward; all on the critical path when the links are this fast
    assert fsdp.step_s == pytest.approx(free.step_s + LAYERS * (0.0625 + 0.125 + 0.125), rel=1e-9)
    with pytest.raises(ValueError, match="copy bandwidth"):
        replace(ddp_workload(), copy_bandwidth=0.0)


def test_dp_x_pp_runs_a_pipeline_per_replica_then_all_reduces_each_stage():
    link = Link(0.0, MiB / 0.5)
    sim = simulate(ddp_workload(), Job("dp_x_pp", batch=8, microbatches=2, pp=2, dp=2,
                                       schedule="gpipe"), link)
    per_stage = 2 * F * 2, 2 * B * 2  # two layers per stage, two samples per micro-batch
    stage_grads = 2 * MiB
    assert sim.step_s == pytest.approx(3 * sum(per_stage) + allreduce_s(link, stage_grads, 2), rel=1e-12)
    assert sorted(sim.memory) == [0, 1, 2, 3]
    assert {e.device for e in sim.events if e.kind == "allreduce"} == {0, 1, 2, 3}


def test_single_device_and_memory_without_timing():
    work = ddp_workload(optimizer_s=0.5)
    sim = simulate(work, Job("single", batch=4, microbatches=2))
    assert sim.step_s == 2 * 2 * LAYERS * (F + B) + 0.5
    assert sim.busy == {0: 1.0}
    for job in (Job("fsdp2", batch=4, microbatches=2), Job("1f1b", batch=4, microbatches=2, activation_checkpointing=True)):
        assert simulate_memory(work, job) == simulate(work, job).memory


# --- bad input ------------------------------------------------------------------------------------------------------

def test_bad_input_is_refused_in_the_users_terms():
    with pytest.raises(ValueError, match="forward cost must be a positive"):
        Workload.from_lists([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="backward cost must be a positive"):
        Workload.from_lists([1.0], [-1.0])
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        Link(1e-6, 0.0)
    with pytest.raises(ValueError, match="latency must be finite and >= 0"):
        Link(-1e-6, 1e9)
    with pytest.raises(ValueError, match="micro-batch count must be a whole number >= 1"):
        Job("gpipe", batch=4, microbatches=0)
    with pytest.raises(ValueError, match="global batch 30 is not divisible by 4 micro-batches"):
        Job("gpipe", batch=30, microbatches=4)
    with pytest.raises(ValueError, match="global batch 6 is not divisible by 2 replicas x 4 micro-batches"):
        Job("ddp", batch=6, microbatches=4)
    with pytest.raises(ValueError, match="unknown strategy"):
        Job("tensor", batch=2)
    with pytest.raises(ValueError, match="m=2 < p=4"):
        simulate(equal_stages(4), Job("1f1b", batch=2, microbatches=2, pp=4))
    with pytest.raises(ValueError, match="known GPUs: A100 80GB SXM, RTX 3090, RTX 3090 Ti, RTX 4090"):
        gpu_named("RTX 5090")
    with pytest.raises(ValueError, match="known rigs: 2x3090 NVLink"):
        target_rig("8xH100")
    with pytest.raises(ValueError, match="at least two different message sizes"):
        fit_link([1e6, 1e6], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        simulate(equal_stages(2), Job("gpipe", batch=1, pp=3))


# --- hardware -------------------------------------------------------------------------------------------------------

def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [2**k for k in range(10, 28, 3)]
    link = fit_link(sizes, [15e-6 + s / 11e9 for s in sizes])
    assert link.latency_s == pytest.approx(15e-6, rel=1e-6) and link.bandwidth == pytest.approx(11e9, rel=1e-9)
    noisy = fit_link([0, 1e6, 2e6], [1e-6, 1.0e-4, 2.1e-4])  # intercept < 0: clamped, slope through the origin
    assert noisy.latency_s == 0.0 and noisy.bandwidth > 0


def test_hardware_data_keeps_its_keys_and_cites_originals():
    hw = load_data("hardware")
    assert hw["gpus"]["RTX 3090"]["memory_gb"] == 24
    for key in ("3090_gpu_to_gpu_no_p2p", "3090_nvlink_bridge_effective"):
        assert {"gb_s_per_direction", "estimate", "source"} <= set(hw["links"][key])
    text = str(hw)
    assert "REFERENCE.md" not in text
    rigs = {name: target_rig(name) for name in target_rigs()}
    assert {"2x3090 PCIe", "2x3090 NVLink", "2x4090", "2xA100"} <= set(rigs)
    assert rigs["2x3090 PCIe"].link.bandwidth == pytest.approx(11.28e9)
    assert rigs["2x3090 PCIe"].gpu.capacity_bytes == 24268 * 2**20  # as CUDA reports it (data/inference.json)
    assert rigs["2x3090 NVLink"].link.bandwidth > rigs["2x3090 PCIe"].link.bandwidth


def test_one_gpu_description_for_the_planners_and_the_simulator():
    """The simulator's GPU is the planners' (helpers.sizing.gpus.Gpu): one capacity (as CUDA reports it), one
    runtime reserve, the specification's bandwidth and the sustained rates of data/hardware.json; a GPU given only by
    its size has no rates, and the roofline says so instead of guessing."""
    card = gpu("RTX 3090")
    assert gpu_named("RTX 3090") == card == target_rig("2x3090 PCIe").gpu
    assert card.usable_bytes == card.capacity_bytes - runtime_reserve_bytes()
    assert (card.bandwidth_gb_s, card.memory_bandwidth, card.flops("bf16")) == (936, 798e9, 76.5e12)
    with pytest.raises(ValueError, match="no sustained 'fp16' matmul figure"):
        gpu("24GiB").flops("fp16")


def test_flops_counted_on_meta_match_the_transformer_formula():
    b, s, h, heads = 2, 64, 128, 4
    model = build_hf_model("gpt2", 1, h, heads, 256, s, 4 * h, meta=True)
    counts = layer_flops(hf_layers(model), torch.zeros(b, s, dtype=torch.long))
    forward, backward = counts[1]  # the block
    assert forward == (24 * b * s * h * h + 4 * b * s * s * h) / b  # per sample
    assert backward == 2 * forward
    assert counts[0] == (0, 0)  # an embedding is a lookup


def test_roofline_takes_the_lower_roof():
    gpu = gpu_named("RTX 3090")
    work = Workload.from_lists([1.0, 1.0], [1.0, 1.0], activations=[0.0, 4e9], output=[0.0, 0.0])
    scaled = on_gpu(work, [(1e12, 2e12), (1.0, 2.0)], gpu, "bf16")
    compute, memory = scaled.layers
    matmul = efficiency().matmul  # real layers' matmuls reach this share of the sustained large-matmul rate
    assert compute.forward_s == pytest.approx(1e12 / (gpu.flops("bf16") * matmul))
    assert compute.backward_s == pytest.approx(2 * compute.forward_s)
    assert memory.activations == 2e9  # fp32 bytes measured here -> bf16 there
    assert memory.forward_s == 2e9 / gpu.memory_bandwidth and memory.backward_s == 2 * memory.forward_s


def test_workload_from_a_profile_is_per_sample():
    profile = Profile((LayerProfile("a", 0.4, 0.8, 4000, 800, 80), LayerProfile("b", 0.2, 0.4, 0, 400, 40)), "cpu", 4)
    work = Workload.from_profile(profile)
    assert work.layers[0].forward_s == 0.1 and work.layers[0].params == 1000 and work.layers[1].output == 10
    assert simulate(work, Job("single", batch=4)).step_s == pytest.approx(sum(profile.costs("time")))


# --- decision guide -------------------------------------------------------------------------------------------------

def test_attention_scores_counted_only_where_stored():
    s, h, a = 1024, 1024, 16
    assert transformer_activation_bytes(1, s, h, 1, a, attention="sdpa") == 34 * s * h
    assert transformer_activation_bytes(1, s, h, 1, a, attention="flash") == 34 * s * h
    # the memory module's formula is the one switch: eager (the default) keeps the 5*a*s/h score term
    assert transformer_activation_bytes(2, s, h, 3, a) == 3 * 2 * s * h * (34 + 5 * a * s // h)
    assert transformer_activation_bytes(2, s, h, 3, a, attention="sdpa") == 3 * 2 * s * h * 34
    assert transformer_activation_bytes(2, s, h, 3, a, 4, "flash") == 2 * 3 * 2 * s * h * 34
    with pytest.raises(ValueError, match="unknown attention implementation"):
        transformer_activation_bytes(1, s, h, 1, a, attention="linear")


def test_guide_recommends_ddp_for_a_model_that_fits_and_is_fair():
    rec = recommend_model("GPT-2 medium")  # 0.36 B parameters: notebook 07 trains it with DDP
    assert 0.3e9 < rec.n_params < 0.4e9
    assert rec.choice == "DDP"
    assert all(o.fits for o in rec.options)
    big = recommend_model("GPT-2 medium", batch=64)  # too many activations for one batch: DDP accumulates
    ddp = big.options[0]
    assert ddp.job.strategy == "ddp" and ddp.fits and (ddp.job.microbatches > 1 or ddp.job.activation_checkpointing)
    assert big.choice.startswith("DDP")


def test_guide_shards_what_does_not_fit_and_says_when_nothing_fits():
    xl = recommend_model("GPT-2 XL")  # 1.6 B: 16 bytes per parameter alone exceed a 3090
    assert not xl.options[0].fits and xl.choice and not xl.choice.startswith("DDP")
    llama = recommend_model("Llama-2 7B")
    assert not any(o.fits for o in llama.options) and llama.choice.startswith("does not fit")
    assert set(MODELS) >= {"GPT-2 small", "GPT-2 medium", "GPT-2 XL", "Llama-2 7B", "Llama-2 13B"}


def test_transformer_workload_counts_gpt2_parameters():
    work = transformer_workload(MODELS["GPT-2 small"], 1024, gpu_named("RTX 3090"))
    assert abs(work.n_params - 124.4e6) < 0.2e6  # GPT-2 small's published 124 M (head tied to the embedding)
    assert work.optimizer_s > 0 and len(work.layers) == 12 + 3


# --- playground and published checks -------------------------------------------------------------------------------

def test_playground_draws_once_without_a_frontend(capsys, monkeypatch):
    monkeypatch.setenv("LAB_STATIC_WIDGETS", "1")
    import matplotlib.pyplot as plt

    plt.close("all")
    sim = Playground().show()
    assert sim is not None and sim.job.strategy == "1f1b" and 0 < sim.bubble < 1
    assert "bubble" in capsys.readouterr().out and plt.get_fignums()
    assert Playground().draw(Knobs(pp=4, microbatches=2)) is None  # 1F1B needs m >= p: said, not raised
    assert "not a valid pipeline" in capsys.readouterr().out
    controls = Playground().controls()
    assert set(controls) == {"pp", "microbatches", "schedule", "imbalance", "bandwidth_gb_s", "latency_us",
                             "checkpointing"}
    slow = Playground().simulate(Knobs(imbalance=1.0))
    assert slow.step_s > Playground().simulate(Knobs()).step_s


def test_resnet50_from_its_convolution_shapes():
    work = resnet50_workload(224, gpu_named("RTX 3090"), "fp16", "fp32 + SGD")
    assert work.n_params == 25_557_032  # torchvision.models.resnet50()
    assert [layer.name for layer in work.layers] == ["stem", "layer1", "layer2", "layer3", "layer4", "pool + fc"]
    assert work.layers[2].output == 512 * 28 * 28 * 2  # layer2's output at 224 px, fp16: what the tutorial sends


def test_predictions_next_to_published_results_run():
    rows = predictions_vs_published()
    assert len(rows) >= 10
    for row in rows:
        assert math.isfinite(row["predicted"]) and row["predicted"] > 0 and row["source"]
        assert row["error"] == pytest.approx(row["predicted"] / row["published"] - 1)
    assert load_data("published")["lambda_2x3090_data_parallel"]["speedup"]["BERT-large"] in \
        [r["published"] for r in rows]



def test_recipes_are_the_memory_modules():
    assert Workload.from_lists([1.0], [1.0]).bytes_per_param == BYTES_PER_PARAM["fp32 + Adam"]
    assert FREE_LINK.seconds(1e12) == 0.0


def test_one_ddp_or_1f1b_answer_for_two_pcie_3090s_is_the_one_instructors_quotes():
    """Notebooks 08 and 10 print `ddp_or_pipeline()`'s sentence; INSTRUCTORS.md quotes it: the quote is the
    simulator's answer, and the flip it states is consistent (DDP's hidden step under the threshold, the whole
    all-reduce over it)."""
    from pathlib import Path

    from helpers.simulate.guide import ddp_or_pipeline

    answer = ddp_or_pipeline()
    assert answer.choice == "DDP" and answer.flips and answer.flipped.startswith("1F1B")
    assert answer.ddp_s - answer.one_gpu_s <= answer.flip_s < answer.allreduce_s
    instructors = " ".join((Path(__file__).resolve().parent.parent / "INSTRUCTORS.md").read_text().split())
    assert " ".join(answer.sentence().split()) in instructors, \
        f"INSTRUCTORS.md must quote the simulator's answer word for word: {answer.sentence()}"
    nvlink = ddp_or_pipeline(rig="2x3090 NVLink")  # notebook 08's exercise 1: the bridge keeps DDP either way
    assert nvlink.choice == nvlink.flipped == "DDP"


def test_the_guide_on_a_3090_beside_a_4090_deals_the_work_by_speed():
    """A mixed pair: the 4090 is faster on the model (its workload priced on each card), so DP gives it the larger
    share of the batch and a pipeline gives it more layers; the choice's step is faster than the same strategy
    dealt equally, which waits for the 3090; each card is held to its own memory."""
    rec = recommend_model("GPT-2 medium", "3090 + 4090 PCIe")
    assert rec.cards == ("RTX 3090", "RTX 4090") and rec.speeds[0] == 1.0 and rec.speeds[1] > 1.3
    for option in rec.options:
        if option.job.shares:
            assert option.job.shares[1] > option.job.shares[0] and sum(option.job.shares) == 16
        elif option.job.entry.pipeline:
            first, second = option.job.boundaries[0], option.n_layers - option.job.boundaries[0]
            assert second > first, option.split
    assert rec.chosen is not None and rec.chosen.step_s < rec.equal_step_s
    assert "RTX 4090" in rec.why() and rec.chosen.split in rec.why()
    equal = recommend_model("GPT-2 medium", "2x3090 PCIe")
    assert equal.why() == "" and all(o.split == "" for o in equal.options)


def test_plan_cli_guide_names_the_split_for_unequal_cards(capsys):
    from helpers.plan import main as plan_main

    plan_main(["--guide", "--model", "gpt2-medium", "--gpus", "RTX 3090, RTX 4090"])
    out = capsys.readouterr().out
    assert "3090 + 4090 PCIe" in out and "split by speed" in out and "choose:" in out and "dealt equally" in out
    with pytest.raises(SystemExit):
        plan_main(["--guide", "--model", "gpt2-medium", "--gpus", "RTX 3090 Ti, RTX 4090"])
    assert "no training rig of RTX 3090 Ti + RTX 4090" in capsys.readouterr().err
