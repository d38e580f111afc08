"""What every training script shares: the same flags, the process group, the data, the loss, saving.

Each script is plain PyTorch + transformers you can take home; launch it with torchrun, on two GPUs or on a CPU:
    torchrun --nproc-per-node 2 scripts/train_ddp.py --model DIR --steps 100 --autocast bf16 --save-to OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.dtypes import DTYPES
from helpers.pipeline.schedules import SCHEDULES
from helpers.runtime.strict import strict_requested  # LAB_DEVICE_STRICT, parsed as the library parses it

IGNORE_INDEX = -100


def parse(description: str, pipeline: bool = False, mesh: bool = False, lora: bool = False,
          memory: bool = False, deepspeed: bool = False) -> argparse.Namespace:
    """The flags every script takes (the same everywhere, so switching strategy is switching the script); pipeline
    scripts add --schedule, DP x PP adds --pp (stages per pipeline), LoRA adds the adapters' flags, `memory` the
    planner's --optimizer and --technique (`memory_flags`), `deepspeed` --stage, --offload and --ds-config
    (`deepspeed_flags`). Bad flags stop here, before the process group."""
    p = argparse.ArgumentParser(description=description)
    if pipeline:
        p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b",
                       help="interleaved, zbv and dualpipev hold two stages per GPU")
    if mesh:
        p.add_argument("--pp", type=int, default=2, help="pipeline stages; the other ranks are replicas")
    p.add_argument("--model", required=True, help="a directory written by save_pretrained")
    if lora:
        p.add_argument("--method", choices=("lora", "qlora"), default="lora",
                       help="qlora: the frozen base's block linears in 4-bit NF4 (torchao)")
        p.add_argument("--lora-rank", type=int, default=8)
        p.add_argument("--lora-alpha", type=float, default=16.0)
        p.add_argument("--lora-targets", default="all-linear",
                       help="comma-separated names of the blocks' linears (q_proj,v_proj), or all-linear")
        p.add_argument("--activation-checkpointing", "--checkpointing", action="store_true",
                       help="recompute each block's activations in backward (--checkpointing: its old name)")
        p.add_argument("--offload", choices=("cpu",), help="FSDP2's CPUOffloadPolicy: shards and Adam in host memory")
    p.add_argument("--data", help="a torch.save'd LongTensor [N, L+1] of token ids (default: synthetic tokens that "
                                  "follow a fixed rule, so the loss can fall)")
    p.add_argument("--text", help="a text file or a folder of them (.py .txt .md .rst), tokenized with the tokenizer "
                                  "saved beside the model, or a byte-level BPE trained on it (saved with --save-to)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per optimizer step)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=4 if pipeline else 1,
                   help="pipeline micro-batches / gradient accumulation steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--autocast", choices=("none", "bf16", "fp16"), default="bf16")
    p.add_argument("--dtype", choices=tuple(WEIGHT_DTYPES), default="fp32",
                   help="master weights and optimizer state, whatever dtype the checkpoint was saved in (a bf16 "
                        "checkpoint loads as bf16 by default): fp32, computing in --autocast; or bf16 throughout")
    p.add_argument("--save-to", help="save the trained model here with save_pretrained")
    p.add_argument("--checkpoint-dir", help="save the training state here with torch.distributed.checkpoint every "
                                            "--checkpoint-every steps, and resume from its latest complete checkpoint "
                                            "(after a crash, or under torchrun --max-restarts)")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints kept (older ones are deleted)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background (dcp.async_save)")
    p.add_argument("--seed", type=int, default=0)
    if memory:
        memory_flags(p)
    if deepspeed:
        deepspeed_flags(p)
    ns = p.parse_args()
    if ns.batch % ns.microbatches:
        p.error(f"--batch {ns.batch} is not divisible by --microbatches {ns.microbatches}")
    if ns.dtype != "fp32" and ns.autocast == "fp16":
        p.error("--autocast fp16 needs fp32 master weights (--dtype fp32): the gradient scaler unscales fp32 "
                "gradients, and fp16 has too little range to hold them")
    if ns.data and ns.text:
        p.error("give --data or --text, not both")
    context = _context(ns.model)
    if context is not None and ns.seq_len > context:
        p.error(f"--seq-len {ns.seq_len} is beyond the model's context of {context} positions")
    if lora and ns.lora_rank <= 0:
        p.error(f"--lora-rank must be >= 1, got {ns.lora_rank}")
    if memory:
        check_memory_flags(p, ns)
    if deepspeed:
        check_deepspeed_flags(p, ns)
    return ns


def deepspeed_flags(p: argparse.ArgumentParser) -> None:
    """DeepSpeed's ZeRO stage, its optimizer offload, and a config of the user's own (checked against the flags);
    DeepSpeed runs its own mixed precision, so --autocast is none and --dtype bf16 turns on its bf16 section."""
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage")
    p.add_argument("--offload", choices=("cpu",), help="ZeRO-Offload: Adam's state and step on the host (CPU Adam)")
    p.add_argument("--ds-config", help="a DeepSpeed config JSON of your own (default: written from these flags)")
    p.set_defaults(autocast="none")


def check_deepspeed_flags(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """What DeepSpeed cannot run with these flags, refused before the process group, naming the flag or field."""
    from helpers.training.deepspeed_zero import check_checkpoint, missing

    if missing():
        p.error(missing())
    if ns.autocast != "none":
        p.error("--autocast: DeepSpeed runs its own mixed precision; use --dtype bf16 (its bf16 section)")
    if ns.offload and ns.stage < 2:
        p.error("--offload cpu (ZeRO-Offload) needs --stage 2 or 3")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ns.checkpoint_dir and os.path.isfile(os.path.join(ns.checkpoint_dir, "latest")):
        try:
            check_checkpoint(ns.checkpoint_dir, ns.stage, world)
        except ValueError as e:
            p.error(str(e))


# the training planner's names (python -m helpers.plan --train --optimizer ... --technique ...)
OPTIMIZERS = ("adamw", "adamw-8bit", "adamw-4bit")  # the last two: torchao's low-bit AdamW, as TrainJob names them
TECHNIQUES = ("optimizer-in-backward", "chunked-loss", "activation-offload")


def memory_flags(p: argparse.ArgumentParser) -> None:
    """The planner's memory flags: --optimizer (torchao's 8- or 4-bit AdamW; on --dtype bf16 weights each update
    rounded stochastically into bf16) and --technique (comma-separated or repeated), plus --memory-report."""
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw-8bit / adamw-4bit: torchao's AdamW with its two moments in 8 or 4 bits per number")
    p.add_argument("--technique", action="append", default=[],
                   help=f"memory techniques, comma-separated or repeated: {', '.join(TECHNIQUES)}")
    p.add_argument("--memory-report", action="store_true",
                   help="each rank prints its measured bytes after the last step (helpers.sizing.ledger): "
                        "parameters, peak gradients, optimizer state, peak saved activations")


def check_memory_flags(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """--technique as a list; the combinations the course's train() refuses, refused here with its reasons."""
    ns.technique = [t.strip() for flag in ns.technique for t in flag.split(",") if t.strip()]
    unknown = sorted(set(ns.technique) - set(TECHNIQUES))
    if unknown:
        p.error(f"unknown --technique {', '.join(unknown)}: choose from {', '.join(TECHNIQUES)}")
    if "optimizer-in-backward" in ns.technique:
        if ns.microbatches > 1:
            p.error("--technique optimizer-in-backward with --microbatches > 1: accumulation needs the gradients "
                    "kept until the last micro-batch, and the step in backward frees each one as it steps")
        if ns.autocast == "fp16":
            p.error("--technique optimizer-in-backward with --autocast fp16: loss scaling checks every gradient for "
                    "inf before any step, and here each parameter steps the moment its gradient is whole")
        if ns.checkpoint_dir:
            p.error("--technique optimizer-in-backward with --checkpoint-dir: one optimizer per parameter, which "
                    "the checkpointer does not save; drop one of them")


WEIGHT_DTYPES = {name: DTYPES[name] for name in ("fp32", "bf16")}


def weights_dtype(ns: argparse.Namespace) -> torch.dtype:
    """The dtype the model is loaded in: --dtype, never silently the checkpoint's."""
    return WEIGHT_DTYPES[ns.dtype]


def gpu_shortage(processes: int, gpus: int, visible: str | None) -> str | None:
    """Why `processes` ranks cannot run on this machine's `gpus` GPUs, or None. NCCL needs a GPU per rank: without
    this check rank 1 of two on a one-GPU machine dies in torch.cuda.set_device with "invalid device ordinal"."""
    if processes <= gpus:
        return None
    return (f"{processes} processes on this machine, but {gpus} GPU(s) visible (CUDA_VISIBLE_DEVICES="
            f"{visible or 'unset'}): NCCL needs one GPU per process. Start --nproc-per-node {gpus} if the strategy "
            "allows it, or try the structure on the CPU: LAB_FORCE_CPU=1 OMP_NUM_THREADS=1 torchrun ...")


def _context(model_dir: str) -> int | None:
    """The model's longest sequence (max_position_embeddings, GPT-2's n_positions), from its config.json."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return config.get("max_position_embeddings") or config.get("n_positions")


def init() -> tuple[int, int, torch.device]:
    """Join the process group as PyTorch's own engines do: on GPUs bind the rank's GPU first and give NCCL
    `device_id`, so its communicator is created now, on every rank together (LAB_FORCE_CPU=1: the CPU rig). Too few
    GPUs for the ranks: every rank stops at once with the reason, before NCCL starts. Under torchrun the group is
    joined on a store of this start of the workers alone (helpers.runtime.launch.join_group): workers restarted by
    --max-restarts would otherwise read their killed peers' addresses from torchrun's shared store."""
    from helpers.runtime.launch import join_group

    if torch.cuda.is_available() and os.environ.get("LAB_FORCE_CPU") != "1":
        local = int(os.environ["LOCAL_RANK"])
        shortage = gpu_shortage(int(os.environ["LOCAL_WORLD_SIZE"]), torch.cuda.device_count(),
                                os.environ.get("CUDA_VISIBLE_DEVICES"))
        if shortage:  # every rank says it: torchrun stops the others as soon as the first one exits
            print(f"error (local rank {local}): {shortage}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        join_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        backend = "gloo"
        if strict_requested():  # the course's CI: fail here where NCCL would fail on GPUs
            from helpers.runtime.strict import enter_device_strict_mode, strict_backend

            enter_device_strict_mode()
            backend = strict_backend(device, backend)
        join_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


DECODER_LAYERS = ("model.layers", "transformer.h")  # where Llama-style models and GPT-2 keep their decoder layers


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder layers of a Hugging Face causal LM and their name in it (model.layers, transformer.h)."""
    for name in DECODER_LAYERS:
        try:
            return name, model.get_submodule(name)
        except AttributeError:
            continue
    raise SystemExit(f"{type(model).__name__} keeps its decoder layers in none of {DECODER_LAYERS}")


def meta_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model saved in `path` built from its config.json on the meta device: shapes only, nothing read, nothing
    allocated (`stream_checkpoint` fills it after `fully_shard`, one layer at a time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def stream_checkpoint(model: torch.nn.Module, path: str, dtype: torch.dtype, rank: int, world: int,
                      prepare=None, device: torch.device = torch.device("cpu")) -> None:
    """Fill `model` (a Hugging Face causal LM built on the meta device, `fully_shard`-ed per decoder layer and at
    the root, then `to_empty`-ed) with the safetensors checkpoint in `path` (one file, or sharded with
    model.safetensors.index.json), one decoder layer at a time: the layer's tensors read alone, in `dtype`, made
    ready by `prepare(layer, index)` (QLoRA: quantized to NF4 and given its adapters) and cut to this rank's shard;
    then the root (embeddings, final norm, head) the same way. A rank's host memory holds its shards and one layer,
    never the whole model; quantizing runs on the rank's GPU (`device`), or on the CPU rig on this rank's share of
    the cores (torchrun sets OMP_NUM_THREADS=1)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from helpers.models.hf import load_module
    from helpers.runtime.host import preparing_on
    from helpers.runtime.launch import release_host_memory
    from helpers.training.strategies import fill_shards, host_threads

    # meta parameters, real buffers (rotary frequencies), on the host whatever the default device
    with torch.device("cpu"), init_empty_weights(include_buffers=False):
        host = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    host.tie_weights()  # as `model` is (accelerate's empty init unties a tied head)
    name, layers = decoder_layers(host)
    blocks = list(layers)
    parent, _, leaf = name.rpartition(".")
    setattr(host.get_submodule(parent), leaf, torch.nn.ModuleList())  # what is left is the root
    sharded = decoder_layers(model)[1]
    with torch.device("cpu"), host_threads(), preparing_on(device):  # quantize on the rank's GPU, if it has one
        for i in range(len(blocks)):
            block = load_module(blocks[i], path, f"{name}.{i}.", dtype)
            blocks[i] = None  # the host copy goes once its shard is cut
            fill_shards(sharded[i], prepare(block, i) if prepare else block, rank, world)
            del block
            release_host_memory()
        fill_shards(model, load_module(host, path, "", dtype), rank, world)


_WINDOWS: dict[str, torch.Tensor] = {}


def windows(ns: argparse.Namespace, vocab: int) -> torch.Tensor:
    """The token windows [N, L+1] of --data, or of --text (tokenized once; a tokenizer trained here is saved with
    --save-to by rank 0, so the trained model keeps it). Too little text for one batch stops every rank."""
    if "rows" not in _WINDOWS:
        if ns.data:
            rows = torch.load(ns.data, map_location="cpu")
        else:
            from helpers.models.text import encode, read_text, tokenizer_for, windows as cut

            text = read_text(ns.text, 400_000)
            first = not dist.is_initialized() or dist.get_rank() == 0
            if first:
                tokenizer_for(ns.model, text, vocab)  # trains one and saves it beside the model if it has none
            if dist.is_initialized():
                dist.barrier()
            tokenizer = tokenizer_for(ns.model, text, vocab)
            if ns.save_to and first:
                tokenizer.save_pretrained(ns.save_to)
            rows = cut(encode(tokenizer, text), ns.seq_len)
        if len(rows) < ns.batch:
            raise SystemExit(f"the corpus is smaller than one batch: {len(rows)} windows of {rows.shape[1]} tokens, "
                             f"--batch {ns.batch}")
        _WINDOWS["rows"] = rows
    return _WINDOWS["rows"]


def batches(ns: argparse.Namespace, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the global batch for `step`, identical on every rank, made on the host (as a DataLoader
    makes it): the caller moves it to its device."""
    with torch.device("cpu"):
        return _host_batch(ns, vocab, step)


def _host_batch(ns: argparse.Namespace, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batches` on the default device."""
    if ns.data or ns.text:
        tokens = windows(ns, vocab)
        start = (step * ns.batch) % max(1, len(tokens) - ns.batch + 1)
        rows = tokens[start:start + ns.batch, :ns.seq_len + 1]
    else:  # learnable: each token follows the previous one by a fixed permutation, from a random first token
        rule = torch.randperm(vocab, generator=torch.Generator().manual_seed(ns.seed))
        g = torch.Generator().manual_seed(ns.seed * 100_003 + step)
        columns = [torch.randint(vocab, (ns.batch,), generator=g)]
        for _ in range(ns.seq_len):
            columns.append(rule[columns[-1]])
        rows = torch.stack(columns, dim=1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over the real tokens, in fp32. Divide by the real tokens of the *whole* batch: then
    shards and micro-batches with different padding still add up to one device's mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def autocast(ns: argparse.Namespace, device: torch.device):
    if ns.autocast == "none":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if ns.autocast == "bf16" else torch.float16)


def report(step: int, loss: float) -> None:
    """One JSON line per step on rank 0 (tests and plots read them)."""
    if dist.get_rank() == 0:
        print(json.dumps({"step": step, "loss": loss}), flush=True)


def checkpointer(ns: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler=None):
    """With --checkpoint-dir, the run's checkpoints (helpers.training.checkpoint: model through DCP's
    get_state_dict, so FSDP2 shards and peft's frozen base are handled as PyTorch intends: a LoRA checkpoint holds
    the adapters; optimizer, scaler, step, RNG); else None. `model`: what holds this rank's trainable weights, its
    names unique across ranks (a pipeline stage: helpers.training.checkpoint.layer_view)."""
    if not ns.checkpoint_dir:
        return None
    from helpers.training.checkpoint import Checkpointer, CheckpointSpec

    spec = CheckpointSpec(ns.checkpoint_dir, every=ns.checkpoint_every, keep=ns.keep, async_save=ns.async_save)
    enabled = scaler is not None and scaler.is_enabled()
    return Checkpointer(spec, model, [optimizer], scaler=scaler if enabled else None)


def training_steps(ns: argparse.Namespace, checkpoints=None):
    """The steps still to run: from 0, or from the latest complete checkpoint's step; after each step a checkpoint
    is saved when due, and the last save is waited for at the end."""
    first = checkpoints.resume() if checkpoints is not None else 0
    if first and dist.get_rank() == 0:
        print(f"resumed from {ns.checkpoint_dir} at step {first}", file=sys.stderr, flush=True)
    for step in range(first, ns.steps):
        yield step
        if checkpoints is not None:
            checkpoints.after_step(step + 1, ns.steps)
    if checkpoints is not None:
        checkpoints.close()


def exit_without_teardown() -> None:
    """End a rank whose work is done (the process group destroyed, the results written) without the interpreter's
    teardown: FSDP2 ranks abort there now and then ("terminate called without an active exception", about one run
    in ten on the CPU rig), which torchrun reports as a failed run. The course's own workers end the same way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
