"""The "will it fit?" form: pick a model, weight format, context, batch and GPUs; see each GPU's memory and the split.

Every change of an input re-plans (helpers.inference.plan) and redraws one stacked bar per GPU (weights / KV cache /
workspace / reserve / free, capacity as a line) above the per-GPU table. When nothing fits, it draws the split that
overflows least, over the capacity line, with the planner's alternatives. With no frontend attached (nbval, scripts,
LAB_STATIC_WIDGETS=1) it prints and draws once.
"""
from __future__ import annotations

from helpers.inference.plan import DoesNotFit, Placement, plan
from helpers.sizing.ledger import stacked_bars
from helpers.sizing.shape import known_formats, known_models, weight_format
from helpers.units import GiB
from helpers.monitor import frontend_attached

PRESET_GPUS = ("2 x RTX 3090", "RTX 3090", "RTX 3090, RTX 4090", "2 x RTX 4090", "2 x A100 80GB SXM")
PARTS = (("weights", "weights_bytes", "tab:blue"), ("KV cache", "kv_cache_bytes", "tab:orange"),
         ("workspace", "workspace_bytes", "tab:green"), ("reserve", "reserve_bytes", "tab:gray"))


def plot_placement(placement: Placement, ax=None, title: str | None = None):
    """One stacked bar per GPU in GiB: weights, KV cache, workspace, reserve, then what is free; a black line marks
    each GPU's capacity, so an over-full GPU's bar rises above it."""
    devices, s = placement.devices, placement.shape
    parts = [(name, [getattr(d, attr) / GiB for d in devices], {"color": color}) for name, attr, color in PARTS]
    parts.append(("free", [max(d.free_bytes, 0) / GiB for d in devices],
                  {"color": "white", "edgecolor": "tab:gray", "hatch": "//"}))
    return stacked_bars([d.label for d in devices], parts, ax, (6.5, 3.4), "GiB", title or (
        f"{s.name} {s.format.name}, {placement.context} tokens x {placement.batch}: "
        f"{'fits' if placement.fits else 'does NOT fit'}"), [d.gpu.capacity_bytes / GiB for d in devices],
        legend_outside=True, title_size=10)[0]


class FitForm:
    """The form and its last result. `inputs` are ipywidgets (they work without a frontend too, so changing one
    re-plans in tests); `show()` displays the live form, or prints and draws once without a frontend."""

    def __init__(self, model: str = "llama-2-13b", dtype: str = "fp16", context: int = 4096, batch: int = 1,
                 gpus: str = "2 x RTX 3090", logits: str = "last"):
        import ipywidgets as w

        self.logits = logits
        self.inputs = {
            "model": w.Dropdown(options=known_models(), value=model, description="model"),
            "dtype": w.Dropdown(options=known_formats(), value=weight_format(dtype).name, description="weights"),
            "context": w.BoundedIntText(value=context, min=1, max=10**7, step=512, description="context"),
            "batch": w.BoundedIntText(value=batch, min=1, max=4096, description="batch"),
            "gpus": w.Combobox(value=gpus, options=PRESET_GPUS, ensure_option=False, description="GPUs"),
        }
        self.output = w.Output()
        self.figure = None
        self.result: Placement | ValueError | None = None
        self.text = ""
        for widget in self.inputs.values():
            widget.observe(self._changed, names="value")
        self.recompute()

    def recompute(self) -> Placement | ValueError:
        """Plan for the current inputs; a plan that does not fit or bad input becomes the result and the text."""
        v = {name: widget.value for name, widget in self.inputs.items()}
        try:
            self.result = plan(v["model"], v["dtype"], v["context"], v["batch"], v["gpus"], self.logits)
            self.text = self.result.describe(with_map=False)
        except ValueError as err:  # DoesNotFit included: its message lists what would fit
            self.result = err
            self.text = str(err)
        return self.result

    @property
    def placement(self) -> Placement | None:
        """What to draw: the plan, or the least-overflowing split when nothing fits."""
        if isinstance(self.result, DoesNotFit):
            return self.result.closest
        return self.result if isinstance(self.result, Placement) else None

    def draw(self):
        """Print the text and draw the bars for the current result (a new figure each time)."""
        import matplotlib.pyplot as plt

        print(self.text)
        if self.placement is None:
            self.figure = None
            return None
        fig, ax = plt.subplots(figsize=(6.5, 3.4))
        plot_placement(self.placement, ax)
        fig.tight_layout()
        self.figure = fig
        return fig

    def _changed(self, _change) -> None:
        self.recompute()
        if frontend_attached():
            self._redraw_live()

    def _redraw_live(self) -> None:
        import matplotlib.pyplot as plt

        with self.output:
            self.output.clear_output(wait=True)
            self.draw()
            plt.show()

    def show(self) -> "FitForm":
        """The live form with a frontend; otherwise one printed and drawn snapshot."""
        if not frontend_attached():
            self.draw()
            return self
        import ipywidgets as w
        from IPython.display import display

        display(w.VBox([w.HBox([self.inputs["model"], self.inputs["dtype"], self.inputs["gpus"]]),
                        w.HBox([self.inputs["context"], self.inputs["batch"]]), self.output]))
        self._redraw_live()
        return self


def fit_form(model: str = "llama-2-13b", dtype: str = "fp16", context: int = 4096, batch: int = 1,
             gpus: str = "2 x RTX 3090") -> FitForm:
    """Show the "will it fit?" form (notebook 09): `fit_form()` in a cell."""
    return FitForm(model, dtype, context, batch, gpus).show()
