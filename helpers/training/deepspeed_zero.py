"""DeepSpeed's ZeRO stages as strategies of the catalog (`ds_zero1`, `ds_zero2`, `ds_zero3`; `offload="cpu"` moves
the optimizer step to DeepSpeed's CPU Adam on the host), run by the course's loop on the same model, data and
optimizer as PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2, so the two libraries are compared on one job.

The course writes the DeepSpeed config from the job (`ds_config`): the batch sizes multiply out by construction,
DDP's bucket size becomes ZeRO's reduce and all-gather buckets, and the optimizer is the job's own torch optimizer
(`zero_allow_untested_optimizer`), so DeepSpeed's run is checked against one device with the same Adam; with
offload it is DeepSpeed's CPU Adam (a C++ extension built on first use: a C++ compiler and ninja), the one optimizer
ZeRO-Offload steps. A config a user brings is checked against the job before any rank starts (`check_config`).

What differs from PyTorch's engines, measured in tests/test_deepspeed.py: ZeRO-1 and ZeRO-2 keep an fp32 copy of each
rank's partition for the optimizer even when the weights are fp32 (DeepSpeed's `single_partition_of_fp32_groups`),
ZeRO-3 partitions flat buffers, not per-parameter DTensors. Works on the CPU rig through DeepSpeed's CPU accelerator
(chosen by itself when no GPU is found) over the launcher's gloo group; on GPUs over NCCL.
"""
from __future__ import annotations

import importlib.util
import shutil

import torch
from torch import nn

from helpers.sizing.ledger import DeviceMemory, optimizer_state_bytes, param_bytes, tensor_bytes

INSTALL = "pip install -r requirements-deepspeed.txt"
ADAM = {"adam": False, "adamw": True}  # job optimizer -> DeepSpeed's adam_w_mode (its CPU Adam under offload)


def zero_stage(strategy: str) -> int:
    """The ZeRO stage of a DeepSpeed strategy, read from its catalog entry's config (helpers.catalog)."""
    import json

    from helpers.catalog import strategy as catalog_entry

    return json.loads("{%s}" % catalog_entry(strategy).deepspeed)["zero_optimization"]["stage"]


def missing() -> str | None:
    """Why DeepSpeed cannot run here (not installed), or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return f"DeepSpeed is not installed: {INSTALL} (the course runs without it)"
    return None


def cpu_adam_missing() -> str | None:
    """Why DeepSpeed's CPU Adam cannot be built here, or None: a C++ compiler and ninja build it on first use."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or shutil.which("ninja") is None:
        return ("offload='cpu' steps with DeepSpeed's CPU Adam, a C++ extension built on first use: it needs a C++ "
                "compiler (g++) and ninja, " + ("neither" if compiler is None and not shutil.which("ninja") else
                                                  "ninja" if compiler else "g++") + " found here")
    return None


def ds_config(job) -> dict:
    """The DeepSpeed config of a `TrainJob` on a ds_* strategy: its batch as micro-batch x accumulation x replicas,
    its ZeRO stage, its buckets (DDP's bucket_mb, in elements of the weights' dtype), precision, clipping and, with
    offload, the CPU Adam optimizer. `steps_per_print` off: the course prints its own. `gradient_clipping` always
    written: DeepSpeed's default clips the gradients' norm at 1.0 (GRADIENT_CLIPPING_DEFAULT in
    deepspeed/runtime/constants.py), which PyTorch's engines do only when asked (max_grad_norm)."""
    elements = int(job.bucket_mb * 2**20 // (2 if job.dtype in ("bf16", "fp16") else 4))
    zero = {"stage": zero_stage(job.data_parallel), "reduce_bucket_size": elements, "allgather_bucket_size": elements,
            "stage3_prefetch_bucket_size": elements, "stage3_param_persistence_threshold": 0}
    config = {"train_batch_size": job.batch, "gradient_accumulation_steps": job.microbatches,
              "train_micro_batch_size_per_gpu": job.batch // job.dp // job.microbatches,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1,
              "bf16": {"enabled": job.dtype == "bf16"}, "fp16": {"enabled": job.dtype == "fp16"},
              "gradient_clipping": job.max_grad_norm or 0.0}
    if job.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        config["optimizer"] = {"type": "AdamW" if ADAM[job.optimizer] else "Adam",
                               "params": {"lr": job.lr, "adam_w_mode": ADAM[job.optimizer],
                                          "weight_decay": 0.01 if ADAM[job.optimizer] else 0.0}}
    return config


def check_job(job, rig) -> None:
    """What a ds_* job cannot run, refused in the user's terms before any rank starts."""
    reason = missing()
    if reason:
        raise ValueError(f"{job.data_parallel} runs DeepSpeed. {reason}")
    if job.dtype == "fp16" and rig.is_cpu:
        raise ValueError("dtype='fp16': DeepSpeed's CPU accelerator has no fp16; use dtype='bf16' (or fp32)")
    if job.autocast is not None:
        raise ValueError(f"autocast={job.autocast!r}: DeepSpeed runs its own mixed precision; give dtype='bf16' "
                         "(its bf16 section: 16-bit weights, fp32 master weights and optimizer state)")
    if job.wire != "auto":
        raise ValueError(f"wire={job.wire!r} compresses DDP's buckets; DeepSpeed reduces in the weights' dtype")
    if job.shares:
        raise ValueError("shares=: DeepSpeed gives every rank the same micro-batch (train_micro_batch_size_per_gpu)")
    if job.offload == "cpu":
        if job.optimizer not in ADAM:
            raise ValueError(f"offload='cpu' steps with DeepSpeed's CPU Adam: optimizer='adam' or 'adamw', not "
                             f"{job.optimizer!r}")
        if zero_stage(job.data_parallel) < 2:
            raise ValueError("offload='cpu' (ZeRO-Offload) needs ZeRO stage 2 or 3: ds_zero2 or ds_zero3")
        reason = cpu_adam_missing()
        if reason:
            raise ValueError(reason)
    unwired = [name for name, on in (("optimizer_in_backward", job.optimizer_in_backward),
                                     ("loss_chunks", job.loss_chunks is not None),
                                     ("activation_offload", job.activation_offload),
                                     ("checkpoint", job.checkpoint is not None)) if on]
    if job.optimizer in ("adamw-8bit", "adamw-4bit"):
        unwired.append(f"optimizer={job.optimizer!r}")
    if unwired:
        raise ValueError(f"{', '.join(unwired)} with {job.data_parallel}: not wired to DeepSpeed here (it has its own "
                         "equivalents); use fsdp2 for these, or leave them out")


def check_config(config: dict, job) -> None:
    """A DeepSpeed config a user brings, refused where it does not match the job, naming the field."""
    micro, accum = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps", 1)
    total = config.get("train_batch_size")
    if micro is not None and total is not None and micro * accum * job.dp != total:
        raise ValueError(f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                         f"gradient_accumulation_steps {accum} x {job.dp} ranks")
    if total is not None and total != job.batch:
        raise ValueError(f"train_batch_size {total} is not the job's global batch {job.batch}")
    if config.get("fp16", {}).get("enabled") and not torch.cuda.is_available():
        raise ValueError("fp16.enabled: DeepSpeed's CPU accelerator has no fp16; use bf16.enabled (or fp32)")
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload == "cpu" and cpu_adam_missing():
        raise ValueError(f"zero_optimization.offload_optimizer.device = 'cpu': {cpu_adam_missing()}")


def initialize(module: nn.Module, job, optimizer: torch.optim.Optimizer | None):
    """`deepspeed.initialize` on this rank's module: the launcher's process group is DeepSpeed's (no second init).
    Without offload the job's torch optimizer (SGD at lr 0 for optimizer='none': ZeRO needs one to partition);
    with offload DeepSpeed's CPU Adam from the config."""
    import os

    if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, named rather than found (it warns when found)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    config = ds_config(job)
    params = [p for p in module.parameters() if p.requires_grad]
    if job.offload is None and optimizer is None:
        optimizer = torch.optim.SGD(params, lr=0.0)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=config,
                                      optimizer=None if job.offload else optimizer, dist_init_required=False)
    return engine


def full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """A parameter's whole gradient after backward and before the step, however ZeRO partitioned it (a collective
    under ZeRO-3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(param)


def gathered(module: nn.Module):
    """A context in which `module`'s ZeRO-3 partitions are whole on every rank (a collective: every rank enters it);
    for ZeRO-1 and ZeRO-2, whose weights are whole already, nothing is gathered."""
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters(list(module.parameters()))


def state_bytes(engine, job) -> tuple[DeviceMemory, int]:
    """What the rank holds at rest after a step, on the device and on the host: its weights (ZeRO-3: its partition
    of each), no gradients, and its optimizer state: the moments of its partition plus the fp32 copy of the
    partition the optimizer steps, on the host under offload (by the job, not by `.device`: on the CPU rig both
    memories are one)."""
    zero = engine.optimizer
    params = list(engine.module.parameters())
    if zero_stage(job.data_parallel) == 3:
        weights = sum(tensor_bytes(p.ds_tensor) for p in params)
        master = sum(tensor_bytes(t) for t in zero.fp32_partitioned_groups_flat)
    else:
        weights = param_bytes(params)
        master = sum(tensor_bytes(t) for t in zero.single_partition_of_fp32_groups)
    state = optimizer_state_bytes(zero.optimizer) + master
    return DeviceMemory(weights, 0, 0 if job.offload else state), state if job.offload else 0


# --- the host's optimizer step --------------------------------------------------------------------------------------

def host_adam_step_s(numel: int = 2**22, repeats: int = 7) -> dict[str, float]:
    """Median seconds of one AdamW step over `numel` fp32 parameters in host memory: DeepSpeed's C++ CPU Adam (what
    ZeRO-Offload steps) and torch.optim.AdamW (its default implementation), from the same weights and gradient,
    after one untimed step each (state allocated, the extension loaded), timed in alternation so a disturbed moment
    slows both; both on this process's threads. `max_weight_diff`: the largest difference of their weights after
    every step, which says they computed the same update."""
    import statistics
    import time

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    start, grad = torch.randn(numel, generator=torch.Generator().manual_seed(0)), torch.randn(numel)
    weights = {name: nn.Parameter(start.clone()) for name in ("deepspeed", "torch")}
    for w in weights.values():
        w.grad = grad.clone()
    optimizers = {"deepspeed": DeepSpeedCPUAdam([weights["deepspeed"]], lr=1e-3, weight_decay=0.01, adamw_mode=True),
                  "torch": torch.optim.AdamW([weights["torch"]], lr=1e-3, weight_decay=0.01)}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for step in range(repeats + 1):
        for name, optimizer in optimizers.items():
            t0 = time.perf_counter()
            optimizer.step()
            if step:
                times[name].append(time.perf_counter() - t0)
    diff = (weights["deepspeed"] - weights["torch"]).abs().max().item()
    return {**{name: statistics.median(t) for name, t in times.items()}, "max_weight_diff": diff}


# --- checkpoints ----------------------------------------------------------------------------------------------------

def checkpoint_layout(folder: str) -> tuple[int, int, str]:
    """(ZeRO stage, data-parallel ranks, tag) of the latest DeepSpeed checkpoint in `folder` (its `latest` file
    names the tag; the model-states file, ZeRO-3's per rank, records the config and the world), read on the host."""
    from pathlib import Path

    root = Path(folder)
    tag = (root / "latest").read_text().strip()
    states = sorted((root / tag).glob("*model_states.pt"))
    if not states:
        raise ValueError(f"{root / tag} holds no DeepSpeed model states (*model_states.pt)")
    saved = torch.load(states[0], map_location="cpu", weights_only=False)
    return saved["ds_config"]["zero_optimization"]["stage"], saved["dp_world_size"], tag


def check_checkpoint(folder: str, stage: int, world: int) -> None:
    """Refuse, before any rank starts, to resume a DeepSpeed checkpoint saved by another ZeRO stage or number of
    ranks: its optimizer partitions are cut for that layout, and DeepSpeed would fail deep inside loading."""
    saved_stage, saved_world, tag = checkpoint_layout(folder)
    if (saved_stage, saved_world) != (stage, world):
        raise ValueError(f"the DeepSpeed checkpoint {folder}/{tag} was saved by ZeRO-{saved_stage} on {saved_world} "
                         f"ranks; this run is ZeRO-{stage} on {world}. Resume with the same stage and number of "
                         "processes, or export it (python -m helpers.training.deepspeed_zero CHECKPOINT MODEL OUT) "
                         "and train on from the exported model")


def export_checkpoint(folder: str, model_dir: str, out: str) -> list[str]:
    """Consolidate the latest DeepSpeed checkpoint in `folder` (any stage: DeepSpeed's own zero_to_fp32 joins the
    partitions, on the host, no ranks) into the Hugging Face model saved in `model_dir`, and save it to `out` with
    its tokenizer if it has one. Returns the model's keys the checkpoint lacked (only the tied copies it shares)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = get_fp32_state_dict_from_zero_checkpoint(folder)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing_keys, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or set(missing_keys) - tied:
        raise ValueError(f"the checkpoint does not match {model_dir}: missing {sorted(set(missing_keys) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    model.save_pretrained(out)
    try:
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    except (OSError, ValueError):
        pass  # a model saved without a tokenizer
    return list(missing_keys)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4:
        raise SystemExit("usage: python -m helpers.training.deepspeed_zero CHECKPOINT_DIR MODEL_DIR OUT")
    export_checkpoint(*sys.argv[1:])
    print(f"exported {sys.argv[1]} (ZeRO-{checkpoint_layout(sys.argv[1])[0]}) to {sys.argv[3]}")
