import json
from dataclasses import replace

import pytest
import torch

from helpers.bench import bench_cut
from helpers.bench.cli import main as bench_main
from helpers.bench.predict import TARGET, microbatch_size, predict_row, simulation_job
from helpers.bench.report import BENCH_COLUMNS, EXTRA_COLUMNS, display_rows, legend, misses, timeline_name
from helpers.bench.jobs import default_config
from helpers.bench.rows import BenchRow, Progress
from helpers.catalog import BEYOND_1F1B, CATALOG, DATA_PARALLEL, DEEPSPEED
from helpers.simulate import FREE_LINK, Link, SharedCores, Workload
from helpers.simulate.calibrate import RigModel, links_from_samples
from helpers.simulate.calibrate_model import typical_slowdown
from helpers.hardware import Collectives

F, B = 0.25, 0.5  # per sample and layer: binary fractions, so every sum below is exact
BATCH = 16


def rig_model(slowdown: float = 1.0, link: Link = FREE_LINK) -> RigModel:
    free = Collectives(FREE_LINK, FREE_LINK, FREE_LINK, FREE_LINK)
    return RigModel(link, free, FREE_LINK, SharedCores(2, slowdown), SharedCores(2, slowdown))


def row(strategy: str, runner: str = "threads", m: int | None = 4, **kw) -> BenchRow:
    return BenchRow(strategy, "ours", runner, m, 1.0, [], [0, 0], **kw)


def test_prediction_of_a_pipeline_row_is_the_schedule_plus_the_callers_work():
    work = Workload.from_lists([F] * 4, [B] * 4)  # per sample; 2 stages of 2 layers
    r = row("gpipe", m=4, caller_s=0.125)
    sim = predict_row(r, work, rig_model(), BATCH, boundaries=[2])
    per_mb = (BATCH // 4) * 2 * (F + B)  # one stage's forward + backward of one micro-batch
    assert sim.step_s == (4 + 2 - 1) * per_mb
    assert r.predicted_s == sim.step_s + 0.125
    # both devices busy in the middle slots: a measured busy-core slowdown stretches exactly those
    slow = row("gpipe", m=4)
    predict_row(slow, work, rig_model(1.5), BATCH, boundaries=[2])
    assert slow.predicted_s == pytest.approx(2 * per_mb + 1.5 * 3 * per_mb, rel=1e-12)


def test_every_schedule_past_1f1b_runs_as_many_passes_a_device_as_1f1b_and_fills_its_stages():
    from helpers.bench.jobs import schedule_microbatches
    from helpers.catalog import BEYOND_1F1B
    from helpers.pipeline.schedules import chunks_of
    from helpers.runtime.rig import detect_rig

    rig = detect_rig(force_cpu=True)
    for mode in ("quick", "default", "precise"):
        config = default_config(mode, rig)
        for schedule in BEYOND_1F1B:
            m, chunks = schedule_microbatches(schedule, config), chunks_of(schedule)
            assert m >= 2 * chunks  # a micro-batch for every stage of the two devices
            if config.onefoneb_microbatches >= 4 * chunks:  # else the stages need more than 1F1B's passes
                assert m * chunks == config.onefoneb_microbatches, (mode, schedule)
    # the split backward's table sets ZB-H1 against 1F1B at the same micro-batches
    assert schedule_microbatches("zbh1", default_config("default", rig)) == 8


def test_every_kind_of_row_maps_to_a_simulated_job():
    assert microbatch_size(row("gpipe", m=8), 32) == 4
    assert microbatch_size(row("ddp", "processes", None), 32) == 16
    assert microbatch_size(row("dp_x_pp", "processes (4 ranks)", 4), 32) == 4
    assert microbatch_size(row("single", "one thread", None), 32) == 32
    jobs = {s: simulation_job(row(s, m=m), 32, [5]) for s, m in
            [("single", None), ("naive", 1), ("1f1b", 8), ("ddp", None), ("zero1", None), ("fsdp2", None),
             ("dp_x_pp", 4)]}
    assert jobs["naive"].strategy == "naive" and jobs["1f1b"].boundaries == (5,) and jobs["1f1b"].microbatches == 8
    assert jobs["ddp"].dp == 2 and jobs["dp_x_pp"].world == 4 and jobs["single"].world == 1
    work = Workload.from_lists([F] * 10, [B] * 10, params=[1000] * 10)
    for strategy, job in jobs.items():
        r = row(strategy, "processes", job.microbatches if strategy not in ("single", "ddp", "zero1", "fsdp2")
                else None, optimizer="adam" if strategy in ("ddp", "zero1", "fsdp2") else "none")
        predict_row(r, work, rig_model(), 32, [5], adam_s=0.5)
        assert r.predicted_s > 0
    # Adam on every rank: DDP pays a whole step of it, ZeRO-1 half
    ddp, zero1 = (row(s, "processes", None, optimizer="adam") for s in ("ddp", "zero1"))
    predict_row(ddp, work, rig_model(), 32, adam_s=0.5)
    predict_row(zero1, work, rig_model(), 32, adam_s=0.5)
    assert ddp.predicted_s - zero1.predicted_s == pytest.approx(0.25)


def test_rows_past_1f1b_cut_four_stages_of_equal_blocks_and_are_simulated():
    """Two stages per device: embedding + 2 blocks | 2 | 2 | 2 + head for the bench's 8 blocks, so each device
    holds 4 blocks whichever stages it gets (interleaved: 0 and 2; V: 0 and 3)."""
    assert bench_cut("1f1b", 10) == bench_cut("zbh1", 10) == bench_cut("single", 10) == bench_cut("ddp", 10) == (5,)
    assert bench_cut("interleaved", 10) == bench_cut("zbv", 10) == bench_cut("dualpipev", 10) == (3, 5, 7)
    assert bench_cut("zbv", 6) == (2, 3, 4)
    light = [1 / 8] + [1] * 8 + [1 / 8]  # embedding and head cost little beside a block
    work = Workload.from_lists([F * c for c in light], [B * c for c in light], params=[1000] * 10)
    for strategy in BEYOND_1F1B:
        r = row(strategy, "processes", 8)
        sim = predict_row(r, work, rig_model(), 32, bench_cut(strategy, 10))
        assert simulation_job(r, 32, bench_cut(strategy, 10)).layout.stages == 2 * (1 + (strategy != "zbh1"))
        assert 0 < r.predicted_s < predict_row(row("1f1b", "processes", 8), work, rig_model(), 32, [5]).step_s
        assert ("weight" in {e.kind for e in sim.events}) == (strategy != "interleaved")


def test_rows_carry_prediction_and_error_and_the_table_flags_misses():
    good, bad, off = row("gpipe", m=4), row("1f1b", m=4), row("dp_x_pp", "processes (4 ranks)", 2)
    good.predicted_s, bad.predicted_s, off.predicted_s = 1.0 / 1.05, 1.0 / 1.3, 0.5
    off.excluded = "4 ranks share 2 cores"
    dicts = [r.as_dict(BATCH, 2.0) for r in (good, bad, off)]
    assert dicts[0]["predicted_samples_per_s"] == pytest.approx(BATCH * 1.05)
    assert dicts[0]["error"] == pytest.approx(0.05) and dicts[1]["error"] == pytest.approx(0.3)
    assert "ideal_fraction" not in dicts[0]
    shown = display_rows(dicts)
    assert [s["error"] for s in shown] == ["+5.0%", "+30.0%*", "+100.0%*"]
    lines = misses(dicts)
    assert len(lines) == 2 and "outside the 15% target" in lines[0] and "4 ranks share 2 cores" in lines[1]


def test_timeline_names_are_plain():
    assert timeline_name(row("ddp", "processes", None)) == "timeline_ddp_ours_processes.png"
    compressed = row("ddp", "processes", None)
    compressed.wire = "bf16"  # DDP's two rows keep a timeline each
    assert timeline_name(compressed) == "timeline_ddp_ours_processes_bf16.png"
    assert timeline_name(row("dp_x_pp", "processes (4 ranks)", 2)) == "timeline_dp_x_pp_ours_processes-4-ranks_m2.png"
    batched = row("zbv", "processes", 4)
    batched.batched_weights = 2  # ZB-V's two rows on our engine keep a timeline each
    assert timeline_name(batched) == "timeline_zbv_ours_processes_m4_w2.png"


def test_links_fitted_from_link_benchmark_samples():
    from helpers.pipeline.comm import LinkSample

    sizes = [4096 * 4**k for k in range(5)]
    samples = [LinkSample("processes: point-to-point (gloo)", n, 1e-4 + n / 2e9) for n in sizes]
    samples += [LinkSample("processes: all-reduce (gloo)", n, 2e-4 + n / 1e9) for n in sizes]
    p2p, allreduce, threads = links_from_samples(samples)
    assert p2p.latency_s == pytest.approx(1e-4) and p2p.bandwidth == pytest.approx(2e9)
    assert allreduce.seconds(1e6) == pytest.approx(2e-4 + 1e6 / 1e9)
    assert threads.seconds(1e9) == 0.0  # CPU threads hand tensors over in memory
    with pytest.raises(ValueError, match="no point-to-point or all-reduce"):
        links_from_samples(samples[:5])


def test_timings_keep_their_samples_and_the_spread_is_half_the_interquartile_range():
    from helpers.measure import Timings, interleaved_medians, relative_spread

    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 2 / 3.0)
    assert relative_spread([1.0]) is None
    t = Timings({"a": [3.0, 1.0, 2.0]})
    assert t == {"a": 2.0} and t.samples["a"] == [3.0, 1.0, 2.0]
    assert t.spread("a") == pytest.approx(relative_spread([3.0, 1.0, 2.0]))
    seen = []
    timed = interleaved_medians({"x": lambda: seen.append("x"), "y": lambda: None}, repeats=3,
                                after={"x": lambda: seen.append("read")})
    assert set(timed) == {"x", "y"} and all(len(v) == 3 for v in timed.samples.values())
    assert seen == ["x"] + ["x", "read"] * 3  # after each timed call, not after the warm-up


def test_a_miss_is_printed_with_the_noise_of_its_measurement():
    bad = row("1f1b", m=4)
    bad.predicted_s, bad.spread = 1.0 / 1.3, 0.08
    d = bad.as_dict(BATCH, 2.0)
    assert display_rows([d])[0]["spread"] == "±8%"
    assert "spread ±8%" in misses([d])[0]
    bad.spread = 0.0  # steady to the last sample: still said
    assert "spread ±0%" in misses([bad.as_dict(BATCH, 2.0)])[0]
    bad.cpu_s, bad.predicted_busy = [0.6, 0.7], 0.9  # ranks' threads ran 0.65 s of the 1 s step
    assert "threads ran 65% of the step (CPU seconds over wall: the rest they waited), the simulated devices " \
           "computed 90%" in misses([bad.as_dict(BATCH, 2.0)])[0]


def test_the_median_round_sets_the_slowdown():
    assert typical_slowdown([1.4, 0.7, 1.05, 1.1, 1.02]) == 1.05  # one disturbed round either way changes nothing
    with pytest.raises(ValueError, match="no rounds"):
        typical_slowdown([])


def test_progress_writes_lines_not_bars_when_not_a_terminal(capsys):
    p = Progress(True)
    p.phase("profiles")
    bar = p.bar(3, "x")
    bar.update()
    bar.close()
    err = capsys.readouterr().err
    assert err == "bench [0:00]: profiles\n"  # pytest's stderr is not a terminal: no bar drawn
    assert default_config(True, type("R", (), {"is_cpu": True})()).batch == 16


def error_beyond_the_machine(row: dict) -> float:
    """How far a row's prediction error lies outside what the bench measured of the machine during that row: the
    range from 0 (the machine computing as calibrated) to how much longer its forward and backward passes took than
    simulated. docs/bench.md, the forward and backward columns: "an error close to them is that speed; one well
    beyond them is in what else the step does" (messages, collectives, the schedule), which is what the simulator must
    get right."""
    drift = [0.0] + [row[k] for k in ("forward_vs_predicted", "backward_vs_predicted") if row.get(k) is not None]
    return max(min(drift) - row["error"], row["error"] - max(drift), 0.0)


def assert_predictions_within_target(data: dict, out: str) -> None:
    """docs/bench.md's promise, in the terms the bench reports it: every row outside the 15% target is starred and
    listed with its error, every row inside it is not; and the typical row (the median of those held to the target)
    is within 15% of its prediction once the machine's own measured speed during that row is taken out. A row or
    two that the shared cores disturbed moves no median; a simulator that gets a schedule or a collective wrong
    moves every row of it."""
    from helpers.bench.predict import TARGET

    assert TARGET == 0.15  # docs/bench.md: "The target: every row within 15% of what was measured"
    rows = data["rows"] + data["splits"] + data["checkpointing"]
    missed = [r for r in rows if r["excluded_from_target"] or abs(r["error"]) > TARGET]
    listed = out.split(f"predictions outside {TARGET:.0%} or excluded: ", 1)[1].split("\n\n", 1)[0]
    lines = [line for line in listed.splitlines() if line.startswith("  ")]
    assert len(lines) == len(missed), listed
    for r in missed:
        said = "excluded from the target" if r["excluded_from_target"] else f"{r['error']:+.1%} (outside the 15%"
        assert any(said in line for line in lines), (r, listed)
    beyond = sorted(error_beyond_the_machine(r) for r in rows if not r["excluded_from_target"])
    typical = beyond[len(beyond) // 2]
    assert typical <= TARGET, f"the median row's error beyond the machine's measured drift is {typical:+.0%}"


def test_a_prediction_is_held_to_the_target_beyond_what_the_machine_did():
    row = {"error": 0.40, "forward_vs_predicted": 0.30, "backward_vs_predicted": 0.10, "spread": 0.02}
    assert error_beyond_the_machine(row) == pytest.approx(0.10)  # passes 30% slow explain 30 of the 40 points
    assert error_beyond_the_machine({**row, "error": -0.05}) == pytest.approx(0.05)
    assert error_beyond_the_machine({**row, "error": 0.2}) == 0.0
    assert error_beyond_the_machine({"error": 0.5, "forward_vs_predicted": None}) == 0.5  # nothing measured: all of it


@pytest.mark.full
def test_bench_quick_writes_json_and_pngs(tmp_path, capsys):
    bench_main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert_predictions_within_target(data, out)
    assert {r["split"] for r in data["splits"]} == {"equal layers", "equal params", "greedy memory", "optimal time"}
    assert len(data["checkpointing"]) == 4
    assert "CPU rig" in data["rig"]
    strategies = {(r["strategy"], r["engine"]) for r in data["rows"]}
    assert {("single", "none"), ("naive", "ours"), ("gpipe", "ours"), ("1f1b", "ours"), ("gpipe", "torch"),
            ("1f1b", "torch"), ("ddp", "torch"), ("zero1", "torch"), ("fsdp2", "torch")} <= strategies
    assert {(s, e) for s in BEYOND_1F1B for e in ("ours", "torch")} <= strategies
    assert [r["wire"] for r in data["rows"] if r["strategy"] == "ddp"] == ["auto", "bf16"]  # notebook 07's hook
    assert "ddp, bf16 grads" in out
    assert "launch to launch (this run): no row ran in two launches" in out  # --quick launches each job once
    assert data["calibration"]["launch_to_launch"] is None
    for r in data["rows"] + data["splits"] + data["checkpointing"]:
        assert r["predicted_samples_per_s"] > 0 and r["error"] is not None
        if r.get("strategy") not in DATA_PARALLEL:  # threads, processes, one thread: a drift each
            assert r["forward_vs_predicted"] is not None and r["backward_vs_predicted"] is not None
    for r in data["rows"]:
        assert {"strategy", "engine", "microbatches", "samples_per_s", "speedup", "peak_activation_bytes"} <= set(r)
        assert r["samples_per_s"] > 0
        assert len(r["whole_model_s"]) == 2 and min(r["whole_model_s"]) > 0  # the calibration timed with the row
        # the busy-core slowdown timed with the row: threads, in their own rounds; two ranks, inside their launches
        assert (r["core_slowdown"] is not None and r["core_slowdown"] >= 1) == (r["runner"] in ("threads",
                                                                                               "processes"))
        # a multi-process row's speed-up is taken against one device timed around its launches, kept with the row
        assert (r["reference_timed"] == "around this row's launches") == r["runner"].startswith("processes")
        assert r["reference_s"] > 0
        if r["runner"].startswith("processes"):
            assert len(r["reference_samples_s"]) == 2 * len(r["launch_step_times_s"]) >= 2
            assert r["speedup"] == pytest.approx(r["reference_s"] / r["step_s"])
        # a two-rank pipeline is priced with the receive posts timed in its own launches
        pipelined = r["runner"] == "processes" and r["microbatches"] is not None
        assert (r["receive_post_s"] is not None and r["receive_post_s"] > 0) == pipelined
        # a row on FSDP2's fully_shard is priced with its host work timed in its own launches, with its spread
        on_fully_shard = r["strategy"] in {s.name for s in CATALOG if s.fully_sharded} and r["engine"] == "torch"
        assert (r["fsdp2_host_s"] is not None) == (on_fully_shard and r["runner"] == "processes")
        assert (r["fsdp2_host_s"] is not None) == (r["reading_spreads"]["fsdp2_host_s"] is not None)
    assert all(r["core_slowdown"] >= 1 for r in data["splits"] + data["checkpointing"])
    assert data["calibration"]["links"]["allgather"][1] > 0
    pngs = list(tmp_path.glob("timeline_*.png"))
    assert len(pngs) == len(data["rows"]) and not any("None" in p.name for p in pngs)
    assert {p.with_suffix(".json") for p in pngs} == set(tmp_path.glob("timeline_*.json"))  # Perfetto traces
    assert "predicted" in out and "columns:" in out and "calibration (measured in this run)" in out
    assert "around the multi-process launches" in out


def test_each_calibration_reading_keeps_its_spread_and_the_summary_prints_it():
    """A reading the simulator prices with is the median of repeats: it keeps their spread (the rows' own
    `relative_spread`) and count, bench.json keeps both beside it, and the calibration summary prints them; a figure
    given as a plain number (and an old record's) prints as before."""
    from helpers.bench.cli import run_summary
    from helpers.bench.predict import calibration_record
    from helpers.bench.report import row_dicts
    from helpers.measure import relative_spread
    from helpers.simulate.calibrate_model import Reading, WholeModelTimer

    timer = WholeModelTimer(torch.nn.Linear(2, 2), torch.zeros(4, 2), torch.zeros(4, 2), torch.nn.functional.mse_loss)
    timer.keyed[("1f1b", 2)] = [(1.0, 3.0)]  # alone: 4 s a micro-batch
    timer.add_together(2, [4.0, 4.4, 4.8, 5.2], ["1f1b"])  # both ranks at once: 1.0, 1.1, 1.2, 1.3x
    for seconds in (0.002, 0.0025):  # one receive-post reading per launch
        timer.add_launch_reading("receive_post_s", [seconds], ["1f1b"])
    slowdown, post = timer.slowdown("1f1b"), timer.launch_reading("receive_post_s", "1f1b")
    assert slowdown == pytest.approx(1.15) and slowdown.n == 4
    assert slowdown.spread == pytest.approx(relative_spread([1.0, 1.1, 1.2, 1.3]))
    assert post == pytest.approx(0.00225) and (post.spread, post.n) == (relative_spread([0.002, 0.0025]), 2)

    pipe = row("1f1b", "processes", 2, core_slowdown=slowdown, receive_post_s=post,
               whole_model_s=timer.seconds(2, "1f1b"))
    lines = run_summary([pipe, row("1f1b", "processes", 2, core_slowdown=slowdown)], {})
    assert "1.15x (spread ±7%, n=4) slower when both cores are busy" in lines[0]  # once: one launch's reading
    assert "2.25 ms (spread ±6%, n=2)" in lines[1]
    single = BenchRow("single", "none", "one thread", None, 1.0, [], [0])
    assert row_dicts([pipe, single], BATCH)[0]["reading_spreads"] == {
        "core_slowdown": {"spread": slowdown.spread, "n": 4}, "receive_post_s": {"spread": post.spread, "n": 2},
        "fsdp2_host_s": None, "whole_model_s": [{"spread": None, "n": 1}, {"spread": None, "n": 1}]}  # one sample: n=1, no spread

    rig = replace(rig_model(1.05), fsdp2_host_s=Reading(0.004, 0.1, 15), split_overhead=Reading(0.05, None, 1))
    record = calibration_record(rig, {})
    assert "FSDP2's host work: 4.00 ms per collective (spread ±10%, n=15)" in record["summary"]
    assert "split backward (input pass + weight pass): 1.05x a plain backward (n=1)" in record["summary"]
    assert "processes: 2 shared cores, 1.05x slower when more than one is busy" in record["summary"]  # by hand
    assert record["spreads"]["fsdp2_host_s"] == {"spread": 0.1, "n": 15} and record["spreads"]["slowdown"] == {
        "threads": None, "processes": None}
    assert json.loads(json.dumps(record))["fsdp2_host_s"] == 0.004  # bench.json: the value a plain number


def test_a_pipelines_receive_posts_timed_in_its_own_launches_price_it():
    """What posting a receive cost inside a row's launches (`WholeModelTimer.add_launch_reading`, after the jobs) is
    what its prediction charges: their median, in place of the link calibration's one reading."""
    from helpers.simulate.calibrate_model import WholeModelTimer

    timer = WholeModelTimer(torch.nn.Linear(2, 2), torch.zeros(4, 2), torch.zeros(4, 2), torch.nn.functional.mse_loss)
    pipe, other = ("gpipe", "ours", "gpipe", 2, True), ("ddp", "dp", "auto")
    for seconds in (0.5, 0.25, 0.125):
        timer.add_launch_reading("receive_post_s", [seconds], [pipe])
    assert timer.launch_reading("receive_post_s", pipe) == 0.25
    assert timer.launch_reading("receive_post_s", other) is None and timer.launch_reading("fsdp2_host_s", pipe) is None
    base = rig_model()
    assert base.with_receive_post(None) is base and base.with_receive_post(0.25).p2p.receive_s == 0.25
    work = Workload.from_lists([F] * 4, [B] * 4)
    plain, charged = row("gpipe", "processes", 2), row("gpipe", "processes", 2)
    predict_row(plain, work, base, BATCH, boundaries=[2])
    predict_row(charged, work, base.with_receive_post(0.25), BATCH, boundaries=[2])
    # GPipe m=2: the second micro-batch's forward on stage 2 and its backward on stage 1 wait for their posts
    assert charged.predicted_s == plain.predicted_s + 2 * 0.25


def test_fsdp2s_host_work_timed_in_its_own_launches_prices_its_row():
    """FSDP2's host work per collective, sampled inside its row's launches (every launch's rounds pooled), is what
    that row's prediction charges in place of the link calibration's: on the CPU rig it holds the thread that
    computes, so each collective of the step adds it once."""
    from helpers.simulate.calibrate_model import WholeModelTimer

    timer = WholeModelTimer(torch.nn.Linear(2, 2), torch.zeros(4, 2), torch.zeros(4, 2), torch.nn.functional.mse_loss)
    fsdp2 = ("fsdp2", "dp", "auto")
    timer.add_launch_reading("fsdp2_host_s", [0.001, 0.003], [fsdp2])  # one launch's rounds
    timer.add_launch_reading("fsdp2_host_s", [0.002], [fsdp2])  # another's
    host = timer.launch_reading("fsdp2_host_s", fsdp2)
    assert host == 0.002 and host.n == 3
    base = replace(rig_model(), fsdp2_host_s=0.0)
    assert base.with_fsdp2_host(None) is base and base.with_fsdp2_host(host).fsdp2_host_s == 0.002
    work = Workload.from_lists([F] * 4, [B] * 4, params=[1000] * 4)
    plain, charged = row("fsdp2", "processes", None), row("fsdp2", "processes", None)
    predict_row(plain, work, base, BATCH)
    predict_row(charged, work, base.with_fsdp2_host(host), BATCH)
    # 4 layers: 4 all-gathers in forward, 4 again in backward (resharded after forward), 4 reduce-scatters
    assert charged.predicted_s == pytest.approx(plain.predicted_s + 12 * 0.002)


def test_a_rows_forward_and_backward_passes_are_set_against_the_simulated_ones():
    from helpers.bench.rows import compute_drift
    from helpers.timeline import Event, median_phases, phase_seconds

    work = Workload.from_lists([F] * 4, [B] * 4)
    step = [Event(d, "forward", 0.0, 1.5) for d in (0, 1)] + [Event(d, "backward", 2.0, 18.0) for d in (0, 1)]
    step.append(Event(0, "recv", 0.0, 9.0))  # waiting is neither phase
    slow = [Event(d, "forward", 0.0, 30.0) for d in (0, 1)] + [Event(d, "backward", 30.0, 90.0) for d in (0, 1)]
    # the median timed step, phase by phase: one slow step among three does not move it
    measured = median_phases([phase_seconds(step), phase_seconds(slow), phase_seconds(step)])
    assert measured == {"forward": 3.0, "backward": 32.0} and median_phases([]) == {}
    r = BenchRow("naive", "ours", "processes", 1, 40.0, step, [0, 0], measured_phase_s=measured)
    predict_row(r, work, rig_model(), BATCH, boundaries=[2])
    # both stages' forward and backward, one micro-batch of the whole batch
    assert r.predicted_phase_s == {"forward": BATCH * 4 * F, "backward": BATCH * 4 * B}
    d = r.as_dict(BATCH, 2.0)
    assert d["forward_vs_predicted"] == pytest.approx(3.0 / 16.0 - 1)
    assert d["backward_vs_predicted"] == pytest.approx(32.0 / 32.0 - 1)
    assert (display_rows([d])[0]["forward"], display_rows([d])[0]["backward"]) == ("-81%", "+0%")
    r.predicted_s = 1.0  # a miss says how long its passes took against the simulation
    assert ("its forward passes took 81% less time and backward passes took 0% longer than simulated"
            in misses([r.as_dict(BATCH, 2.0)])[0])
    # DDP's backward spans hold the all-reduce hook, FSDP2's spans its gathers: not comparable
    assert compute_drift("ddp", "forward", measured, r.predicted_phase_s) == pytest.approx(3.0 / 16.0 - 1)
    assert compute_drift("ddp", "backward", measured, r.predicted_phase_s) is None
    assert compute_drift("fsdp2", "forward", measured, r.predicted_phase_s) is None
    assert compute_drift("gpipe", "forward", {}, r.predicted_phase_s) is None


def test_a_rows_calibration_is_the_whole_model_timed_with_that_row():
    """Samples taken under a key calibrate that key's row alone; a key without samples falls back to all of them."""
    from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
    from helpers.simulate.calibrate_model import WholeModelTimer

    cfg = StackConfig(hidden=32, n_blocks=1, seq_len=8, vocab=32)
    x, y = SyntheticTokens(4, cfg.seq_len, cfg.vocab).batch(0, 4)
    timer = WholeModelTimer(build_stack(cfg), x, y, lm_loss)
    assert timer.seconds(2) is None
    timer.sample(2, key="ddp")
    timer.sample(2)
    timer.sample(2, keys=["gpipe", "1f1b"])  # one sample kept for every job of a launch at that size
    assert len(timer.keyed[("gpipe", 2)]) == len(timer.keyed[("1f1b", 2)]) == 1
    timer.samples[2][:] = [(1.0, 2.0), (3.0, 6.0)]  # the clock's readings, made exact
    timer.keyed[("ddp", 2)][:] = [(1.0, 2.0)]
    assert timer.seconds(2, "ddp") == (1.0, 2.0)
    assert timer.seconds(2) == timer.seconds(2, "zero1") == (2.0, 4.0)
    with pytest.raises(ValueError, match="between 1 and the 4 samples"):
        timer.sample(8)


def test_the_calibration_and_the_baseline_count_activations_as_the_engines_do():
    """The whole-model timer (both copies) and the one-device step run their forward under a memory ledger, as every
    pipeline and rank does: each counts the same activation peak as `measure_step_memory`."""
    from helpers.bench import one_device_step
    from helpers.sizing.ledger import ledger_for, measure_step_memory
    from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
    from helpers.simulate.calibrate_model import WholeModelTimer

    cfg = StackConfig(hidden=32, n_blocks=2, seq_len=8, vocab=32)
    x, y = SyntheticTokens(4, cfg.seq_len, cfg.vocab).batch(0, 4)
    model, reference = build_stack(cfg), build_stack(cfg)
    expected = measure_step_memory(reference, x, y, lm_loss, torch.optim.SGD(reference.parameters())).activations
    timer = WholeModelTimer(model, x, y, lm_loss)
    timer.sample(4)
    timer.sample_together(4)
    assert [led.device("model").activations for led in timer.ledgers.values()] == [expected, expected]
    ledger = ledger_for([model], ["device"])
    one_device_step(model, x, y, lm_loss, ledger=ledger)()
    assert ledger.device("device").activations == expected


def test_the_busy_core_slowdown_is_timed_with_the_rows_it_predicts():
    """Two copies timed at once under a key, over the same key's samples alone at that size, give that key's
    slowdown (never below 1); without them the rig's own figure stays."""
    from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
    from helpers.simulate.calibrate_model import WholeModelTimer

    cfg = StackConfig(hidden=32, n_blocks=1, seq_len=8, vocab=32)
    x, y = SyntheticTokens(4, cfg.seq_len, cfg.vocab).batch(0, 4)
    timer = WholeModelTimer(build_stack(cfg), x, y, lm_loss)
    timer.sample(2, key="threads")
    timer.sample_together(2, key="threads")
    assert len(timer.together[("threads", 2)]) == 2  # one time per copy, after an untimed warm-up
    assert timer.slowdown("processes") is None
    timer.keyed[("threads", 2)][:] = [(1.0, 3.0)]  # the clock's readings, made exact
    timer.together[("threads", 2)][:] = [4.4, 5.2, 4.8]
    assert timer.slowdown("threads") == pytest.approx(1.2)
    timer.together[("threads", 2)][:] = [3.0]
    assert timer.slowdown("threads") == 1.0
    with pytest.raises(ValueError, match="between 1 and the 4 samples"):
        timer.sample_together(8)

    # the two-rank rows: both ranks' times inside a launch, kept for each of its jobs at that size
    timer.sample(2, keys=["1f1b", "ddp"])
    timer.keyed[("1f1b", 2)][:] = [(1.0, 2.0)]
    timer.add_together(2, [3.3, 3.9], keys=["1f1b", "ddp"])
    assert timer.slowdown("1f1b") == pytest.approx(1.2) and timer.together[("ddp", 2)] == [3.3, 3.9]

    rig = rig_model(1.05)
    assert rig.with_core_slowdown(None) is rig
    changed = rig.with_core_slowdown(1.25)
    assert changed.thread_cores.slowdown == 1.25 and changed.process_cores.slowdown == 1.05
    changed = rig.with_core_slowdown(1.3, "processes")
    assert changed.process_cores.slowdown == 1.3 and changed.thread_cores.slowdown == rig.thread_cores.slowdown


def test_the_bench_leaves_out_what_the_rig_refuses():
    """On one GPU the bench queued torch's pipelining and FSDP2 unconditionally; the support check refused them
    there and the whole run stopped with nothing written. It now leaves them out, with the reason."""
    from helpers.bench.jobs import PROCESS_ROWS, bench_refusals
    from helpers.training.deepspeed_zero import missing
    from helpers.training.support import reference_rigs

    rigs = reference_rigs()
    absent = {(s, "processes") for s in DEEPSPEED} if missing() else set()  # DeepSpeed is optional
    assert set(bench_refusals(rigs["CPU (2 cores)"])) == absent
    one = bench_refusals(rigs["one GPU"])
    torch_engine = {(s, "torch") for s, engine in PROCESS_ROWS if engine == "torch"}
    assert len(torch_engine) == 7  # GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV; DP x PP
    deepspeed = {(s, "processes") for s in DEEPSPEED}
    assert set(one) == torch_engine | {("zero2", "processes"), ("fsdp2", "processes"), ("dp_x_pp", "processes")} \
        | deepspeed
    assert all("NCCL refuses two ranks on one GPU" in why for (s, _), why in one.items() if s != "dp_x_pp")
    assert set(bench_refusals(rigs["two GPUs"])) == {("dp_x_pp", "processes"), ("dp_x_pp", "torch")} | absent
    assert set(one) <= set(PROCESS_ROWS)


def test_one_gpu_calibration_measures_only_what_gloo_carries_for_cuda():
    """Two ranks on one GPU talk over gloo, which runs only all-reduce and broadcast on CUDA tensors: the calibration
    measured all-gather and reduce-scatter there too (and FSDP2's host work), and failed."""
    from helpers.training.support import carries

    assert [k for k in ("allgather", "reducescatter", "broadcast") if carries("gloo", "cuda", k)] == ["broadcast"]
    assert all(carries(b, d, k) for b, d in (("gloo", "cpu"), ("nccl", "cuda"))
               for k in ("allgather", "reducescatter", "broadcast", "allreduce"))


def test_every_two_rank_job_shares_one_launch_per_round_in_alternating_order():
    """The default run's repeatability by design: every two-rank job (pipelines, DDP, ZeRO-1; FSDP2 apart) in one
    launch per round, 2 rounds, the second in reverse order, so each row pools steps of two launches and no job is
    always first; its timed steps, phases and CPU seconds pooled over the launches."""
    from types import SimpleNamespace

    from helpers.bench.jobs import two_rank_jobs
    from helpers.bench.rows import dp_x_pp_rows, launch_groups, run_in_rounds
    from helpers.training.deepspeed_zero import missing
    from helpers.training.support import reference_rigs

    config = default_config("default", reference_rigs()["CPU (2 cores)"])
    assert config.rounds == 2 and config.steps == 2 and config.thread_repeats == 5
    keys = two_rank_jobs(config, reference_rigs()["CPU (2 cores)"])
    assert len(keys) == 17 and {k.strategy for k in keys if k.pp == 1} == {"ddp", "zero1", "fsdp2"}
    assert {(k.strategy, k.engine) for k in keys if k.batched_weights == 2} == {("zbh1", "ours"), ("zbv", "ours")}
    precise = two_rank_jobs(default_config("precise", reference_rigs()["CPU (2 cores)"]),
                            reference_rigs()["CPU (2 cores)"])
    what = lambda jobs: {(k.strategy, k.engine, k.microbatches, k.overlap, k.wire) for k in jobs}  # noqa: E731
    assert what(precise) - what(keys) == {("naive", "ours", 1, False, "auto"), ("gpipe", "torch", 8, True, "auto"),
                                          ("gpipe", "ours", 2, True, "auto"), ("gpipe", "ours", 4, True, "auto"),
                                          ("zero2", "ours", 1, True, "auto"),
                                          *({(s, "ours", 1, True, "auto") for s in DEEPSPEED} if not missing() else ())}
    assert dp_x_pp_rows(config, reference_rigs()["CPU (2 cores)"], progress=False) == []  # 4 ranks: --precise
    orders, seen = [], []

    def launch(order):
        orders.append(list(order))
        return [SimpleNamespace(step_times=[1.0 + len(orders)], phase_times=[{"forward": 1.0, "backward": 2.0}],
                                thread_cpu_s=[0.5, 0.25 * len(orders)], recorded_step_s=None, events=[],
                                peak_activations=[0]) for _ in order]

    pooled = run_in_rounds({tuple(keys): launch}, config.rounds, "test", progress=False,
                           around=lambda k: seen.append(k))
    assert orders == [keys, keys[::-1]] and seen == [tuple(keys)] * 2 + [tuple(keys[::-1])] * 2
    assert pooled[keys[0]]["step_s"] == 2.5 and pooled[keys[0]]["cpu_s"] == [0.5, 0.375]
    # FSDP2, whose step depends on what ran before it in the same processes, in a launch of its own
    shared, *apart = launch_groups(keys)
    fsdp2 = next(k for k in keys if k.strategy == "fsdp2")
    assert apart == [(fsdp2,)] and set(shared) == set(keys) - {fsdp2}


def _bench_json(speedups: dict[str, float], errors: dict[str, float | None] | None = None) -> dict:
    errors = errors or {}
    rows = [{"strategy": s, "engine": "ours", "runner": "threads", "microbatches": 8, "speedup": v,
             "error": 0.5 if s in errors and errors[s] is None else errors.get(s, 0.0),
             "excluded_from_target": "4 ranks" if s in errors and errors[s] is None else None}
            for s, v in speedups.items()]
    return {"rows": rows, "splits": [{"split": "optimal time", "speedup": 1.3, "error": 0.02}],
            "checkpointing": [{"split": "every 2", "step vs none": 1.2, "error": -0.03}]}


def test_against_a_previous_run_every_ratio_is_compared_and_the_verdict_said():
    from helpers.bench.report import compare_runs, describe_comparison

    before = _bench_json({"1f1b": 1.30, "zbh1": 1.30, "gone": 1.0})
    now = _bench_json({"1f1b": 1.33, "zbh1": 1.40, "new": 1.1})
    compared = {c["row"]: c for c in compare_runs(now, before)}
    assert set(compared) == {"1f1b ours threads m=8", "zbh1 ours threads m=8", "splits: optimal time",
                             "checkpointing: every 2"}  # rows in both runs only
    assert compared["1f1b ours threads m=8"]["difference"] == pytest.approx(1.33 / 1.30 - 1)
    assert compared["1f1b ours threads m=8"]["within"] and not compared["zbh1 ours threads m=8"]["within"]
    text = describe_comparison(list(compared.values()), "old/bench.json")
    assert "1 of 4 rows outside 5%" in text and "+7.7%*" in text and "largest difference +7.7% (zbh1" in text
    assert "all 5 rows within 5%" in describe_comparison(compare_runs(before, before), "x")


def test_the_run_says_how_far_its_jobs_moved_between_their_own_launches():
    from helpers.bench.report import describe_launch_to_launch, launch_to_launch

    shared = [0.99, 1.01, 1.02, 0.98]  # one device beside the two launches: the rows of one launch share them
    pipeline = {"strategy": "1f1b", "engine": "ours", "runner": "processes", "microbatches": 8,
                "launch_step_times_s": [[0.70, 0.72, 0.71], [0.78, 0.80, 0.79]], "reference_samples_s": shared}
    ddp = {"strategy": "ddp", "engine": "torch", "runner": "processes",
           "launch_step_times_s": [[0.6, 0.6], [0.61, 0.6]], "reference_samples_s": shared}
    one_launch = {**pipeline, "strategy": "gpipe", "launch_step_times_s": [[0.7]], "reference_samples_s": [1.5, 1.5]}
    summary = launch_to_launch([pipeline, ddp, {"strategy": "single", "speedup": 1.0}])
    assert summary["rows"] == 2 and summary["within"] == 1
    assert summary["largest"] == pytest.approx(0.79 / 0.71 - 1) and summary["largest_row"] == "1f1b ours processes m=8"
    assert summary["one_device_s"] == pytest.approx([0.98, 1.0, 1.02])
    text = describe_launch_to_launch(summary)
    assert "1 of 2 multi-process rows within 5%" in text and "980-1020 ms (median 1000)" in text
    assert "no row ran in two launches" in describe_launch_to_launch(launch_to_launch([one_launch]))
    # --against prints the previous run's floor under the comparison
    from helpers.bench.report import compare_runs, describe_against

    before, now = {"rows": [{**pipeline, "speedup": 1.4}]}, {"rows": [{**pipeline, "speedup": 1.5}]}
    text = describe_against(compare_runs(now, before), before, "old/bench.json")
    assert "1 of 1 rows outside 5%" in text and "launch to launch (old/bench.json)" in text and "11.3%" in text


def test_against_refuses_a_path_without_a_bench_json_before_anything_runs(tmp_path):
    from helpers.bench.cli import read_previous

    with pytest.raises(SystemExit, match="no bench.json there"):
        bench_main(["--against", str(tmp_path / "missing.json")])
    (tmp_path / "bench.json").write_text(json.dumps(_bench_json({"1f1b": 1.3})))
    assert read_previous(str(tmp_path))["rows"][0]["speedup"] == 1.3  # a folder holding one will do
    (tmp_path / "bench.json").write_text("{}")
    with pytest.raises(SystemExit, match="no rows"):
        read_previous(str(tmp_path))


def test_prediction_errors_of_every_row_for_a_bound_check():
    from helpers.bench.report import prediction_errors

    errors = prediction_errors(_bench_json({"1f1b": 1.3, "dp_x_pp": 1.1}, {"1f1b": 0.04, "dp_x_pp": None}))
    assert errors == {"1f1b ours threads m=8": 0.04, "dp_x_pp ours threads m=8": None,
                      "splits: optimal time": 0.02, "checkpointing: every 2": -0.03}


def test_the_split_backwards_cost_is_read_from_zbh1_against_1f1b_on_each_engine():
    """Per engine and device: ZB-H1's median input pass + weight pass over 1F1B's median backward, in the spans'
    CPU seconds (wall time beside it); engines without both rows are left out."""
    from helpers.bench.extras import split_backward_rows
    from helpers.timeline import Event

    def spans(kind, device, wall, cpu, n=3):
        return [Event(device, kind, k, k + wall, k, cpu=cpu) for k in range(n)]

    plain = BenchRow("1f1b", "ours", "processes", 8, 1.0, spans("backward", 0, 0.05, 0.04)
                     + spans("backward", 1, 0.05, 0.04), [0, 0])
    split = BenchRow("zbh1", "ours", "processes", 8, 1.0, spans("backward", 0, 0.0, 0.0)
                     + spans("weight", 0, 0.07, 0.042) + spans("backward", 1, 0.03, 0.02)
                     + spans("weight", 1, 0.03, 0.022), [0, 0])
    lone = BenchRow("zbh1", "torch", "processes", 8, 1.0, spans("weight", 0, 0.05, 0.05), [0, 0])
    out = split_backward_rows([plain, split, lone])
    assert [(r["engine"], r["device"]) for r in out] == [("ours", 0), ("ours", 1)]
    assert out[0]["split / plain"] == pytest.approx(1.05) and out[0]["wall: split / plain"] == pytest.approx(1.4)
    assert out[1]["split / plain"] == pytest.approx(1.05) and out[1]["input pass (ms)"] == pytest.approx(20.0)
    # a row launched twice pools both launches' recorded steps: its last launch alone would read 1.25x
    last = spans("backward", 1, 0.03, 0.03) + spans("weight", 1, 0.03, 0.02)
    twice = BenchRow("zbh1", "ours", "processes", 8, 1.0, last, [0, 0], launch_events=(
        spans("backward", 1, 0.03, 0.02, n=5) + spans("weight", 1, 0.03, 0.022, n=5), last))
    assert [r["split / plain"] for r in split_backward_rows([plain, twice])] == [pytest.approx(1.05)]


def test_a_rows_speedup_is_set_against_one_device_timed_in_the_same_minutes():
    """Threads: the median of each round's one-device step over the row's step in that round; processes: the median
    of the one-device steps timed just before and after each of the row's launches over the row's median step in
    them, so one slow reference step or launch does not move it."""
    from types import SimpleNamespace

    from helpers.bench.rows import LaunchReference, pool, run_in_rounds
    from helpers.measure import Timings

    times = Timings({"single": [1.0, 2.0, 1.0], "pipe": [0.5, 1.0, 0.8]})  # round 2 ran at half speed
    assert times.paired_ratio("single", "pipe") == pytest.approx(2.0)  # the ratio of medians would say 1.25

    def launch(steps, recorded=None):
        return SimpleNamespace(step_times=steps, thread_cpu_s=None, phase_times=[{"forward": 0.1, "backward": 0.2}],
                               recorded_step_s=recorded, events=[], peak_activations=[0])

    got = pool([launch([0.5, 0.5], recorded=0.6), launch([0.65, 0.7], recorded=0.6)])  # the recorded step pooled too
    assert got["step_s"] == pytest.approx(0.6) and got["launch_times"] == ((0.5, 0.5, 0.6), (0.65, 0.7, 0.6))

    calls = []
    reference = LaunchReference(step=lambda: calls.append("single"), adam_s=0.25)
    run_in_rounds({("a", "b"): lambda keys: [launch([1.0]) for _ in keys]}, rounds=2, desc="t", progress=False,
                  around=reference.around(None))
    assert calls == ["single"] * 4  # before and after each of the two launches
    reference.samples["a"] = [1.0, 1.2, 1.25, 1.9]  # one slow step after the second launch
    row = BenchRow("ddp", "torch", "processes", None, **got)
    reference.apply(row, "a")
    d = row.as_dict(batch=32, reference_s=3.0)  # the row's own reference wins over the run's one-device row
    assert d["reference_s"] == pytest.approx(1.225) and d["speedup"] == pytest.approx(1.225 / 0.6)
    assert d["reference_timed"] == "around this row's launches"
    assert d["reference_samples_s"] == [1.0, 1.2, 1.25, 1.9]  # bench.json keeps what the speed-up came from
    assert d["launch_step_times_s"] == [[0.5, 0.5, 0.6], [0.65, 0.7, 0.6]]
    reference.apply(row, "a", adam=True)
    assert row.as_dict(batch=32, reference_s=3.0)["speedup"] == pytest.approx(1.475 / 0.6)
    never = BenchRow("ddp", "torch", "processes", None, step_s=0.5, events=[], peak_activation_bytes=[0])
    reference.apply(never, "never launched")
    assert never.reference_s is None and never.as_dict(batch=32, reference_s=1.0)["speedup"] == pytest.approx(2.0)


def test_a_data_parallel_step_is_taken_apart_from_its_recorded_spans():
    """Per device, the median over launches of: forward, backward, the backward's wall less its thread's CPU (what
    it waited: for a core, for the last bucket's collective), the optimizer, and the rest of the step; rows that
    are not the catalog's data parallelism, or have no launches, are left out."""
    from helpers.bench.extras import data_parallel_rows
    from helpers.timeline import Event

    def step(wait: float) -> list[Event]:  # forward 0-0.2, backward 0.2-0.6 with 0.3 + wait of CPU, all-reduce inside
        return [Event(0, "forward", 0.0, 0.2, cpu=0.2), Event(0, "backward", 0.2, 0.6, cpu=0.3 - wait),
                Event(0, "allreduce", 0.4, 0.6), Event(0, "optimizer", 0.62, 0.67, cpu=0.05)]

    ddp = BenchRow("ddp", "torch", "processes", None, 0.7, step(0.02), [0], reference_s=1.0,
                   launch_events=(step(0.0), step(0.02), step(0.04)))
    pipeline = BenchRow("1f1b", "ours", "processes", 8, 0.7, step(0.0), [0], reference_s=1.0,
                        launch_events=(step(0.0),))
    single = BenchRow("single_adam", "none", "one thread", None, 1.0, step(0.0), [0], reference_s=1.0)
    [row] = data_parallel_rows([single, ddp, pipeline, BenchRow("zero1", "torch", "processes", None, 0.7, [], [0])])
    assert row["row"] == "ddp" and row["one device / 2 (ms)"] == pytest.approx(500)
    assert row["forward (ms)"] == pytest.approx(200) and row["backward (ms)"] == pytest.approx(400)
    assert row["waited (ms)"] == pytest.approx(120) and row["optimizer (ms)"] == pytest.approx(50)
    assert row["recorded step (ms)"] == pytest.approx(670) and row["rest (ms)"] == pytest.approx(20)


def test_the_printed_legend_is_docs_bench_and_names_every_column():
    """The legend under the tables is read from docs/bench.md (its one copy): an entry for every column and extra
    table, the target as the bench checks it."""
    text = legend()
    named = {c for line in text.splitlines() if not line.startswith(" ") for c in line.split("  ")[0].split(", ")}
    assert set(BENCH_COLUMNS) <= named and set(EXTRA_COLUMNS) <= named
    assert f"outside the {TARGET:.0%} target" in text and max(map(len, text.splitlines())) <= 120
