"""The inference speed model (helpers.inference.speed): its structure checked against the arithmetic it claims
(bandwidth-bound decode, halved reads under tensor parallelism, per-layer all-reduces at the small-message latency,
the pipeline's cycle), the named rigs' data and sources, the crossovers, the CLI; on the CPU rig the calibration and
the engines' measurement run end to end on a tiny model. Never a wall-clock assertion."""
import json
import math

import pytest

from helpers.facts import load_data
from helpers.sizing.shape import model_shape
from helpers.inference.speed import (Phase, breakeven_latency, crossover_table, crossovers, layer_cost, op_counts,
                                     predict_speed, speed_vs_batch, split_layers)
from helpers.inference.speed_rigs import (Device, SpeedRig, allreduce_over, speed_data, speed_rig, speed_rig_from_doctor,
                                          speed_rigs)
from helpers.plan import main as plan_main
from helpers.hardware import FREE_LINK, Link, gpu_named

RIGS_3090 = ("2x3090 PCIe", "2x3090 PCIe P2P", "2x3090 NVLink")


def test_every_named_rig_has_sourced_links_and_marks_its_estimates():
    hardware = load_data("hardware")
    for name, entry in speed_data()["rigs"].items():
        assert entry["link"] in hardware["links"] and all(g in hardware["gpus"] for g in entry["gpus"])
        rig = speed_rig(name)
        assert rig.allreduce.latency_s >= 2 * rig.hop.latency_s - 1e-12  # two ring steps, at least one message each
        assert all(rig.sources.values())
    small = speed_data()["allreduce_small"]
    assert small["nccl_floor_estimate"] and "estimate" in small["nccl_floor_source"] and small["rule_estimate"]
    assert {"2x3090 PCIe", "2x3090 PCIe P2P", "2x3090 NVLink", "3090 + 4090"} <= set(speed_rigs())
    with pytest.raises(ValueError, match="known rigs"):
        speed_rig("8x H100")


def test_small_message_allreduce_is_latency_bound_and_p2p_cuts_it():
    """A decode all-reduce carries a hidden state (16 KiB for Llama-2 70B's 8192 x 2 bytes): the latency is most of
    its cost, and P2P (1.01 us copies) brings it down to the NCCL floor from hardware.json's P2P-less all-reduce."""
    off, on = speed_rig("2x3090 PCIe").allreduce, speed_rig("2x3090 PCIe P2P").allreduce
    published = load_data("hardware")["links"]["3090_gpu_to_gpu_no_p2p"]["allreduce"]
    assert off.latency_s == pytest.approx(published["small_message_us"] * 1e-6)
    assert off.bandwidth == pytest.approx(published["busbw_gb_s"] * 1e9)
    assert on.latency_s == pytest.approx(speed_data()["allreduce_small"]["nccl_floor_us"] * 1e-6)
    hidden = 8192 * 2
    assert off.latency_s > 3 * hidden / off.bandwidth
    assert allreduce_over(Link(1e-3, 1e9)).latency_s == pytest.approx(2e-3)


def test_decode_is_bandwidth_bound_and_tensor_parallel_halves_the_reads():
    p = predict_speed("llama-2-70b", "nf4", "2x3090 PCIe", batch=1, context=1024)
    shape = model_shape("llama-2-70b", "nf4")
    read = sum(layer_cost(layer, shape, Phase("decode", 1, 1, 1024))[0] for layer in shape.layers)
    one = next(r for r in p.rows if r.engine == "one device" and r.phase == "decode")
    assert one.seconds == pytest.approx(read / gpu_named("RTX 3090").memory_bandwidth, rel=0.05)  # bandwidth-bound
    split = next(r for r in p.rows if r.engine == "layer split" and r.phase == "decode")
    tp = next(r for r in p.rows if r.engine == "tensor parallel" and r.phase == "decode")
    assert split.tok_s == pytest.approx(one.tok_s, rel=0.02)  # one card at a time: the split buys memory
    assert tp.parts["device 0"] == pytest.approx(one.seconds / 2, rel=0.05)
    ar = speed_rig("2x3090 PCIe").allreduce.seconds(8192 * 2)
    assert tp.parts["link"] == pytest.approx(80 * 2 * ar + speed_rig("2x3090 PCIe").allreduce.seconds(32000), rel=1e-6)
    assert p.tok_s("pipelined", "decode") == pytest.approx(2 * split.tok_s, rel=0.03)  # both cards, two requests


def test_p2p_speeds_tensor_parallel_decode_not_the_layer_split():
    off = predict_speed("llama-2-70b", "nf4", "2x3090 PCIe", 1, 1024)
    on = predict_speed("llama-2-70b", "nf4", "2x3090 PCIe P2P", 1, 1024)
    assert on.tok_s("tensor parallel", "decode") > 1.1 * off.tok_s("tensor parallel", "decode")
    assert on.tok_s("layer split", "decode") == pytest.approx(off.tok_s("layer split", "decode"), rel=0.01)
    assert on.tok_s("tensor parallel", "prefill") > off.tok_s("tensor parallel", "prefill")  # MiB-sized: bandwidth


def test_four_bit_batches_read_a_dequantised_copy():
    """bitsandbytes' fast 4-bit kernels serve one row; more rows dequantise to 16 bits first."""
    shape = model_shape("llama-2-7b", "nf4")
    layer = shape.decoder_layers[0]
    one, four = (layer_cost(layer, shape, Phase("decode", b, 1, 1))[0] for b in (1, 4))
    assert four - one == pytest.approx(2 * layer.params * 2, rel=0.01)
    bf16 = model_shape("llama-2-7b", "bf16")
    assert layer_cost(bf16.decoder_layers[0], bf16, Phase("decode", 4, 1, 1))[0] == pytest.approx(
        layer_cost(bf16.decoder_layers[0], bf16, Phase("decode", 1, 1, 1))[0], rel=0.01)


def test_unequal_cards_split_by_bandwidth_and_prefill_is_compute_bound():
    shape = model_shape("llama-2-13b", "fp16")
    rig = speed_rig("3090 + 4090")
    devices = split_layers(shape, rig)
    assert devices[0] == 0 and devices[-1] == 1 and devices == sorted(devices)
    p = predict_speed("llama-2-13b", "fp16", rig, 1, 2048)
    split = next(r for r in p.rows if r.engine == "layer split" and r.phase == "prefill")
    assert split.parts["device 1"] < 0.7 * split.parts["device 0"]  # the 4090 computes ~2.2x faster


def test_host_floor_counts_the_ops_a_layer_dispatches():
    ops = op_counts("llama")
    assert 20 <= ops.per_layer <= 120 and ops.outside > 0
    slow = Device("slow host", 1e15, ((1, 1e18),), 1e-3)
    rig = SpeedRig("host-bound", (slow, slow), FREE_LINK, Link(0.0, math.inf), host_overlaps=True)
    p = predict_speed("llama-2-7b", "bf16", rig, 1, 128)
    decode = next(r for r in p.rows if r.engine == "one device" and r.phase == "decode")
    assert decode.seconds == pytest.approx((32 * ops.per_layer + ops.outside) * 1e-3, rel=0.01)


def test_pipelined_prefill_pays_the_busy_rate_only_while_both_stages_work():
    """Two prompts through two stages: the first stage takes the first prompt alone, both work at once on one prompt
    each, then the second stage takes the last one alone: only the overlap runs at the busy rate (the earlier model
    charged it to both stages' whole round trip: 3 busy stages instead of 2 alone and 1 busy)."""
    from helpers.inference.speed import layer_split, pipelined

    shape, ops = model_shape("llama-2-7b", "fp16"), op_counts("llama")
    cpu = Device("cpu", 1e10, ((1, 1e11),), 1e-6, busy_slowdown=2.0)
    rig = SpeedRig("cpu", (cpu, cpu), FREE_LINK, Link(1e-4, 1e9), host_overlaps=False)
    phase = Phase("prefill", 1, 64, 64)
    alone = layer_split(shape, phase, rig, ops)
    both = pipelined(shape, phase, rig, ops, requests=2)
    busy = max(both.parts["device 0"], both.parts["device 1"])
    assert busy > 1.5 * max(alone.parts["device 0"], alone.parts["device 1"])  # the overlap is slower...
    assert both.seconds == pytest.approx(alone.seconds + busy)  # ...but only the overlap


def test_a_pipelined_decode_phase_pays_the_pipelines_fill_once():
    """A decode phase of `steps` steps per request starts with the pipeline empty: the last stage waits while the
    first computes its first step alone, once per phase, so each cycle costs the steady one plus that step over
    `steps` (the engine's timelines: 94-96 ms per cycle where the steady cycle is 86 ms); the steady state is what
    a long generation sees."""
    from helpers.inference.speed import layer_split, pipelined

    shape, ops = model_shape("llama-2-7b", "fp16"), op_counts("llama")
    cpu = Device("cpu", 1e10, ((1, 1e11),), 1e-6, busy_slowdown=1.5)
    rig = SpeedRig("cpu", (cpu, cpu), FREE_LINK, Link(1e-4, 1e9), host_overlaps=False)
    decode = Phase("decode", 4, 1, 64)
    steady = pipelined(shape, decode, rig, ops)
    first_alone = layer_split(shape, decode, rig, ops).parts["device 0"]
    for steps in (1, 7, 100):
        assert pipelined(shape, decode, rig, ops, steps=steps).seconds == pytest.approx(
            steady.seconds + first_alone / steps)
    prefill = Phase("prefill", 4, 64, 64)  # prefill's fill and drain are in its own formula
    assert pipelined(shape, prefill, rig, ops, steps=7).seconds == pipelined(shape, prefill, rig, ops).seconds


def test_pipelined_stages_wait_for_the_interpreter_lock_on_every_op_only_while_both_work():
    """The pipelined engine's stage threads share one interpreter lock: while both work, each op a stage dispatches
    waits `lock_wait_s_per_op` more (its layers' ops, and the ops outside the layers each stage runs); the layer split
    (one stage at a time) and tensor parallelism (one process per rank) never wait for it."""
    from dataclasses import replace

    from helpers.inference.speed import layer_split, pipelined, tensor_parallel

    shape, ops = model_shape("llama-2-7b", "fp16"), op_counts("llama")
    cpu = Device("cpu", 1e10, ((1, 1e11),), 1e-6, busy_slowdown=1.2)
    rig = SpeedRig("cpu", (cpu, cpu), FREE_LINK, Link(1e-4, 1e9), host_overlaps=False)
    waiting = replace(rig, devices=(replace(cpu, lock_wait_s_per_op=1e-5),) * 2)
    decode = Phase("decode", 1, 1, 128)
    per_stage = [layers * ops.per_layer + ops.outside for layers in (16, 16)]  # 32 decoder layers cut in half
    free, locked = (pipelined(shape, decode, r, ops) for r in (rig, waiting))
    for d in (0, 1):
        assert locked.parts[f"device {d}"] - free.parts[f"device {d}"] == pytest.approx(per_stage[d] * 1e-5)
    for engine in (layer_split, tensor_parallel):
        assert engine(shape, decode, waiting, ops).seconds == engine(shape, decode, rig, ops).seconds
    prefill = Phase("prefill", 1, 64, 64)  # only the overlap waits: one stage-time's worth, not three
    added = pipelined(shape, prefill, waiting, ops).seconds - pipelined(shape, prefill, rig, ops).seconds
    assert added == pytest.approx(max(per_stage) * 1e-5)


def test_a_decoder_layers_activation_work_adds_to_its_roofline_by_rows_and_share():
    """`Device.activation_s` (the CPU rig's measured work of a decoder layer beyond its weights' roofline and its
    dispatch) is interpolated by rows, the nearest point's outside the measured ones, and added to every decoder
    layer: whole on one device, half per rank under tensor parallelism; the embedding and the head never pay it."""
    from dataclasses import replace

    from helpers.inference.speed import one_device, tensor_parallel, unit_seconds

    shape, ops = model_shape("llama-2-7b", "fp16"), op_counts("llama")
    cpu = Device("cpu", 1e10, ((1, 1e11),), 1e-6)
    working = replace(cpu, activation_s=((1, 1e-4), (16, 4e-4)))
    assert [working.activation_seconds(r) for r in (1, 6, 16, 1024)] == pytest.approx([1e-4, 2e-4, 4e-4, 4e-4])
    assert working.activation_seconds(16, prefill=True) == pytest.approx(4e-4)  # no prefill points: decode's
    prefilling = replace(working, prefill_activation_s=((16, 1e-3), (64, 3e-3)))
    assert [prefilling.activation_seconds(r, prefill=True) for r in (16, 32, 1024)] == pytest.approx([1e-3, 5e-3 / 3,
                                                                                                     3e-3])
    assert prefilling.activation_seconds(16) == pytest.approx(4e-4)  # a decode step keeps its own points
    rig = SpeedRig("cpu", (cpu, cpu), FREE_LINK, Link(1e-4, 1e9), host_overlaps=False)
    slower = replace(rig, devices=(working, working))
    decode = Phase("decode", 6, 1, 128)
    layers = len(shape.decoder_layers)
    added = one_device(shape, decode, slower, ops).seconds - one_device(shape, decode, rig, ops).seconds
    assert added == pytest.approx(layers * 2e-4)
    for layer in shape.layers:
        added = (unit_seconds(layer, shape, decode, working, slower, ops.per_layer, 0.5)
                 - unit_seconds(layer, shape, decode, cpu, rig, ops.per_layer, 0.5))
        assert added == pytest.approx(1e-4 if layer.kind == "decoder" else 0.0)
    halves = [tensor_parallel(shape, decode, r, ops).parts["device 0"] for r in (slower, rig)]
    assert halves[0] - halves[1] == pytest.approx(layers * 1e-4)  # each rank: half of every layer's
    prefill = Phase("prefill", 1, 32, 32)  # a prefill pays the prefill points where measured
    measured = replace(rig, devices=(prefilling, prefilling))
    added = one_device(shape, prefill, measured, ops).seconds - one_device(shape, prefill, rig, ops).seconds
    assert added == pytest.approx(layers * 5e-3 / 3)


def test_tensor_parallel_all_reduces_wait_for_the_drift_over_the_work_between_them():
    """Each all-reduce waits, beyond its latency, what the calibration measured after as much work since the last
    one (interpolated between its points, never extrapolated past the last); the row-parallel linears' DTensor work
    comes with their all-reduce (as the CPU rig measures it), so only the five column-parallel linears pay
    `sharded_linear_s`."""
    from dataclasses import replace

    from helpers.inference.speed import COLUMN_LINEARS_PER_LAYER, tensor_parallel, unit_seconds

    shape, ops = model_shape("llama-2-7b", "fp16"), op_counts("llama")
    cpu = Device("cpu", 1e10, ((1, 1e11),), 1e-6)
    rig = SpeedRig("cpu", (cpu, cpu), FREE_LINK, Link(1e-3, 1e9), host_overlaps=False,
                   sharded_linear_s=((1, 1e-4), (64, 5e-4)))
    waiting = replace(rig, allreduce_waits=((1e-3, 0.0), (4e-3, 6e-4), (16e-3, 8e-4)))
    assert [waiting.allreduce_wait(w) for w in (0.0, 2.5e-3, 10e-3, 1.0)] == pytest.approx([0, 3e-4, 7e-4, 8e-4])
    phase = Phase("decode", 1, 1, 128)
    still, drifting = (tensor_parallel(shape, phase, r, ops) for r in (rig, waiting))
    layer = shape.decoder_layers[0]
    work = unit_seconds(layer, shape, phase, cpu, rig, ops.per_layer + 2, 0.5, busy=True,
                        extra_host_s=1e-4 * COLUMN_LINEARS_PER_LAYER) / 2  # between two all-reduces
    collectives = 2 * len(shape.decoder_layers)
    assert drifting.parts["link"] - still.parts["link"] == pytest.approx(collectives * waiting.allreduce_wait(work))
    assert drifting.parts["device 0"] == still.parts["device 0"]
    unsharded = replace(rig, sharded_linear_s=())
    plain = tensor_parallel(shape, phase, unsharded, ops)
    layers = len(shape.decoder_layers)  # DTensor's host time on q, k, v, gate and up; o and down's is in the link
    assert still.parts["device 0"] - plain.parts["device 0"] == pytest.approx(layers * COLUMN_LINEARS_PER_LAYER * 1e-4)
    prefill = Phase("prefill", 1, 16, 16)  # by the rows each linear multiplies: 16 of them
    added = tensor_parallel(shape, prefill, rig, ops).parts["device 0"] - tensor_parallel(shape, prefill, unsharded,
                                                                                           ops).parts["device 0"]
    assert added == pytest.approx(layers * COLUMN_LINEARS_PER_LAYER * (1e-4 + 15 / 63 * 4e-4))


def test_crossovers_state_where_and_why():
    rows = crossovers("llama-2-70b", "nf4", "2x3090 PCIe", batches=(1, 4), contexts=(512, 4096))
    assert {(c.phase, c.axis) for c in rows} == {(p, a) for p in ("prefill", "decode") for a in ("batch", "context")}
    decode = next(c for c in rows if c.phase == "decode" and c.axis == "batch")
    assert decode.start_winner == "tensor parallel" and "all-reduces" in decode.reason
    table = crossover_table("llama-2-7b", "nf4", ["2x3090 PCIe"])
    assert len(table) == 4 and all(row["why"] for row in table)


def test_the_link_crossover_is_where_the_all_reduces_eat_the_saving():
    """70B nf4, batch 1 decode on the P2P-less pair: tensor parallelism saves about half of a 42 ms step, spread over
    160 all-reduces; it stops paying where they cost that much. A 7B at batch 1 is host-bound: no link helps."""
    latency = breakeven_latency("llama-2-70b", "nf4", "2x3090 PCIe")
    p = predict_speed("llama-2-70b", "nf4", "2x3090 PCIe", 1, 1024)
    tp = next(r for r in p.rows if r.engine == "tensor parallel" and r.phase == "decode")
    split = next(r for r in p.rows if r.engine == "layer split" and r.phase == "decode")
    per_allreduce_now = speed_rig("2x3090 PCIe").allreduce.latency_s
    saved = split.seconds - tp.seconds
    assert latency == pytest.approx(per_allreduce_now + saved / 161, rel=0.05)  # 2 x 80 layers + the logits
    assert breakeven_latency("llama-2-7b", "nf4", "2x3090 PCIe") is None


def test_speed_vs_batch_rows_cover_every_engine_and_phase():
    rows = speed_vs_batch("llama-2-7b", "nf4", "2x3090 PCIe", [1, 4], 512)
    assert len(rows) == 2 * 2 * 4 and all(r["tok/s"] > 0 for r in rows)


def test_cli_speed(capsys):
    plan_main(["--speed", "--model", "llama-2-70b", "--dtype", "nf4", "--batch", "1", "--context", "1024",
               "--rig", "all", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert {r["rig"] for r in rows} == set(speed_rigs()) and {r["phase"] for r in rows} == {"prefill", "decode"}
    plan_main(["--speed", "--model", "llama-2-7b", "--dtype", "4bit", "--rig", "2x3090 NVLink"])
    assert "tensor parallel" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_main(["--speed", "--rig", "nope"])
    with pytest.raises(SystemExit):
        plan_main(["--speed", "--batch", "0"])


def test_a_doctor_report_is_a_rig(tmp_path):
    """Your GPUs by name, the doctor's point-to-point link as the hop, its hidden-state-size all-reduce fit."""
    report = {"topology": {"gpus": [{"name": "NVIDIA GeForce RTX 3090"}, {"name": "NVIDIA GeForce RTX 4090"}]},
              "links": [{"path": "processes: point-to-point (nccl)", "latency_us": 20.0, "GB/s": 10.0},
                        {"path": "processes: all-reduce (nccl)", "latency_us": 30.0, "GB/s": 8.0},
                        {"path": "processes: all-reduce (nccl), hidden-state sizes", "latency_us": 42.0,
                         "GB/s": 5.0}]}
    (tmp_path / "doctor.json").write_text(json.dumps(report))
    rig = speed_rig(str(tmp_path / "doctor.json"))
    assert [d.name for d in rig.devices] == ["RTX 3090", "RTX 4090"]
    assert rig.allreduce.latency_s == pytest.approx(42e-6) and rig.hop.latency_s == pytest.approx(20e-6)
    assert predict_speed("llama-2-13b", "nf4", rig).tok_s("tensor parallel", "decode") > 0
    with pytest.raises(ValueError, match="two"):
        speed_rig_from_doctor({"topology": {}, "links": []})
    with pytest.raises(ValueError, match="helpers.doctor --json"):
        speed_rig(str(tmp_path / "missing.json"))


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="batch"):
        predict_speed("llama-2-7b", "bf16", "2x3090 PCIe", batch=0)
    with pytest.raises(ValueError, match="prompt"):
        predict_speed("llama-2-7b", "bf16", "2x3090 PCIe", context=128, prompt=256)


def test_the_simulator_exports_the_speed_model():
    import helpers.simulate as simulate

    assert simulate.predict_speed is predict_speed and "predict_speed" in simulate.__all__


def test_cpu_rig_micro_benchmarks_and_the_comparison(tmp_path):
    """The in-process calibration (weight streaming, matmul rates by rows, host time per op and the interpreter lock's
    wait per op with both device threads decoding), sampled in rounds, gives rates for a model given as a config
    directory; the comparison puts a prediction and its error beside each measured row."""
    import torch
    from transformers import LlamaConfig

    from helpers.inference.speed_bench import compare
    from helpers.inference.speed_calibration import DeviceCalibration, StageForwards

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    small = model_shape(str(tmp_path), "fp32")
    calibration = DeviceCalibration(small, torch.float32, [4, 1, 4], prefills=[(1, 16), (4, 8), (2, 16)])
    with pytest.raises(ValueError, match="no round"):
        calibration.device()
    calibration.sample()
    calibration.sample()
    device = calibration.device()
    assert calibration.rounds == 2
    for i in (0, 1):  # one round alone: its own readings, not the medians of both
        assert calibration.device([i]).bandwidth == pytest.approx(calibration.nbytes / calibration.alone[1][i])
    assert calibration.device([0, 1]) == device
    with pytest.raises(ValueError, match="not among the 2 sampled"):
        calibration.device([1, 2])
    rate = device.bandwidth
    assert rate > 0 and device.busy_slowdown >= 1 and device.host_s_per_op >= 0 and device.lock_wait_s_per_op >= 0
    assert [r for r, _ in device.flops] == [r for r, _ in device.busy_flops] == [1, 4]  # a point per row count
    assert device.flops[0][1] == pytest.approx(2 * rate / 4)  # one row: the streaming sweep's rate (fp32)
    assert [b for b, _ in device.activation_s] == [1, 4, 16] and all(s >= 0 for _, s in device.activation_s)
    # a point per prefill's rows, one where two prefills multiply as many (4 x 8 and 2 x 16)
    prefill_points = device.prefill_activation_s
    assert [r for r, _ in prefill_points] == [16, 32] and min(s for _, s in prefill_points) >= 0
    wait, steps, prefills = StageForwards(config, torch.float32, batches=(1, 2), prefills=[(2, 8)]).sample()
    assert 0 <= wait < 1e-3 and sorted(steps) == [1, 2] and all(s > 0 for s in steps.values())
    assert list(prefills) == [(2, 8)] and prefills[(2, 8)] > 0
    busy = Device("cpu", 1e9, ((1, 4e9), (16, 8e9)), 0.0, 2.0, ((1, 1e9), (16, 4e9)))
    assert busy.rate(4, busy=True) == pytest.approx(2.5e9) and busy.rate(4) == pytest.approx(6e9)  # log-interpolated
    assert Device("gpu", 1e9, ((1, 4e9),), 0.0, 2.0).rate(1, busy=True) == 2e9  # no busy points: the slowdown
    dev = Device("cpu", rate, ((1, 1e9),), 1e-6)
    rig = SpeedRig("measured", (dev, dev), FREE_LINK, Link(1e-4, 1e9), host_overlaps=False)
    measured = [{"engine": e, "phase": p, "batch": 1, "prompt": 8, "new_tokens": 4, "tok/s": 10.0, "measured": True}
                for e in ("layer split", "pipelined", "tensor parallel") for p in ("prefill", "decode")]
    rows = compare(measured, rig, small)
    assert all(r["error"] == pytest.approx(r["predicted tok/s"] / 10 - 1) for r in rows)
    assert predict_speed(str(tmp_path), "fp32", rig, 2, 64).tok_s("tensor parallel", "decode") > 0


def test_the_calibration_refuses_a_gpu_rig_before_any_rank_starts():
    """The speed bench's calibration times CPU virtual devices: on a GPU rig it says where GPU figures come from
    (the doctor) before it loads, measures or launches anything (the model given here does not even exist)."""
    import torch

    from helpers.inference.speed_bench import measure_engines
    from helpers.inference.speed_calibration import calibrate_cpu_rig, tensor_parallel_sample
    from helpers.runtime.rig import Rig

    gpus = Rig("two_gpus", (torch.device("cuda", 0), torch.device("cuda", 1)), ("RTX 3090",) * 2, (24 << 30,) * 2,
               "nccl", 2)
    for calibrate in (calibrate_cpu_rig, tensor_parallel_sample):
        with pytest.raises(ValueError, match="helpers.doctor --json"):
            calibrate(None, gpus, [1, 16], 1)
    with pytest.raises(ValueError, match="launches must be at least 1"):  # nor a bench with no launch to time
        measure_engines(None, gpus, [1], [8], new_tokens=3, launches=0)


def test_the_ranks_launches_are_priced_by_their_medians_field_by_field():
    """Several launches of the all-reduce timing (one before each measurement): each field's median, the waits point
    by point, still never shrinking with more work."""
    from helpers.inference.speed_calibration import median_sample

    def launch(latency: float, waits: tuple) -> dict:
        return {"latency_s": latency, "bandwidth": 1e9, "sharded_linear_s": ((1, latency / 10), (64, latency)),
                "waits": waits}

    got = median_sample([launch(1e-3, ((1e-3, 0.0), (4e-3, 1e-3), (16e-3, 3e-3))),
                         launch(3e-3, ((1e-3, 0.0), (4e-3, 2e-3), (16e-3, 2e-3))),
                         launch(2e-3, ((2e-3, 0.0), (5e-3, 5e-4), (17e-3, 9e-4)))])
    assert got["latency_s"] == 2e-3 and got["bandwidth"] == 1e9 and got["sharded_linear_s"] == ((1, 2e-4), (64, 2e-3))
    assert got["waits"] == ((1e-3, 0.0), (4e-3, 1e-3), (16e-3, 2e-3))


def test_a_runs_calibration_replays_its_rows(tmp_path):
    """--json keeps the SpeedRig and the model's config beside the rows; --replay predicts them again from those
    alone (no measurement), as compare did in the run."""
    from transformers import LlamaConfig

    from dataclasses import asdict, replace

    from helpers.inference.speed_bench import (compare, compare_by_case, main, replay, rig_from_dict,
                                               within_summary)

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    small = model_shape(str(tmp_path), "fp32")
    cpu = Device("cpu", 1e10, ((1, 1e9), (16, 4e9)), 1e-6, 1.2, ((1, 8e8), (16, 3e9)))
    rig = SpeedRig("measured", (cpu, cpu), FREE_LINK, Link(1e-3, 1e9), host_overlaps=False,
                   sharded_linear_s=((1, 1e-4),), allreduce_waits=((1e-3, 0.0), (4e-3, 2e-4)))
    saved = json.loads(json.dumps(asdict(rig)))
    assert rig_from_dict(saved) == rig
    assert rig_from_dict({**saved, "sharded_linear_s": 1e-4}) == rig  # a run saved when it was one figure
    measured = [{"engine": e, "phase": p, "batch": 4, "prompt": 16, "new_tokens": 4, "tok/s": 50.0, "measured": True}
                for e in ("layer split", "pipelined", "tensor parallel") for p in ("prefill", "decode")]
    rows = compare(measured, rig, small)
    (tmp_path / "run.json").write_text(json.dumps({"speed_rig": saved, "config": small.config.to_dict(),
                                                    "rows": rows}))
    again, by_case = replay(str(tmp_path / "run.json"))
    assert [r["predicted tok/s"] for r in again] == pytest.approx([r["predicted tok/s"] for r in rows])
    assert by_case == []  # a run written before each case kept its own rounds
    errors = [{"error": e} for e in (0.1, -0.2, 0.15)]
    assert within_summary(errors) == "priced by the whole run's rounds: 2 of 3 within 15%, mean |error| 15.0%"
    assert within_summary(errors, errors[:1]).endswith("each case by the rounds just before and after it: 1 of 1 "
                                                       "within 15%, mean |error| 10.0% (for a machine whose speed "
                                                       "moves during a run)")
    # each case priced by its own rounds: a run saved with a rig per case replays each row with its case's
    slower = replace(rig, devices=(replace(cpu, bandwidth=5e9),) * 2)
    cases = {(4, 16): rig, (1, 16): slower}
    two = measured + [{**m, "batch": 1} for m in measured]
    by_case = compare_by_case(two, cases, small)
    assert by_case == compare(measured, rig, small) + compare(two[len(measured):], slower, small)
    (tmp_path / "cases.json").write_text(json.dumps({
        "speed_rig": saved, "config": small.config.to_dict(), "rows": by_case,
        "case_rigs": [{"batch": b, "prompt": p, "speed_rig": asdict(r)} for (b, p), r in cases.items()]}))
    whole, cased = replay(str(tmp_path / "cases.json"))
    assert [r["predicted tok/s"] for r in cased] == pytest.approx([r["predicted tok/s"] for r in by_case])
    assert [r["predicted tok/s"] for r in whole] == pytest.approx(
        [r["predicted tok/s"] for r in compare(two, rig, small)])  # the whole run's rig, as the table prints
    (tmp_path / "old.json").write_text(json.dumps({"rows": rows}))
    with pytest.raises(ValueError, match="no calibration"):
        main(["--replay", str(tmp_path / "old.json")])
    with pytest.raises(SystemExit):  # refused before a model is saved or a rank starts
        main(["--launches", "0"])


@pytest.mark.full
def test_cpu_rig_calibration_and_measurement_run_end_to_end(tmp_path):
    """The measured rig: micro-benchmarks (two ranks for the all-reduce and DTensor), both engines measured at two
    batches, every measured row beside its prediction. Rates only checked to be rates: the machine is shared."""
    from helpers.inference.speed_bench import compare, error_summary, measure_engines, save_model
    from helpers.inference.speed_calibration import calibrate_cpu_rig
    from helpers.runtime.rig import cpu_rig

    rig = cpu_rig(threads=1)
    model = save_model(str(tmp_path / "m"), hidden=64, layers=2, vocab=96)
    speed = calibrate_cpu_rig(model, rig, [1, 2, 8, 16], repeats=1)
    assert speed.devices[0].bandwidth > 0 and speed.allreduce.latency_s > 0 and not speed.host_overlaps
    measured = measure_engines(model, rig, [1, 2], [8], new_tokens=3, repeats=1, launches=2)
    assert {(r["engine"], r["phase"], r["batch"]) for r in measured} == {
        (e, p, b) for e in ("layer split", "pipelined", "tensor parallel") for p in ("prefill", "decode")
        for b in (1, 2)}
    rows = compare(measured, speed, model_shape(model.path, "fp32"))
    assert all(r["predicted tok/s"] > 0 and math.isfinite(r["error"]) for r in rows)
    assert len(error_summary(rows)) == 6


@pytest.mark.full
def test_the_speed_bench_command_prices_every_case_and_keeps_its_rounds(tmp_path):
    """The command line as a learner runs it (its own process: it claims the CPU device), on a tiny model: a round
    before each case and one after the last, so a rig per case in the order measured; the table priced by the whole
    run, which --replay gives back row for row; the last line both fits."""
    import subprocess
    import sys

    from helpers.inference.speed_bench import replay

    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "helpers.inference.speed_bench", "--hidden", "64", "--layers", "2",
                           "--vocab", "96", "--batches", "1,2", "--prompts", "8", "--new-tokens", "3", "--repeats",
                           "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert [(c["batch"], c["prompt"]) for c in saved["case_rigs"]] == [(1, 8), (2, 8)]
    assert len(saved["rows"]) == 12 and all(math.isfinite(r["error"]) for r in saved["rows"])
    rows, by_case = replay(str(out))
    assert [r["predicted tok/s"] for r in rows] == pytest.approx([r["predicted tok/s"] for r in saved["rows"]])
    assert len(by_case) == 12
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("priced by the whole run's rounds: ") and "each case by the rounds" in last


def test_doctor_fits_the_all_reduce_over_hidden_state_sizes():
    from helpers.doctor import links
    from helpers.runtime.rig import cpu_rig

    rows = links(cpu_rig(threads=1), [2**12, 2**14, 2**16, 2**23], 3)  # one large message: the whole sweep fits
    small = [r for r in rows if r["path"].endswith("hidden-state sizes")]
    assert len(small) == 1 and [s["bytes"] for s in small[0]["samples"]] == [2**12, 2**14, 2**16]


def test_a_small_message_fit_never_prices_a_message_at_zero_latency():
    """Hidden-state sizes are all latency: where noise makes the fitted line's intercept zero (seen on a busy CPU rig:
    0 us + bytes / 1.3 MB/s), the link is the median time instead, as where the times do not grow with the size."""
    from helpers.simulate.calibrate import fit_small_messages

    steep = fit_small_messages([256, 512, 2048, 4096], [1e-4, 3e-4, 1.5e-3, 3.1e-3], "noisy")
    assert steep.latency_s == pytest.approx(9e-4) and steep.bandwidth == float("inf")
    clean = fit_small_messages([1024, 2048, 4096, 8192], [1.1e-4, 1.2e-4, 1.4e-4, 1.8e-4], "clean")
    assert clean.latency_s == pytest.approx(1e-4, rel=0.05) and clean.bandwidth < float("inf")
