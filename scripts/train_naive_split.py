"""The naive split: one process, the first half of the layers on cuda:0, the rest on cuda:1 (a `device_map`, as
`from_pretrained` accepts it); activations hop to the next GPU between the halves. Half the memory per GPU, no
speed-up: one GPU waits while the other works (notebook 01).

    python scripts/train_naive_split.py --model DIR --steps 100 --autocast bf16 --save-to OUT
"""
import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from _common import IGNORE_INDEX, autocast, batches, parse, token_loss_sum, weights_dtype


def half_and_half(model_dir: str, devices: list) -> dict:
    """First half of the decoder layers (and the embeddings) on devices[0], the rest (and the head) on devices[1]."""
    config = AutoConfig.from_pretrained(model_dir)
    prefix = "transformer.h" if config.model_type == "gpt2" else "model.layers"
    n = config.num_hidden_layers
    names = {f"{prefix}.{i}": devices[0] if i < n // 2 else devices[1] for i in range(n)}
    base = "transformer" if config.model_type == "gpt2" else "model"
    first = ["wte", "wpe"] if config.model_type == "gpt2" else ["embed_tokens", "rotary_emb"]
    last = ["ln_f"] if config.model_type == "gpt2" else ["norm"]
    return {**{f"{base}.{m}": devices[0] for m in first}, **names, **{f"{base}.{m}": devices[1] for m in last},
            "lm_head": devices[0] if config.tie_word_embeddings else devices[1]}


def split_devices(gpus: int, force_cpu: bool) -> tuple[list, str]:
    """The two halves' devices on this machine, and the line that says so: two GPUs, one GPU holding both halves
    (the same code, no memory saved), or the CPU."""
    if force_cpu or gpus == 0:
        why = "LAB_FORCE_CPU=1" if force_cpu else "no CUDA GPU visible"
        return ["cpu", "cpu"], f"naive split: both halves on the CPU ({why})"
    if gpus == 1:
        return [0, 0], ("naive split: one GPU visible, so both halves on cuda:0 (the code of the split runs; the "
                        "memory it saves needs a second GPU)")
    return [0, 1], "naive split: first half on cuda:0, second half on cuda:1"


def main() -> None:
    ns = parse(__doc__.splitlines()[0])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices, said = split_devices(gpus, os.environ.get("LAB_FORCE_CPU") == "1")
    print(said, flush=True)
    model = AutoModelForCausalLM.from_pretrained(ns.model, device_map=half_and_half(ns.model, devices),
                                                 dtype=weights_dtype(ns))
    first = torch.device("cpu" if devices[0] == "cpu" else "cuda:0")
    optimizer = torch.optim.AdamW(model.parameters(), lr=ns.lr)
    scaler = torch.amp.GradScaler(first.type, enabled=ns.autocast == "fp16")
    for step in range(ns.steps):
        x, y = batches(ns, model.config.vocab_size, step)
        optimizer.zero_grad()
        with autocast(ns, first):
            logits = model(input_ids=x.to(first)).logits  # accelerate's hooks move activations between GPUs
        loss = token_loss_sum(logits, y.to(logits.device)) / (y != IGNORE_INDEX).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(json.dumps({"step": step, "loss": loss.item()}), flush=True)
    if ns.save_to:
        model.save_pretrained(ns.save_to)


if __name__ == "__main__":
    main()
