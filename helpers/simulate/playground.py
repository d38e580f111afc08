"""A pipeline playground: turn the knobs, watch the simulated timeline, the bubble and the peak memory move.

The model is `pp` stages of one layer each (one per device), sharing a total forward and backward time per
micro-batch; the first stage carries (1 + imbalance) times the work of each other stage. Activations split evenly
across stages; what crosses each boundary is `boundary_mb` per micro-batch. With no frontend attached (nbval,
scripts, LAB_STATIC_WIDGETS=1) the panel draws once with its starting values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from helpers.facts import load_data
from helpers.units import MiB, fmt_bytes
from helpers.monitor import frontend_attached
from helpers.hardware import Link
from helpers.simulate.job import Job
from helpers.simulate.strategies import Simulation, simulate
from helpers.simulate.workload import Workload

SCHEDULES = ("naive", "gpipe", "1f1b")


def _pcie_3090(key: str) -> float:
    return load_data("hardware")["links"]["3090_gpu_to_gpu_no_p2p"][key]


@dataclass
class Knobs:
    """What the sliders set (starting values: a 2-stage 1F1B pipeline on a 3090 pair's PCIe link without P2P)."""

    pp: int = 2  # pipeline devices, a stage each
    microbatches: int = 4
    schedule: str = "1f1b"
    imbalance: float = 0.0
    bandwidth_gb_s: float = field(default_factory=lambda: _pcie_3090("gb_s_per_direction"))
    latency_us: float = field(default_factory=lambda: _pcie_3090("latency_us"))
    checkpointing: bool = False


class Playground:
    """Simulated pipeline timelines for a model costing `forward_ms` + `backward_ms` per micro-batch, holding
    `activation_mb` of activations per micro-batch and sending `boundary_mb` across each stage boundary."""

    def __init__(self, forward_ms: float = 12.0, backward_ms: float = 24.0, activation_mb: float = 1024.0,
                 boundary_mb: float = 8.0, knobs: Knobs | None = None):
        for what, value in (("forward_ms", forward_ms), ("backward_ms", backward_ms)):
            if not value > 0:
                raise ValueError(f"{what} must be positive, got {value}")
        if activation_mb < 0 or boundary_mb < 0:
            raise ValueError(f"activation_mb and boundary_mb must be >= 0, got {activation_mb} and {boundary_mb}")
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3
        self.activation_bytes, self.boundary_bytes = activation_mb * MiB, boundary_mb * MiB
        self.knobs = knobs or Knobs()

    @classmethod
    def from_workload(cls, workload: Workload, samples_per_microbatch: int, knobs: Knobs | None = None) -> "Playground":
        """Totals of a real workload (e.g. `transformer_workload` on a 3090) as the playground's model; the
        boundary is the largest output a cut could send."""
        b = samples_per_microbatch
        return cls(b * sum(layer.forward_s for layer in workload.layers) * 1e3,
                   b * sum(layer.backward_s for layer in workload.layers) * 1e3,
                   b * sum(layer.activations for layer in workload.layers) / MiB,
                   b * max(layer.output for layer in workload.layers[:-1] or workload.layers) / MiB, knobs)

    def workload(self, stages: int, imbalance: float) -> Workload:
        if imbalance < 0:
            raise ValueError(f"stage imbalance must be >= 0, got {imbalance}")
        weights = [1 + imbalance] + [1.0] * (stages - 1)
        shares = [w / sum(weights) for w in weights]
        return Workload.from_lists([self.forward_s * s for s in shares], [self.backward_s * s for s in shares],
                                   activations=[self.activation_bytes / stages] * stages,
                                   output=[self.boundary_bytes] * stages)

    def simulate(self, knobs: Knobs) -> Simulation:
        """One step with these knob settings (one sample per micro-batch: costs above are per micro-batch)."""
        m = 1 if knobs.schedule == "naive" else knobs.microbatches
        job = Job(knobs.schedule, batch=m, microbatches=m, pp=knobs.pp,
                  activation_checkpointing=knobs.checkpointing)
        link = Link(knobs.latency_us * 1e-6, knobs.bandwidth_gb_s * 1e9, "playground link")
        return simulate(self.workload(knobs.pp, knobs.imbalance), job, link)

    def describe(self, sim: Simulation) -> str:
        peaks = ", ".join(fmt_bytes(m.activations) for m in sim.memory.values())
        return (f"{sim.job.label()}: step {sim.step_s * 1e3:.1f} ms, bubble {sim.bubble:.0%}, "
                f"peak activations per stage {peaks}")

    def draw(self, knobs: Knobs, ax=None):
        """Simulate and draw; returns the simulation, or None with the reason printed when the knobs make no
        valid pipeline (e.g. 1F1B with fewer micro-batches than stages)."""
        try:
            sim = self.simulate(knobs)
        except ValueError as err:
            print(f"not a valid pipeline: {err}")
            return None
        sim.plot(ax=ax, title=self.describe(sim))
        print(self.describe(sim))
        return sim

    def controls(self) -> dict:
        """One ipywidget per knob, starting at the current knobs."""
        import ipywidgets as w

        k = self.knobs
        label = {"style": {"description_width": "initial"}}  # the whole name: "micro-batches", not "micro-bat..."
        return {
            "pp": w.IntSlider(k.pp, min=1, max=8, description="stages (pp)", **label),
            "microbatches": w.IntSlider(k.microbatches, min=1, max=32, description="micro-batches", **label),
            "schedule": w.Dropdown(options=SCHEDULES, value=k.schedule, description="schedule", **label),
            "imbalance": w.FloatSlider(k.imbalance, min=0.0, max=2.0, step=0.1, description="imbalance", **label),
            "bandwidth_gb_s": w.FloatLogSlider(k.bandwidth_gb_s, base=10, min=-1, max=3, description="GB/s", **label),
            "latency_us": w.FloatSlider(k.latency_us, min=0.0, max=200.0, step=1.0, description="latency (us)",
                                        **label),
            "checkpointing": w.Checkbox(k.checkpointing, description="checkpointing", **label),
        }

    def show(self):
        """The live panel with a frontend; otherwise one static drawing of the starting knobs (returned)."""
        if not frontend_attached():
            import matplotlib.pyplot as plt

            sim = self.draw(self.knobs)
            plt.show()
            return sim
        import ipywidgets as w
        import matplotlib.pyplot as plt
        from IPython.display import display

        controls = self.controls()

        def redraw(**values):
            self.knobs = Knobs(**values)
            self.draw(self.knobs)
            plt.show()

        display(w.VBox([w.HBox(list(controls.values())[:4]), w.HBox(list(controls.values())[4:]),
                        w.interactive_output(redraw, controls)]))
        return None
