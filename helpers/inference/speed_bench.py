"""Predicted beside measured: the speed model of `helpers.inference.speed` calibrated on the rig you have
(`helpers.inference.speed_calibration`: micro-benchmarks, never the engines themselves), and the engines timed on
the same model, batches and contexts (`measure_engines`); `compare` and `compare_by_case` put each measured row
beside its prediction; `replay` prices a saved run's rows again from the calibration saved beside them.

The command line, for a quiet machine: `python -m helpers.inference.speed_bench` (see --help). Wall-clock figures
mean something only on a machine nothing else is using; tests never assert on them.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, fields as fields_of
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from helpers.hardware import Link
from helpers.inference.speed import PHASES, SPLITS, Phase, layer_split, op_counts, pipelined, tensor_parallel
from helpers.inference.speed_calibration import (DeviceCalibration, calibrate_cpu_rig, model_shape_of,
                                                 tensor_parallel_sample)
from helpers.inference.speed_rigs import Device, SpeedRig
from helpers.models.hf import HFModel
from helpers.sizing.shape import ModelShape, model_shape

REQUESTS = 2  # in flight for the pipelined engine


# --- the engines, measured ----------------------------------------------------------------------------------------

def measure_engines(model: HFModel, rig, batches: Sequence[int], prompts: Sequence[int], new_tokens: int,
                    repeats: int = 3, before_each: Callable[[], None] | None = None,
                    launches: int = 1) -> list[dict]:
    """Prefill and decode tokens per second of the layer split (one request of `batch` prompts), the pipelined split
    (2 such requests in flight) and tensor parallelism (one request), for every batch and prompt length (prompts of
    equal length: no padding). The split cuts the decoder layers in half, as the prediction does. `before_each`:
    called before each batch and prompt length is measured (the speed bench samples its calibration there).
    `launches`: of tensor parallelism's ranks per case, pooled (`Throughput.pooled`), the first before the two
    in-process engines are timed and the others after, so that all of them straddle the same minutes."""
    from helpers.inference.generate import LayerSplit, make_requests, stages_from_cuts
    from helpers.inference.pipelined import Pipelined
    from helpers.inference.throughput import Throughput, measure
    from helpers.inference.tensor_parallel import run_tensor_parallel

    if launches < 1:
        raise ValueError(f"launches must be at least 1, got {launches}")

    split = LayerSplit(model, stages_from_cuts(model, [1 + model.config.num_hidden_layers // 2]), rig.devices)
    pipe = Pipelined.from_split(split)
    rows = []
    for batch in batches:
        for prompt in prompts:
            if before_each is not None:
                before_each()
            requests = make_requests(REQUESTS, model.config.vocab_size, batch, (prompt, prompt))

            def tensor_parallel() -> Throughput:
                return run_tensor_parallel(model, requests[:1], new_tokens, rig, repeats=repeats).throughput

            first = tensor_parallel()
            results = measure({"layer split": lambda: split.generate(requests[:1], new_tokens),
                               "pipelined": lambda: pipe.generate(requests, new_tokens)}, repeats=repeats)
            results["tensor parallel"] = Throughput.pooled([first] + [tensor_parallel() for _ in range(launches - 1)])
            rows += [{"engine": engine, "phase": phase, "batch": batch, "prompt": prompt, "new_tokens": new_tokens,
                      "tok/s": getattr(t, f"{phase}_tok_s"), "measured": True}
                     for engine, t in results.items() for phase in PHASES]
    return rows


def _phase(phase: str, batch: int, prompt: int, new_tokens: int) -> Phase:
    """Prefill of the prompt; decode at the mean context of its steps (a step's time grows linearly with the
    context, so the mean step is the step at the mean context)."""
    if phase == "prefill":
        return Phase("prefill", batch, prompt, prompt)
    return Phase("decode", batch, 1, prompt + max(new_tokens - 1, 1) // 2 + 1)


def predicted(shape: ModelShape, rig: SpeedRig, engine: str, phase: str, batch: int, prompt: int | Sequence[int],
              new_tokens: int) -> float:
    """tokens/s of `engine` in `phase` as the engines count them, for requests of `batch` prompts each of the given
    length(s): one request after another (layer split, tensor parallel: their times add), or all in flight at once
    (pipelined, at the mean length)."""
    ops = op_counts(shape.config.model_type)
    prompts = [prompt] if isinstance(prompt, int) else list(prompt)
    if engine == "pipelined":
        p = _phase(phase, batch, round(statistics.mean(prompts)), new_tokens)
        steps = new_tokens - 1 if phase == "decode" else 0  # the engine times the whole phase, its fill too
        return pipelined(shape, p, rig, ops, len(prompts) if len(prompts) > 1 else REQUESTS, steps).tok_s
    run = {"layer split": layer_split, "tensor parallel": tensor_parallel}[engine]
    speeds = [run(shape, _phase(phase, batch, n, new_tokens), rig, ops) for n in prompts]
    tokens = [batch * n if phase == "prefill" else batch for n in prompts]
    steps = [1 if phase == "prefill" else new_tokens - 1 for _ in prompts]
    return sum(t * k for t, k in zip(tokens, steps)) / sum(s.seconds * k for s, k in zip(speeds, steps))


def compare(measured: Sequence[dict], rig: SpeedRig, shape: ModelShape) -> list[dict]:
    """Each measured row with its prediction and the error (predicted / measured - 1)."""
    out = []
    for row in measured:
        pred = predicted(shape, rig, row["engine"], row["phase"], row["batch"], row["prompt"], row["new_tokens"])
        out.append({**{k: v for k, v in row.items() if k != "measured"}, "predicted tok/s": pred,
                    "error": pred / row["tok/s"] - 1})
    return out


def compare_by_case(measured: Sequence[dict], rigs: Mapping[tuple[int, int], SpeedRig],
                    shape: ModelShape) -> list[dict]:
    """`compare`, each row priced by the rig of its case, (batch, prompt): on the command line, the calibration
    rounds taken just before and just after that case was measured. What the bench prints beside the whole run's
    pricing, to show whether the machine's speed moved during the run (a slow minute puts one case's rows over
    their prediction on every engine at once); on a steady machine the whole run prices better, two rounds being
    noisier than seven (docs/bench.md, `compare_by_case`)."""
    return [row for case, rig in rigs.items()
            for row in compare([m for m in measured if (m["batch"], m["prompt"]) == case], rig, shape)]


def rig_from_dict(fields: dict) -> SpeedRig:
    """The SpeedRig a run saved as `dataclasses.asdict` wrote it (JSON's lists back to tuples; fields it did not
    know take their defaults, fields this version no longer has are left out)."""
    def points(d: dict, names: Sequence[str]) -> dict:
        return {k: tuple(tuple(p) for p in d[k]) for k in names if k in d}

    def known(cls, d: dict) -> dict:
        names = {f.name for f in fields_of(cls)}
        return {k: v for k, v in d.items() if k in names}

    def device(d: dict) -> Device:
        return Device(**{**known(Device, d), **points(d, ("flops", "busy_flops", "activation_s",
                                                          "prefill_activation_s"))})

    if isinstance(fields.get("sharded_linear_s"), (int, float)):  # written before it was measured by rows
        fields = {**fields, "sharded_linear_s": ((1, fields["sharded_linear_s"]),)}
    return SpeedRig(**{**known(SpeedRig, fields), **points(fields, ("allreduce_waits", "sharded_linear_s")),
                       "devices": tuple(device(d) for d in fields["devices"]), "hop": Link(**fields["hop"]),
                       "allreduce": Link(**fields["allreduce"])})


class Replayed(NamedTuple):
    """A saved run's rows priced again: by the whole run's rounds, and each case by its own (empty where the run was
    written before cases kept their rounds)."""

    rows: list[dict]
    by_case: list[dict]


def replay(path: str) -> Replayed:
    """A `--json` run's measured rows predicted again from its saved calibration and model config, by the speed model
    as it is now: no measurement, seconds."""
    import tempfile
    from pathlib import Path

    saved = json.loads(Path(path).read_text())
    if "speed_rig" not in saved or "config" not in saved:
        raise ValueError(f"{path} holds no calibration: write one with python -m helpers.inference.speed_bench --json")
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(saved["config"]))
        shape = model_shape(folder, "fp32")
    measured = [{k: v for k, v in r.items() if k not in ("predicted tok/s", "error")} for r in saved["rows"]]
    cases = {(c["batch"], c["prompt"]): rig_from_dict(c["speed_rig"]) for c in saved.get("case_rigs", ())}
    return Replayed(compare(measured, rig_from_dict(saved["speed_rig"]), shape),
                    compare_by_case(measured, cases, shape) if cases else [])


def error_summary(rows: Sequence[dict]) -> list[dict]:
    """Per engine and phase: the largest and the median absolute error."""
    out = []
    for engine in SPLITS:
        for phase in PHASES:
            errs = [abs(r["error"]) for r in rows if r["engine"] == engine and r["phase"] == phase]
            if errs:
                out.append({"engine": engine, "phase": phase, "median |error|": statistics.median(errs),
                            "max |error|": max(errs), "rows": len(errs)})
    return out


def within_summary(rows: Sequence[dict], by_case: Sequence[dict] = (), band: float = 0.15) -> str:
    """One line: how many rows their prediction comes within `band` of, and the mean absolute error; the same of the
    rows priced case by case (`compare_by_case`) where given."""
    def fit(priced: Sequence[dict]) -> str:
        errors = [abs(r["error"]) for r in priced]
        return (f"{sum(e <= band for e in errors)} of {len(errors)} within {band:.0%}, "
                f"mean |error| {statistics.mean(errors):.1%}")

    line = f"priced by the whole run's rounds: {fit(rows)}"
    return line + (f"; each case by the rounds just before and after it: {fit(by_case)} (for a machine whose speed "
                   "moves during a run)" if by_case else "")


def save_model(directory: str, hidden: int, layers: int, vocab: int, dtype: torch.dtype = torch.float32) -> HFModel:
    """A Llama-family model with random weights, saved with save_pretrained (the notebook's shape by default)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=11 * hidden // 4,
                         num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64),
                         num_key_value_heads=max(2, hidden // 256), max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(directory)
    return HFModel(directory)


def _measure_and_price(ns: argparse.Namespace) -> Replayed:
    """The command line's run: the engines measured between rounds of the calibration, priced by the whole run's
    rounds and each case by its own; written to `ns.json` where given."""
    from helpers.runtime.rig import claim_cpu_device, detect_rig
    from helpers.runtime.scratch import scratch_dir

    rig = detect_rig(force_cpu=True)
    claim_cpu_device(rig)
    batches = [int(b) for b in ns.batches.split(",")]
    prompts = [int(p) for p in ns.prompts.split(",")]
    cases = [(b, p) for b in batches for p in prompts]  # measured in this order, round i before case i
    model = save_model(str(scratch_dir("speed-bench-")), ns.hidden, ns.layers, ns.vocab)
    rows_used = sorted({b * p for b in batches for p in prompts} | set(batches))
    shape = model_shape_of(model)
    calibration = DeviceCalibration(shape, model.weights_dtype, rows_used, cases)  # a round before each case
    launches: list[dict] = []

    def calibration_round() -> None:
        calibration.sample()
        launches.append(tensor_parallel_sample(model, rig, rows_used, ns.repeats))

    measured = measure_engines(model, rig, batches, prompts, ns.new_tokens, ns.repeats, calibration_round,
                               ns.launches)
    calibration_round()  # the round after the last case

    def priced_by(rounds: Sequence[int]) -> SpeedRig:
        return calibrate_cpu_rig(model, rig, rows_used, device=calibration.device(rounds),
                                 tensor_parallel=[launches[i] for i in rounds])

    case_rigs = {case: priced_by([i, i + 1]) for i, case in enumerate(cases)}
    whole = priced_by(range(len(launches)))
    print(whole.note)
    rows = compare(measured, whole, shape)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"rig": whole.note, "speed_rig": asdict(whole), "config": shape.config.to_dict(),
                       "case_rigs": [{"batch": b, "prompt": p, "speed_rig": asdict(r)}
                                     for (b, p), r in case_rigs.items()],
                       "rows": rows, "summary": error_summary(rows)}, f, indent=2)
    return Replayed(rows, compare_by_case(measured, case_rigs, shape))


def main(argv: list[str] | None = None) -> None:
    from helpers.report import table

    parser = argparse.ArgumentParser(prog="python -m helpers.inference.speed_bench",
                                     description="The speed model calibrated on this (CPU) rig beside both engines "
                                                 "measured: prefill and decode tokens/s, predicted and measured.")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--prompts", default="16,64", help="prompt lengths (tokens)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launches", type=int, default=2, help="of tensor parallelism's ranks per case, pooled")
    parser.add_argument("--json", help="also write the rows, the calibration and the model's config here")
    parser.add_argument("--replay", metavar="JSON", help="measure nothing: predict the rows of an earlier --json "
                                                          "run again from its calibration")
    ns = parser.parse_args(argv)
    if ns.launches < 1:
        parser.error(f"--launches must be at least 1, got {ns.launches}")
    rows, by_case = replay(ns.replay) if ns.replay else _measure_and_price(ns)
    print(table(rows))
    print(table(error_summary(rows)))
    print(within_summary(rows, by_case))


if __name__ == "__main__":
    main()
