"""`python -m helpers.plan`: will a model fit on your GPUs for inference, and with which device_map? With --train:
will a fine-tune fit, and if not, what would?

    python -m helpers.plan --model llama-2-13b --dtype fp16 --context 4096 --batch 1
    python -m helpers.plan --model llama-2-70b --dtype nf4 --gpus "RTX 3090, RTX 4090" --json
    python -m helpers.plan --compare          # the six bundled shapes: our plan vs accelerate's maps
    python -m helpers.plan --train --model llama-2-70b --method qlora --context 2048 --batch 2 --offload cpu --json
    python -m helpers.plan --speed --model llama-2-70b --dtype nf4 --batch 1 --context 1024 --rig "2x3090 PCIe P2P"

Only parses arguments and prints; the planning lives in helpers.inference.plan and helpers.finetune.memory_plan, the
speed prediction (--speed: prefill and decode tokens/s of the layer split, pipelined requests and tensor parallelism)
in helpers.inference.speed.
"""
from __future__ import annotations

import argparse
import json
import sys

from helpers.sizing.training import METHODS, default_lora_rank
from helpers.finetune.memory_plan import PLAN_STRATEGIES, plan_training
from helpers.finetune.training_request import TECHNIQUES
from helpers.sizing.state import known_optimizers
from helpers.inference.plan import LOGITS_MODES, LOGITS_PRICED, DoesNotFit, plan
from helpers.inference.speed import predict_speed
from helpers.inference.speed_rigs import speed_rigs
from helpers.hardware import rig_of_gpus
from helpers.report import table
from helpers.simulate.guide import MODELS, recommend_model
from helpers.sizing.gpus import describe_gpus, parse_gpus
from helpers.sizing.shape import known_formats, known_models
from helpers.units import parse_size


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m helpers.plan",
        description="Plan big-model inference over GPUs: weights, KV cache, workspace and runtime reserve per GPU, "
                    "and the split that decodes fastest, as a device_map for from_pretrained.")
    parser.add_argument("--model", default="llama-2-13b",
                        help=f"a bundled model ({', '.join(known_models())}), its Hugging Face id, or a local "
                             "directory with a config.json")
    parser.add_argument("--dtype", default=None,
                        help=f"weight format: {', '.join(known_formats())} (or 4bit, 8bit); default fp16 (inference); "
                             "with --train the frozen base's format, default bf16 (full, lora) or nf4 (qlora)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per sequence: prompt + generated, default 4096 (with --train: the training "
                             "sequence length; with --guide, default 1024)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences decoded together, default 1 (with --guide: the global batch, default 16)")
    parser.add_argument("--gpus", default="2 x RTX 3090",
                        help="e.g. '2 x RTX 3090', 'RTX 3090, RTX 4090', 'RTX 5090=32GiB', '2x24GiB'")
    parser.add_argument("--logits", choices=LOGITS_MODES, default="last",
                        help="logits workspace: the last position only (generate(), the default) or the whole prompt "
                             "(a forward that computes a loss over it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--compare", action="store_true",
                        help="our plan vs accelerate's balanced / balanced_low_0 / sequential maps on the bundled "
                             "shapes (ignores --model, --dtype and --context)")
    speed = parser.add_argument_group("speed (--speed)", "prefill and decode tokens/s of each engine, predicted "
                                      "(helpers.inference.speed): memory bandwidth and compute per phase, per-layer "
                                      "all-reduces with their small-message latency")
    speed.add_argument("--speed", action="store_true", help="predict tokens/s instead of planning memory")
    speed.add_argument("--rig", default="2x3090 PCIe",
                       help="a named rig (" + ", ".join(speed_rigs()) + "), 'all', or your GPUs as "
                            "`python -m helpers.doctor --json doctor.json` measured them: doctor.json")
    speed.add_argument("--prompt", type=int, help="prompt tokens for prefill (default: --context)")
    speed.add_argument("--requests", type=int, default=2, help="requests in flight for the pipelined split")
    _training_arguments(parser)
    parser.add_argument("--guide", action="store_true",
                        help="which way to train --model (" + ", ".join(MODELS) + ") on --gpus, from the simulator: "
                             "DDP, ZeRO-1, FSDP2 or a 1F1B pipeline, each balanced by speed on unequal cards "
                             "(batch 16 x 1024 tokens unless --batch / --context say otherwise)")
    return parser


def _model_named(name: str) -> str:
    """One of the guide's MODELS from the user's spelling ('gpt2-medium', 'GPT-2 medium', 'llama-2-7b')."""
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    found = [m for m in MODELS if "".join(ch for ch in m.lower() if ch.isalnum()) == key]
    if not found:
        raise ValueError(f"the guide knows {', '.join(MODELS)}, not {name!r}")
    return found[0]


def _guide(ns: argparse.Namespace) -> None:
    """Print the guide's options for the model on the GPUs, its choice, and on unequal cards how it splits."""
    rig = rig_of_gpus(parse_gpus(ns.gpus))
    rec = recommend_model(_model_named(ns.model), rig, batch=ns.batch or 16, seq=ns.context or 1024)
    if ns.json:
        print(json.dumps({"model": rec.model, "rig": rec.rig, "choice": rec.choice, "why": rec.why(),
                          "options": rec.rows()}))
        return
    print(f"{rec.model} on {rec.rig} (batch {ns.batch or 16} x {ns.context or 1024} tokens, bf16 mixed precision "
          f"+ Adam, simulated):")
    print(table(rec.rows()))
    print(f"choose: {rec.choice}" + (f"\n{rec.why()}" if rec.why() else ""))


def _speed(ns: argparse.Namespace) -> None:
    """Print (or --json) the predicted tokens/s of every engine on the chosen rig(s)."""
    rigs = speed_rigs() if ns.rig == "all" else [ns.rig]
    predictions = [predict_speed(ns.model, ns.dtype or "fp16", rig, ns.batch, ns.context, ns.prompt, ns.requests)
                   for rig in rigs]
    if ns.json:
        print(json.dumps([row for p in predictions for row in p.as_dicts()]))
    else:
        print("\n\n".join(p.describe() for p in predictions))


TRAINING_FLAGS = ("method", "strategy", "offload", "activation_checkpointing", "lora_rank", "lora_targets",
                  "optimizer", "precision", "microbatches", "host_ram", "techniques")


def _training_arguments(parser: argparse.ArgumentParser) -> None:
    """The --train flags; all default to None so that giving one without --train is refused."""
    train = parser.add_argument_group(
        "fine-tuning (--train)", "per-GPU memory of a training step: frozen and trainable weights, gradients, "
        "optimizer state, activations, workspace and reserve (helpers.finetune.memory_plan)")
    train.add_argument("--train", action="store_true", help="plan a fine-tune instead of inference")
    train.add_argument("--method", help=f"{', '.join(METHODS)} (default qlora)")
    train.add_argument("--strategy", help=f"{', '.join(PLAN_STRATEGIES)} (default fsdp2; 1f1b: a pipeline of one stage per GPU)")
    train.add_argument("--offload", help="none or cpu (FSDP2's CPUOffloadPolicy; default none)")
    train.add_argument("--activation-checkpointing", "--checkpointing", dest="activation_checkpointing",
                       action=argparse.BooleanOptionalAction, default=None,
                       help="recompute every decoder layer's activations in backward (default on; --checkpointing: "
                            "its old name)")
    train.add_argument("--lora-rank", type=int, help=f"LoRA rank (default {default_lora_rank()}, QLoRA's)")
    train.add_argument("--lora-targets", help="all (every decoder linear, the default), attention (q, k, v, o), or "
                                              "module names: q_proj,v_proj")
    train.add_argument("--optimizer", help=f"{', '.join(known_optimizers())} (default adamw: fp32 moments; "
                                           "adamw-8bit and adamw-4bit are torchao's, adamw-8bit-bnb bitsandbytes')")
    train.add_argument("--precision", help="mixed (fp32 optimizer, the default) or pure (all in bf16)")
    train.add_argument("--microbatches", "--grad-accum", type=int, dest="microbatches",
                       help="micro-batches per optimizer step (default 1; 1f1b: one per stage; --grad-accum: its old "
                            "name)")
    train.add_argument("--technique", "--techniques", action="append", dest="techniques",
                       help="a memory technique, repeatable or comma separated: " + ", ".join(TECHNIQUES))
    train.add_argument("--host-ram",
                       help="host memory to check CPU offload against, e.g. 128GiB (default: report only)")


def _train(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Plan a fine-tune and print it; exit 1 when it does not fit (the plan lists what would)."""
    if ns.compare:
        parser.error("--compare compares inference maps; leave it out with --train")
    options = {key: getattr(ns, key) for key in TRAINING_FLAGS if getattr(ns, key) is not None}
    if "host_ram" in options:
        options["host_ram_bytes"] = parse_size(options.pop("host_ram"))
    result = plan_training(ns.model, context=ns.context, batch=ns.batch, gpus=ns.gpus, dtype=ns.dtype, **options)
    print(json.dumps(result.as_dict()) if ns.json else result.describe())
    if not result.fits:
        print(f"error: {result.shape.name} ({result.shape.method}) does not fit on {describe_gpus(result.request.gpus)}"
              "; the plan lists what would", file=sys.stderr)
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    ns = parser.parse_args(argv)
    if not ns.train:
        given = [f"--{key.replace('_', '-')}" for key in TRAINING_FLAGS if getattr(ns, key) is not None]
        if given:
            parser.error(f"{', '.join(given)} plan a fine-tune: add --train")
    try:
        if ns.guide:
            return _guide(ns)
        ns.context = 4096 if ns.context is None else ns.context
        ns.batch = 1 if ns.batch is None else ns.batch
        if ns.train:
            return _train(parser, ns)
        if ns.speed:
            return _speed(ns)
        gpus = parse_gpus(ns.gpus)
        if ns.compare:
            from helpers.inference.compare import compare_with_accelerate, comparison_table

            rows = compare_with_accelerate(gpus=gpus, batch=ns.batch, logits=ns.logits)
            if ns.json:
                print(json.dumps([{k: v for k, v in r.items() if k != "placement"} for r in rows]))
            else:
                print(f"on {describe_gpus(gpus)}, batch {ns.batch}, logits for {LOGITS_PRICED[ns.logits]}:")
                print(comparison_table(rows))
            return
        placement = plan(ns.model, ns.dtype or "fp16", ns.context, ns.batch, gpus, ns.logits)
    except DoesNotFit as err:
        if ns.json:
            print(json.dumps(err.as_dict()))
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1)
    except ValueError as err:
        parser.error(str(err))
    print(json.dumps(placement.as_dict()) if ns.json else placement.describe())


if __name__ == "__main__":
    main()
