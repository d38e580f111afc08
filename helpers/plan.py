"""`python -m helpers.plan`: will a model fit on your GPUs for inference, and with which device_map?

    python -m helpers.plan --model llama-2-13b --dtype fp16 --context 4096 --batch 1
    python -m helpers.plan --model llama-2-70b --dtype nf4 --gpus "RTX 3090, RTX 4090" --json
    python -m helpers.plan --compare          # the six bundled shapes: our plan vs accelerate's maps

Only parses arguments and prints; the planning lives in helpers.inference.plan.
"""
from __future__ import annotations

import argparse
import json
import sys

from helpers.inference.plan import (LOGITS_MODES, DoesNotFit, describe_gpus, known_formats, known_models,
                                    parse_gpus, plan)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m helpers.plan",
        description="Plan big-model inference over GPUs: weights, KV cache, workspace and runtime reserve per GPU, "
                    "and the split that decodes fastest, as a device_map for from_pretrained.")
    parser.add_argument("--model", default="llama-2-13b",
                        help=f"a bundled model ({', '.join(known_models())}), its Hugging Face id, or a local "
                             "directory with a config.json")
    parser.add_argument("--dtype", default="fp16", help=f"weight format: {', '.join(known_formats())} (or 4bit, 8bit)")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence: prompt + generated")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--gpus", default="2 x RTX 3090",
                        help="e.g. '2 x RTX 3090', 'RTX 3090, RTX 4090', 'RTX 5090=32GiB', '2x24GiB'")
    parser.add_argument("--logits", choices=LOGITS_MODES, default="prompt",
                        help="logits workspace: for the whole prompt (a forward with a loss; the safe default) or "
                             "the last position only (generate())")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--compare", action="store_true",
                        help="our plan vs accelerate's balanced / balanced_low_0 / sequential maps on the bundled "
                             "shapes (ignores --model, --dtype and --context)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    ns = parser.parse_args(argv)
    try:
        gpus = parse_gpus(ns.gpus)
        if ns.compare:
            from helpers.inference.compare import compare_with_accelerate, comparison_table

            rows = compare_with_accelerate(gpus=gpus, batch=ns.batch, logits=ns.logits)
            if ns.json:
                print(json.dumps([{k: v for k, v in r.items() if k != "placement"} for r in rows]))
            else:
                print(f"on {describe_gpus(gpus)}, batch {ns.batch}, logits for the "
                      f"{'whole prompt' if ns.logits == 'prompt' else 'last position'}:")
                print(comparison_table(rows))
            return
        placement = plan(ns.model, ns.dtype, ns.context, ns.batch, gpus, ns.logits)
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
