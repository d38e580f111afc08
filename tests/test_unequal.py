"""Two unequal cards: each device's timed forward + backward, the emulated pair on the CPU rig, and which pair a
comparison of splits runs on for every rig (the GPU rigs' choice checked with their measurements given)."""
from dataclasses import replace

import pytest
import torch

import helpers.unequal as unequal
from helpers.models import SyntheticTokens, build_stack, lm_loss, StackConfig
from helpers.runtime.rig import cpu_rig
from helpers.unequal import DeviceSpeeds, measure_speeds, unequal_pair

CFG = StackConfig(vocab=64, hidden=32, n_blocks=2, seq_len=8, heads=2)


@pytest.fixture(scope="module")
def small():
    model = build_stack(CFG)
    x, y = SyntheticTokens(4, CFG.seq_len, CFG.vocab).batch(0, 4)
    return model, x, y


def test_speeds_are_relative_to_device_0():
    measured = DeviceSpeeds(("a", "b"), (0.2, 0.5))
    assert measured.speeds == (1.0, 0.4)
    assert "b 500.0 ms (speed 0.40)" in str(measured)
    assert DeviceSpeeds(("a", "b"), (0.2, 0.5), ratios=(1.0, 0.45)).speeds == (1.0, 0.45)  # the rounds' own ratios


def test_the_emulated_device_waits_and_the_model_is_untouched(small, monkeypatch):
    """Device 1's forward and backward each wait once per round (no wall time asserted: the waits asked for are)."""
    waits = []
    monkeypatch.setattr("helpers.timeline.time.sleep", waits.append)
    model, x, y = small
    before = [p.detach().clone() for p in model.parameters()]
    rig = cpu_rig()
    measured = measure_speeds(model, x, y, lm_loss, rig.devices, rig.labels, slowdown=(1.0, 2.0), repeats=3)
    assert len(waits) == 2 * (3 + 1) and all(w >= 0 for w in waits)  # forward + backward, warm-up round included
    assert measured.speeds[0] == 1.0 and len(measured.seconds) == 2 and measured.slowdown == (1.0, 2.0)
    assert all(p.grad is None and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="give 2 factors"):
        measure_speeds(model, x, y, lm_loss, rig.devices, slowdown=(2.0,))
    with pytest.raises(ValueError, match="factor >= 1"):
        measure_speeds(model, x, y, lm_loss, rig.devices, slowdown=(1.0, 0.5), repeats=1)


def test_the_cpu_rig_trains_the_emulated_pair(small):
    pair = unequal_pair(cpu_rig(), *small, lm_loss, repeats=1)
    assert pair.trains and pair.slowdown == (1.0, 2.0) and pair.speeds == (1.0, 0.5)
    assert "slowdown 2" in str(pair)


@pytest.mark.parametrize("seconds, trains, speeds", [((0.10, 0.16), True, (1.0, 0.625)),  # e.g. a 4090 and a 3090
                                                     ((0.10, 0.102), False, (1.0, 0.5))])  # twins: predicted only
def test_gpus_train_a_real_unequal_pair_and_only_predict_for_twins(small, monkeypatch, seconds, trains, speeds):
    rig = replace(cpu_rig(), kind="two_gpus")
    monkeypatch.setattr(unequal, "measure_speeds", lambda *a, **k: DeviceSpeeds(("cuda:0", "cuda:1"), seconds))
    pair = unequal_pair(rig, *small, lm_loss)
    assert pair.trains == trains and pair.slowdown == () and pair.speeds == pytest.approx(speeds)
    one_gpu = unequal_pair(replace(rig, kind="one_gpu"), *small, lm_loss)
    assert not one_gpu.trains and one_gpu.speeds == (1.0, 0.5)
