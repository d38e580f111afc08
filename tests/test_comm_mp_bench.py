import json

import pytest
import torch

from helpers.bench import ideal_step_time, main as bench_main
from helpers.check import grads_of, max_grad_diff
from helpers.pipeline.comm import Wire, link_benchmark, resolve_dtype, send_to
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.mp_engine import PipelineJob, check_job, run_pipeline_job
from helpers.runtime.rig import cpu_rig
from helpers.timeline import Event

CFG = StackConfig(hidden=32, n_blocks=4, heads=2, seq_len=8, vocab=64)


def test_wire_halves_bytes_and_round_trips():
    t = torch.randn(4, 8)
    assert Wire.of("bf16").bytes(t) * 2 == Wire.of("fp32").bytes(t) == t.numel() * 4
    back = Wire.of("fp16").unpack(Wire.of("fp16").pack(t))
    assert back.dtype == torch.float32 and torch.allclose(back, t, rtol=1e-3, atol=1e-3)
    assert Wire.of("bf16").pack(torch.arange(3)).dtype == torch.int64  # token ids travel untouched
    assert send_to(t, torch.device("cpu")).get() is t


@pytest.mark.parametrize("bad", ["int8", torch.int8, torch.float64, "fp8"])
def test_unsendable_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="cannot send activations as"):
        resolve_dtype(bad)


def test_gloo_link_benchmark_measures_each_size():
    samples = link_benchmark(cpu_rig(), [4096, 65536], repeats=2)
    assert [s.bytes for s in samples] == [4096, 65536]
    assert all(s.seconds > 0 and s.gb_per_s > 0 for s in samples)


def _reference():
    model = build_stack(CFG)
    x, y = SyntheticTokens(8, CFG.seq_len, CFG.vocab).batch(0, 8)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), grads_of(model.parameters())


@pytest.mark.parametrize("engine, schedule, overlap", [("ours", "gpipe", False), ("ours", "gpipe", True),
                                                       ("ours", "1f1b", True), ("torch", "gpipe", True),
                                                       ("torch", "1f1b", True)])
def test_multiprocess_engines_equal_one_device(engine, schedule, overlap):
    loss, grads = _reference()
    job = PipelineJob(CFG, (3,), schedule, 4, 8, engine, overlap=overlap, steps=1, return_grads=True)
    res = run_pipeline_job(job, cpu_rig())
    assert abs(res.loss - loss) < 1e-5
    assert max_grad_diff(grads, res.grads) <= 1e-5
    assert {e.device for e in res.events} == {0, 1}
    assert sum(e.kind == "forward" for e in res.events) == 8
    assert len(res.peak_activations) == 2 and all(p > 0 for p in res.peak_activations)


def test_bf16_wire_trains_close_to_fp32():
    loss, grads = _reference()
    res = run_pipeline_job(PipelineJob(CFG, (3,), "gpipe", 2, 8, wire="bf16", steps=1, return_grads=True), cpu_rig())
    assert abs(res.loss - loss) < 1e-2
    assert 0 < max_grad_diff(grads, res.grads) < 1e-2  # rounded, not exact


@pytest.mark.parametrize("job, msg", [
    (PipelineJob(CFG, (3,), batch=30, microbatches=4), "global batch 30 is not divisible by 4 micro-batches"),
    (PipelineJob(CFG, (3,), schedule="1f1b", microbatches=1, batch=8), "m=1 < p=2"),
    (PipelineJob(CFG, (3,), wire="int8"), "cannot send activations as int8"),
    (PipelineJob(CFG, (2, 3, 4)), "4 stages need 4 ranks, but the rig hosts 2"),
    (PipelineJob(CFG, (9,)), "split point 9 is outside"),
    (PipelineJob(CFG, (3,), schedule="1f1b", overlap=False), "deadlocks"),
])
def test_bad_jobs_are_refused_before_spawning(job, msg):
    with pytest.raises(ValueError, match=msg):
        check_job(job, max_ranks=2)


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


def test_bad_link_sizes_are_refused_before_spawning():
    with pytest.raises(ValueError, match=r"multiples of 4 bytes .*\[6, 0\]"):
        link_benchmark(cpu_rig(), [4096, 6, 0])
