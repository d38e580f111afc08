import json

import pytest

from helpers.bench import ideal_step_time, main as bench_main
from helpers.timeline import Event


def test_ideal_step_time_from_stage_costs():
    events = [Event(0, "forward", 0, 1, 0), Event(0, "backward", 1, 3, 0),
              Event(1, "forward", 0, 2, 0), Event(1, "backward", 2, 6, 0)]
    assert ideal_step_time(events, 4) == pytest.approx(3 + 6 + 3 * 6)


def test_bench_quick_writes_json_and_pngs(tmp_path):
    bench_main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {r["split"] for r in data["splits"]} == {"equal layers", "equal params", "greedy memory", "optimal time"}
    assert len(data["checkpointing"]) == 4
    assert "CPU rig" in data["rig"]
    strategies = {(r["strategy"], r["engine"]) for r in data["rows"]}
    assert {("single", "none"), ("naive", "ours"), ("gpipe", "ours"), ("1f1b", "ours"), ("gpipe", "torch"),
            ("1f1b", "torch")} <= strategies
    for row in data["rows"]:
        assert {"strategy", "engine", "microbatches", "samples_per_s", "speedup", "ideal_fraction",
                "peak_activation_bytes"} <= set(row)
        assert row["samples_per_s"] > 0
    assert len(list(tmp_path.glob("timeline_*.png"))) == len(data["rows"])


