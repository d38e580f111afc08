"""What fits on two 3090s: one table (data/atlas.csv) of the planners' verdicts over models from 1B to 70B, methods
(inference in bf16, int8, nf4 through `helpers.inference.plan`; full fine-tuning, LoRA and QLoRA through
`helpers.finetune.memory_plan`), contexts, batch sizes, technique stacks and three rigs, each row with the one command
that plans it. `python -m helpers.simulate.atlas` writes it; tests/test_atlas.py regenerates it and fails on any
difference.

Columns: model, method, context, batch, techniques (the training stack: optimizer, precision, offload and memory
techniques; inference: the weight format), gpus, gpu_peak_gib (the fullest card's peak, runtime reserve included;
for inference that does not fit, the closest split's), host_ram_gib (training: the host's peak, loading or offloaded
state, against HOST_RAM_GIB; inference: empty), fits, limit (GPU memory, host RAM or nothing), tokens_per_s
(predicted, for rows that fit; see `_training_tokens_per_s` and `_inference_rows`), command.

tokens_per_s: inference, the decode tokens/s `helpers.inference.speed` predicts for the engine the plan's device_map
runs (the layer split; one device on one card); training, the simulator's (`helpers.simulate`, FSDP2 with activation
checkpointing on each card's own workload) training tokens/s of the whole rig:
- full fine-tuning: `transformer_workload`, every weight's gradient, mixed-precision AdamW's step on the GPU;
- LoRA and QLoRA: `helpers.simulate.finetune.finetune_workload` on the planner's `training_shape` (rank 64 on every
  decoder linear, the frozen base as the planner stores it: bf16, or torchao's NF4 for QLoRA): the base's backward
  computes input gradients only, the adapters' small matmuls are traced with the rest, QLoRA dequantizes each weight
  at every use (forward, recomputed forward, backward); FSDP2 gathers the frozen weights in forward and again in
  backward and reduce-scatters the adapters' gradients only;
- cpu offload (FSDP2's CPUOffloadPolicy): each shard copied host to device before every gather (full: the fp32
  master), gradient shards back, AdamW stepped on the host at its memory bandwidth (data/hardware.json `host`, an
  assumption), after the backward;
- activation-offload: what each layer saves (its checkpointed input) copied to the host after its forward and back
  before its backward over PCIe, on the compute stream (not overlapped, as save_on_cpu issues it).
It leaves out the other techniques' own costs (the chunked loss' recomputed head, the low-bit optimizer's step,
stepping in backward). Checked against Answer.AI's published LoRA and QLoRA run times: tests/test_published_speed.py.
"""
from __future__ import annotations

import csv
import functools
import io
import shlex
import sys
from pathlib import Path

MODELS = ("llama-3.2-1b", "llama-3.2-3b", "mistral-7b", "llama-3-8b", "qwen2.5-14b", "qwen2.5-32b", "llama-3-70b")
RIGS = {  # the GPUs as the planners take them -> the speed model's rig and engine for a device_map's layer split
    "2 x RTX 3090": ("2x3090 PCIe", "layer split"),
    "1 x RTX 3090": ("2x3090 PCIe", "one device"),
    "RTX 3090, RTX 4090": ("3090 + 4090", "layer split"),
}
GPU_LABELS = {"2 x RTX 3090": "2 x RTX 3090", "1 x RTX 3090": "1 x RTX 3090", "RTX 3090, RTX 4090": "RTX 3090 + RTX 4090"}
INFERENCE_DTYPES = ("bf16", "int8", "nf4")
WORKLOADS = {"inference": ((2048, 1), (2048, 8), (8192, 1), (8192, 8), (32768, 1)),
             "training": ((2048, 1), (2048, 4), (8192, 1), (32768, 1))}
HOST_RAM_GIB = 32  # the host RAM training rows are checked against (a common 3090 workstation)
# the training stacks: name -> plan_training options (all with activation checkpointing, FSDP2 on every rig)
FULL_STACK = {"optimizer": "adamw-4bit", "precision": "pure", "techniques": ("optimizer-in-backward", "chunked-loss")}
STACKS = {
    "full": {"adamw, fp32 master": {"optimizer": "adamw", "precision": "mixed"},
             "adamw-8bit, fp32 master, optimizer-in-backward, chunked-loss": {
                 "optimizer": "adamw-8bit", "precision": "mixed",
                                         "techniques": ("optimizer-in-backward", "chunked-loss")},
             "adamw-4bit, pure bf16, optimizer-in-backward, chunked-loss": FULL_STACK,
             "adamw-4bit, pure bf16, optimizer-in-backward, chunked-loss, activation-offload":
                 {**FULL_STACK, "techniques": ("optimizer-in-backward", "chunked-loss", "activation-offload")},
             "adamw, fp32 master, cpu offload": {"optimizer": "adamw", "precision": "mixed", "offload": "cpu"}},
    "lora": {"adamw": {"optimizer": "adamw"},
             "adamw, cpu offload": {"optimizer": "adamw", "offload": "cpu"},
             "adamw, chunked-loss, activation-offload": {"optimizer": "adamw",
                                                         "techniques": ("chunked-loss", "activation-offload")}},
    "qlora": {"adamw": {"optimizer": "adamw"},
              "adamw, cpu offload": {"optimizer": "adamw", "offload": "cpu"},
              "adamw, chunked-loss, activation-offload": {"optimizer": "adamw",
                                                          "techniques": ("chunked-loss", "activation-offload")}},
}
COLUMNS = ("model", "method", "context", "batch", "techniques", "gpus", "gpu_peak_gib", "host_ram_gib", "fits",
           "limit", "tokens_per_s", "command")
PATH = Path(__file__).resolve().parents[2] / "data" / "atlas.csv"
GiB = 2**30


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _max_context(model: str) -> int:
    from helpers.sizing.shape import model_shape

    return getattr(model_shape(model, "bf16").config, "max_position_embeddings", None) or 1 << 30


def _inference_rows(model: str, gpus: str) -> list[dict]:
    from helpers.inference.plan import DoesNotFit, plan
    from helpers.inference.speed import predict_speed

    rig, engine = RIGS[gpus]
    rows = []
    for dtype in INFERENCE_DTYPES:
        for context, batch in WORKLOADS["inference"]:
            if context > _max_context(model):
                continue
            try:
                placement = plan(model, dtype, context=context, batch=batch, gpus=gpus)
            except DoesNotFit as e:
                placement = e.closest
            fits = placement.fits
            peak = max(d.gpu.capacity_bytes - d.free_bytes for d in placement.devices)
            speed = predict_speed(model, dtype, rig, batch, context).tok_s(engine, "decode") if fits else None
            command = (f"python -m helpers.plan --model {model} --dtype {dtype} --context {context} --batch {batch} "
                       f"--gpus {shlex.quote(gpus)}")
            rows.append({"model": model, "method": "inference", "context": context, "batch": batch,
                         "techniques": dtype, "gpus": GPU_LABELS[gpus], "gpu_peak_gib": _gib(peak), "host_ram_gib": "",
                         "fits": "yes" if fits else "no", "limit": "nothing" if fits else "GPU memory",
                         "tokens_per_s": "" if speed is None else f"{speed:.1f}", "command": command})
    return rows


@functools.lru_cache(maxsize=None)
def _workload(model: str, method: str, context: int, batch: int, gpu_name: str, cpu_offload: bool):
    """One card's workload: full fine-tuning's (`transformer_workload`; offloaded, its fp32 master and AdamW state on
    the host), LoRA's or QLoRA's on the planner's defaults (`finetune_workload`)."""
    from dataclasses import replace

    from helpers.dtypes import BYTES
    from helpers.hardware import target_rig
    from helpers.simulate.finetune import HOST_ADAMW_ACCESSES, finetune_workload
    from helpers.simulate.guide import transformer_workload
    from helpers.sizing.shape import model_shape
    from helpers.sizing.training import training_shape

    card = next(c for c in target_rig("3090 + 4090 PCIe").cards if c.name == gpu_name)
    if method != "full":
        return finetune_workload(training_shape(model, method), context, card, batch=batch)
    workload = transformer_workload(model_shape(model, "bf16"), context, card, batch=batch)
    if not cpu_offload:
        return workload
    master = BYTES["fp32"]
    return replace(workload, optimizer_bytes=HOST_ADAMW_ACCESSES * master * workload.n_params,
                   host_bytes_per_param=master)


def _training_tokens_per_s(model: str, method: str, options: dict, context: int, batch: int, gpus: str) -> float:
    """The simulator's training tokens/s of the whole rig: FSDP2, `batch` sequences per card, checkpointing on,
    each card at its own speed (equal batches, as the memory plan deals them: the slower card sets the step), the
    stack's offloading over the rig's host (`rig_host`)."""
    from helpers.hardware import target_rig
    from helpers.simulate.finetune import rig_host
    from helpers.simulate.guide import relative_speeds
    from helpers.simulate.job import Job
    from helpers.simulate.strategies import simulate

    cpu_offload = options.get("offload") == "cpu"
    names = [g.strip() for g in gpus.split(",")] if "," in gpus else ["RTX 3090"] * int(gpus.split(" x ")[0])
    workloads = [_workload(model, method, context, batch, name, cpu_offload) for name in names]
    speeds = relative_speeds(workloads) if len(set(names)) > 1 else None
    rig = target_rig("3090 + 4090 PCIe" if speeds else "2x3090 PCIe")
    job = Job("fsdp2", batch * len(names), microbatches=1, activation_checkpointing=True, dp=len(names), pp=1,
              speeds=speeds, cpu_offload=cpu_offload,
              activation_offload="activation-offload" in options.get("techniques", ()))
    return simulate(workloads[0], job, rig.link, rig.collectives, host=rig_host()).samples_per_s * context


def _flags(options: dict) -> str:
    out = [f"--optimizer {options['optimizer']}"]
    if "precision" in options:
        out.append(f"--precision {options['precision']}")
    if options.get("offload"):
        out.append(f"--offload {options['offload']}")
    if options.get("techniques"):
        out.append(f"--technique {','.join(options['techniques'])}")
    return " ".join(out)


def _training_rows(model: str, gpus: str) -> list[dict]:
    from helpers.finetune.memory_plan import plan_training

    rows = []
    for method, stacks in STACKS.items():
        for name, options in stacks.items():
            for context, batch in WORKLOADS["training"]:
                if context > _max_context(model):
                    continue
                plan = plan_training(model, method, context=context, batch=batch, gpus=gpus, strategy="fsdp2",
                                     host_ram_bytes=HOST_RAM_GIB * GiB, suggest=False, **options)
                gpu_ok = all(d.free_bytes >= 0 for d in plan.devices)
                limit = "nothing" if plan.fits else "GPU memory" if not gpu_ok else "host RAM"
                speed = _training_tokens_per_s(model, method, options, context, batch, gpus) if plan.fits else None
                command = (f"python -m helpers.plan --train --model {model} --method {method} --context {context} "
                           f"--batch {batch} --gpus {shlex.quote(gpus)} --strategy fsdp2 {_flags(options)} "
                           f"--host-ram {HOST_RAM_GIB}GiB")
                rows.append({"model": model, "method": method, "context": context, "batch": batch,
                             "techniques": name, "gpus": GPU_LABELS[gpus],
                             "gpu_peak_gib": _gib(max(d.peak_bytes for d in plan.devices)),
                             "host_ram_gib": _gib(plan.host_peak_bytes), "fits": "yes" if plan.fits else "no",
                             "limit": limit, "tokens_per_s": "" if speed is None else f"{speed:.1f}",
                             "command": command})
    return rows


def atlas_rows() -> list[dict]:
    """Every row of the atlas, in a fixed order: model, then rig, inference before training."""
    rows = []
    for model in MODELS:
        for gpus in RIGS:
            rows += _inference_rows(model, gpus) + _training_rows(model, gpus)
    return rows


def atlas_csv(rows: list[dict] | None = None) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(atlas_rows() if rows is None else rows)
    return out.getvalue()


def headline(rows: list[dict], gpus: str = "2 x RTX 3090") -> dict[str, dict]:
    """The biggest model (in MODELS' order) each method fits on `gpus`, with its row (any context and stack);
    inference per weight format ('inference bf16', ...)."""
    best = {}
    for row in rows:
        if row["gpus"] == gpus and row["fits"] == "yes":
            method = f"inference {row['techniques']}" if row["method"] == "inference" else row["method"]
            if method not in best or MODELS.index(row["model"]) > MODELS.index(best[method]["model"]):
                best[method] = row
    return best


def main(argv: list[str] | None = None) -> None:
    import time

    start = time.perf_counter()
    rows = atlas_rows()
    PATH.write_text(atlas_csv(rows))
    print(f"{len(rows)} rows -> {PATH} in {time.perf_counter() - start:.1f} s")
    for method, row in headline(rows).items():
        print(f"  {method}: {row['model']} ({row['techniques']}, context {row['context']}, batch {row['batch']}, "
              f"peak {row['gpu_peak_gib']} GiB)")


if __name__ == "__main__":
    main(sys.argv[1:])
