"""Two unequal cards (the doctor's speed check): the same timed forward + backward of a small model on each device
(`helpers.unequal.measure_speeds`), the relative speeds, and the split `optimal_split(costs, 2, speeds=...)` would
give that model beside the split for equal devices. On the CPU rig the same code runs on the emulated pair (device 1
at slowdown 2.0), and the check fails if the emulation does not show: the emulated device must measure at least
half-way from equal to its factor (below 0.75 for a slowdown of 2; noise on a shared machine moves it either way)."""
from __future__ import annotations

import time

from helpers.doctor.checks import Check
from helpers.runtime.rig import Rig

SPEEDS = "unequal cards: each device's speed and the split"


def speed_check(rig: Rig, repeats: int = 5, say=print, cfg=None, batch: int = 4) -> Check:
    """PASS with the speeds and the split; FAIL on the CPU rig if the emulated device does not measure slower (at
    least half-way from 1 to 1 / its slowdown). `cfg`: the block stack timed (default notebook 02's model, whose
    layers are unlike: `nonuniform_config(1)`), on `batch` sequences."""
    from helpers.models import SyntheticTokens, build_stack, lm_loss, nonuniform_config
    from helpers.partition import optimal_split
    from helpers.profile import profile_layers
    from helpers.unequal import EMULATED, EQUAL_WITHIN, measure_speeds

    t0 = time.perf_counter()
    cfg = cfg or nonuniform_config(1)
    model = build_stack(cfg, device=rig.devices[0])
    x, y = SyntheticTokens(batch, cfg.seq_len, cfg.vocab).batch(0, batch)
    slowdown = EMULATED if rig.is_cpu else ()
    measured = measure_speeds(model, x, y, lm_loss, rig.devices[:2], rig.labels[:2], slowdown, repeats)
    costs = profile_layers(model, x.to(rig.devices[0]), repeats=3, loss_fn=lm_loss,
                           target=y.to(rig.devices[0])).costs("time")
    by_speed, equal = optimal_split(costs, 2, speeds=measured.speeds), optimal_split(costs, 2)
    layers = lambda split: f"{split.boundaries[0]} | {len(costs) - split.boundaries[0]}"  # noqa: E731
    speeds = ", ".join(f"{label} {v:.2f}" for label, v in zip(measured.labels, measured.speeds))
    what = f"emulated with slowdown {slowdown}" if slowdown else \
        ("unequal: split by speed" if min(measured.speeds) / max(measured.speeds) < 1 - EQUAL_WITHIN
         else f"equal within {EQUAL_WITHIN:.0%}")
    detail = (f"speeds {speeds} ({what}); split of a {len(costs)}-layer model by speed {layers(by_speed)}, for equal "
              f"devices {layers(equal)}\n{measured}")
    say("  " + detail.replace("\n", "\n  "))
    seconds = time.perf_counter() - t0
    if slowdown:
        expected = slowdown[0] / slowdown[1]
        if measured.speeds[1] > (1 + expected) / 2:
            return Check(SPEEDS, "FAIL", f"the emulated device measured speed {measured.speeds[1]:.2f}, expected "
                                         f"{expected:.2f} (slowdown {slowdown}): the Recorder did not stretch its "
                                         f"compute\n{detail}", seconds)
    return Check(SPEEDS, "PASS", detail, seconds)
