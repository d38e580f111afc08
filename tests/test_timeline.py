import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from helpers.runtime import workers  # noqa: E402
from helpers.runtime.launch import run  # noqa: E402
from helpers.runtime.rig import cpu_rig  # noqa: E402
from helpers.timeline import (Event, Recorder, busy_fraction, concurrent_time, makespan, normalise,  # noqa: E402
                              plot_timeline, plot_timelines)


def test_recorder_spans_and_busy_fraction():
    rec = Recorder(0)
    with rec.span("forward", 3):
        sum(range(10000))
    sum(range(10000))  # between the spans the device waits: not work
    with rec.span("backward", 3):
        sum(range(10000))
    f, b = rec.events()
    assert (f.kind, f.microbatch, b.kind, b.microbatch) == ("forward", 3, "backward", 3)
    assert f.start < f.end < b.start < b.end  # in the order they ran, each of positive length, the wait between
    busy = busy_fraction([f, b])[0]
    assert busy == pytest.approx((f.end - f.start + b.end - b.start) / (b.end - f.start), rel=1e-9) and busy < 1


def test_busy_fraction_merges_overlaps():
    ev = [Event(0, "forward", 0.0, 1.0), Event(0, "send", 0.5, 2.0), Event(1, "forward", 2.0, 4.0)]
    assert makespan(ev) == 4.0
    assert busy_fraction(ev, {"forward", "send"}) == {0: 0.5, 1: 0.5}  # overlapping spans merged
    assert busy_fraction(ev) == {0: 0.25, 1: 0.5}  # by default only compute counts: a send is not work
    assert normalise([Event(0, "f", 5.0, 6.0)])[0].start == 0.0


def test_events_gathered_across_ranks():
    per_rank = run(workers.timed_spans, 2, rig=cpu_rig())
    assert per_rank[0] == per_rank[1]  # every rank sees everyone's events
    events = per_rank[0]
    assert sorted({e.device for e in events}) == [0, 1]
    assert len(events) == 4
    ax = plot_timeline(events, title="gathered")
    assert len(ax.patches) == 4


def test_concurrent_time_sees_only_overlap_across_devices():
    sequential = [Event(0, "forward", 0, 1), Event(1, "forward", 1, 2), Event(1, "backward", 2, 3),
                  Event(0, "backward", 3, 4)]
    assert concurrent_time(sequential) == 0
    overlapping = [Event(0, "forward", 0, 2), Event(1, "forward", 1, 3), Event(0, "send", 2, 5),
                   Event(1, "backward", 4, 5)]
    assert concurrent_time(overlapping) == 1.0  # only [1, 2]: sends are not compute
    fig = plot_timelines({"a": sequential, "b": overlapping})
    assert len(fig.axes) == 2


def test_chrome_trace_is_the_events_in_microseconds(tmp_path):
    """The JSON torch.profiler's export_chrome_trace writes: one complete ("X") event per span, ts and dur in
    microseconds from the first span, one process per device; the bench writes one beside each PNG and the
    simulator's timelines go through the same function."""
    import json

    from helpers.simulate import Job, Workload, simulate
    from helpers.timeline import chrome_trace

    events = [Event(1, "forward", 10.0, 10.5, 0, 1, cpu=0.25), Event(0, "weight", 10.25, 11.0, 3, 2),
              Event(0, "recv", 11.0, 11.125)]
    path = tmp_path / "trace.json"
    chrome_trace(events, path, {0: "cuda:0"})
    trace = json.loads(path.read_text())["traceEvents"]
    spans = [t for t in trace if t["ph"] == "X"]
    assert len(spans) == len(events)
    for e in events:
        t = next(t for t in spans if t["pid"] == e.device and t["cat"] == e.kind)
        assert t["ts"] == pytest.approx((e.start - 10.0) * 1e6) and t["dur"] == pytest.approx(e.duration * 1e6)
        assert t["args"] == {k: v for k, v in (("microbatch", e.microbatch), ("stage", e.stage),
                                               ("cpu_ms", e.cpu and e.cpu * 1e3)) if v is not None}
    assert {t["args"]["name"] for t in trace if t["ph"] == "M"} == {"cuda:0", "device 1"}
    sim = simulate(Workload.from_lists([1.0] * 4, [2.0] * 4), Job("zbv", batch=4, microbatches=4, pp=2))
    simulated = [t for t in sim.trace(tmp_path / "sim.json")["traceEvents"] if t["ph"] == "X"]
    assert len(simulated) == len(sim.events) and {t["cat"] for t in simulated} == {"forward", "backward", "weight"}
    assert json.loads((tmp_path / "sim.json").read_text())["traceEvents"][-1] == simulated[-1]


def test_a_cpu_span_records_the_threads_cpu_seconds_apart_from_waiting():
    """A CPU span carries the CPU seconds its thread used (time.thread_time): waiting (a sleep, a receive) costs
    none of them, work does; the simulator's events have none."""
    import time

    from helpers.timeline import Recorder

    rec = Recorder(0)
    with rec.span("recv", 0):
        time.sleep(0.05)
    with rec.span("forward", 0):
        sum(i * i for i in range(200_000))
    waited, worked = rec.events()
    assert waited.duration >= 0.05 and waited.cpu < waited.duration / 2
    assert worked.cpu > 0 and Event(0, "forward", 0.0, 1.0).cpu is None


def test_a_slowed_recorder_stretches_each_outermost_compute_span(monkeypatch):
    """The emulated slower card waits (slowdown - 1) x the span's own length at the end of each outermost compute
    span: once for a backward that holds a recompute, never for communication (no wall time asserted: the waits
    asked for are)."""
    waits = []
    monkeypatch.setattr("helpers.timeline.time.sleep", waits.append)
    rec = Recorder(0, slowdown=2.0)
    with rec.span("backward", 0):
        with rec.span("recompute", 0):
            sum(range(1000))
    with rec.span("send", 0):
        pass
    assert len(waits) == 1 and waits[0] >= 0
    backward = next(e for e in rec.events() if e.kind == "backward")
    assert waits[0] <= backward.duration
    assert Recorder(0).slowdown == 1.0
    for bad in (0.5, float("nan")):
        with pytest.raises(ValueError, match="factor >= 1"):
            Recorder(0, slowdown=bad)
