"""Measuring generation engines: medians of interleaved runs, tables and timelines of them, and the memory-bandwidth
bounds of decoding on real GPUs.

`measure` times several engines (`helpers.inference.generate`'s OneDevice and LayerSplit,
`helpers.inference.pipelined`'s Pipelined, tensor parallel) in interleaved rounds and keeps medians per phase;
`throughput_table` and `plot_generation_timelines` show them; `decode_bounds` is what memory bandwidth allows on GPUs.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from helpers.inference.generate import PHASES, Generation, Rates
from helpers.measure import interleaved_medians


@dataclass(frozen=True)
class Throughput(Rates):
    """Medians over repeats of one engine on one workload; `last`: the last run (tokens, timeline)."""

    engine: str
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    decode_tokens: int
    repeats: int
    last: Generation = field(repr=False)

    @classmethod
    def of(cls, engine: str, runs: Sequence[Generation]) -> "Throughput":
        if not runs:
            raise ValueError(f"no runs of {engine} to take medians of")
        return cls._medians(engine, runs, len(runs), runs[-1])

    @classmethod
    def pooled(cls, parts: Sequence["Throughput"]) -> "Throughput":
        """Several launches of one engine on one workload as one figure: the medians of their medians (one launch
        of tensor parallelism moves too far from the next: docs/bench.md, `pooled`), the repeats of all, the last
        launch's last run."""
        if not parts:
            raise ValueError("no launches to pool")
        return cls._medians(parts[-1].engine, parts, sum(t.repeats for t in parts), parts[-1].last)

    @classmethod
    def _medians(cls, engine: str, timed: Sequence, repeats: int, last: Generation) -> "Throughput":
        return cls(engine, statistics.median(t.prefill_s for t in timed), statistics.median(t.decode_s for t in timed),
                   last.prompt_tokens, last.decode_tokens, repeats, last)


def measure(runs: Mapping[str, Callable[[], Generation]], repeats: int = 3, warmup: int = 1,
            progress: bool = False) -> dict[str, Throughput]:
    """Time each run (a function returning a Generation) in interleaved rounds, a, b, c, a, b, c, ..., after
    `warmup` untimed calls of each, so a slow moment of a shared machine hurts every engine alike
    (`helpers.measure.interleaved_medians`); medians per phase of the Generations' own timings."""
    done: dict[str, list[Generation]] = {name: [] for name in runs}
    interleaved_medians({name: lambda name=name, fn=fn: done[name].append(fn()) for name, fn in runs.items()},
                        repeats, warmup, progress)
    return {name: Throughput.of(name, gens[warmup:]) for name, gens in done.items()}


def throughput_rows(results: Mapping[str, Throughput], baseline: str | None = None) -> list[dict]:
    """One row per engine: tokens/s of each phase, and each as a multiple of the baseline's (default: the first)."""
    if not results:
        return []
    base = results[baseline or next(iter(results))]
    return [{"engine": name, "prefill tok/s": t.prefill_tok_s, "decode tok/s": t.decode_tok_s,
             "prefill x": t.prefill_tok_s / base.prefill_tok_s, "decode x": t.decode_tok_s / base.decode_tok_s,
             "prefill ms": t.prefill_s * 1e3, "decode ms": t.decode_s * 1e3, "repeats": t.repeats}
            for name, t in results.items()]


def throughput_table(results: Mapping[str, Throughput], baseline: str | None = None) -> str:
    from helpers.report import table

    return table(throughput_rows(results, baseline))


def plot_generation_timelines(results: Mapping[str, Throughput | Generation],
                              device_names: dict[int, str] | None = None):
    """One timeline per engine, stacked on one time axis (`helpers.timeline.plot_timelines`): prefill and decode
    spans per device, the request's number on each bar, busy % per device."""
    from helpers.timeline import plot_timelines

    panels = {name: (r.last if isinstance(r, Throughput) else r).events for name, r in results.items()}
    return plot_timelines(panels, device_names=device_names, busy_kinds=set(PHASES))


# --- on two GPUs: the bandwidth bound of decoding ---------------------------------------------------------------------

def decode_bounds(model: str = "llama-3-8b", dtype: str = "fp16", context: int = 512, gpu: str = "RTX 3090",
                  link: str = "3090_gpu_to_gpu_no_p2p") -> dict:
    """Upper bounds on single-stream decode speed from memory bandwidth alone (tokens/s), for one GPU and for two
    joined by `link` (data/hardware.json): every weight and the KV cache of `context` tokens are read once per token.

    - one GPU and the layer split: the same bytes, read by one card at a time (the split adds one hop of the hidden
      state per token: the link's latency plus its bytes);
    - pipelined, two or more requests in flight: both cards read at once, so the aggregate doubles (each request
      still gets the one-card rate);
    - tensor parallel: each card reads half, plus two all-reduces per layer, each costed as twice the link's
      latency (the simulator's rule: an estimate; their bytes are negligible in decode).
    """
    from helpers.facts import load_data
    from helpers.sizing import gpus
    from helpers.sizing.shape import model_shape

    hardware = load_data("hardware")
    card, wire = gpus.gpu(gpu), hardware["links"][link]
    if card.bandwidth_gb_s is None:
        raise ValueError(f"no memory bandwidth known for {gpu!r}: name one of {', '.join(hardware['gpus'])}")
    shape = model_shape(model, dtype)
    read = sum(layer.read_bytes(context, 1) for layer in shape.layers)
    bandwidth = card.bandwidth_gb_s * 1e9
    latency = wire["latency_us"] * 1e-6
    hop = latency + shape.hidden * shape.format.activation_bytes / (wire["gb_s_per_direction"] * 1e9)
    allreduces = 2 * len(shape.decoder_layers)
    one = read / bandwidth
    split = one + hop
    tp = read / 2 / bandwidth + allreduces * 2 * latency
    return {"model": model, "dtype": dtype, "context": context, "gpu": gpu, "link": link,
            "read_bytes_per_token": read, "bandwidth_gb_s": card.bandwidth_gb_s,
            "link_latency_us": wire["latency_us"], "allreduces_per_token": allreduces,
            "ms": {"one GPU": one * 1e3, "layer split": split * 1e3, "pipelined (per request)": split * 1e3,
                   "tensor parallel": tp * 1e3},
            "tok_s": {"one GPU": 1 / one, "layer split": 1 / split, "pipelined (2 requests, total)": 2 / split,
                      "tensor parallel": 1 / tp},
            "sources": {"bandwidth": hardware["gpus"][card.name]["source"], "link": wire["source"]}}
