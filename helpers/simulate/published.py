"""The simulator's other-hardware predictions next to published results (data/published.json, with sources).

Each check rebuilds the published setup as a workload (its layers traced kernel by kernel on the meta device,
`helpers.simulate.roofline`) on the rig in data/hardware.json that ran it, or the nearest one: where the published
hardware is not one of ours the row says which rig stands in for it, and the error then includes that difference.

Three constants are fitted here, each on one published figure of a different GPU (`FITTED`, `fitted_constants()`):
the share of a training step spent in traced kernels on Lambda's RTX 3090 BERT-large throughput, the convolution
efficiency on its RTX 4090 ResNet-50, and the A100's own convolution efficiency on its A100 ResNet-50. Every other
row is validation: no other published figure sets anything. The data-parallel rows exchange gradients as Lambda's
own fp32 logs time it on each of its machines (`lambda_gradient_exchange`: a measurement, read off the logs without
the simulator), in one piece after the backward, as those logs show; the fp16 speed-ups and Hugging Face's NVLink /
no-P2P ratio (whose no-P2P all-reduce is the 2x RTX 3090 machine's) check it.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn

from helpers.facts import load_data
from helpers.simulate.guide import exposed_exchange, transformer_workload
from helpers.hardware import (Collectives, Efficiency, Link, TargetRig, allreduce_link, efficiency, gpu_named,
                              link_named, target_rig)
from helpers.dtypes import DTYPES
from helpers.simulate.roofline import kernels_s, trace_call, trace_kernels, workload_from_traces
from helpers.sizing.gpus import Gpu
from helpers.sizing.shape import decoder_shape
from helpers.simulate.job import Job
from helpers.simulate.strategies import Simulation, simulate
from helpers.simulate.workload import Workload

BERT = {"BERT-base": (12, 768, 12), "BERT-large": (24, 1024, 16)}  # layers, hidden, heads (intermediate 4 x hidden)
BERT_SEQ = 384  # Lambda's run_squad.py max_seq_length (its logs: pytorch/results/*/PyTorch_bert_*_squad_FP16)
GPT2_SMALL = ("gpt2", 12, 768, 12, 50257, 3072)  # decoder_shape arguments
RESNET50_STAGES = (("layer1", 3, 64, 1), ("layer2", 4, 128, 2), ("layer3", 6, 256, 2), ("layer4", 3, 512, 2))
LAMBDA_RIGS = (("2x3090 PCIe", "lambda_2x3090_data_parallel"), ("2x4090", "lambda_2x4090_data_parallel"),
               ("2xA100", "lambda_2xa100_sxm4_data_parallel"))
NO_P2P = "3090_gpu_to_gpu_no_p2p"
FITTED = {"framework": "Lambda one-GPU throughput, BERT-large (samples/s), RTX 3090",
          "conv": "Lambda one-GPU throughput, ResNet-50 (samples/s), RTX 4090",
          "A100 conv": "Lambda one-GPU throughput, ResNet-50 (samples/s), A100 80GB SXM"}


class _Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck (the stride in the 3x3 convolution), rebuilt: torchvision is not a
    dependency of the course."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        out = 4 * width
        self.body = nn.Sequential(nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                  nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                         if stride != 1 or cin != out else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet50_layers(classes: int = 1000) -> list[tuple[str, nn.Module, int]]:
    """torchvision's ResNet-50 as six named layers on the meta device (each once): stem, layer1-4, pool + fc."""
    with torch.device("meta"):
        layers = [("stem", nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                         nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)), 1)]
        cin = 64
        for name, blocks, width, stride in RESNET50_STAGES:
            stage = [_Bottleneck(cin if i == 0 else 4 * width, width, stride if i == 0 else 1) for i in range(blocks)]
            layers.append((name, nn.Sequential(*stage), 1))
            cin = 4 * width
        layers.append(("pool + fc", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)), 1))
    return layers


@functools.lru_cache(maxsize=16)
def _traced(model: str, batch: int, size: int, dtype: str):
    """(layers, their traces) of ResNet-50 on `size` px images or a BERT on `size` tokens, for `batch` samples."""
    if model == "ResNet-50":
        layers, sample = resnet50_layers(), torch.zeros(batch, 3, size, size)
    else:
        layers, sample = bert_layers(model), torch.zeros(batch, size, dtype=torch.long)
    return layers, trace_kernels([module for _, module, _ in layers], sample, dtype)


def resnet50_workload(image: int, gpu: Gpu, dtype: str, recipe: str, batch: int = 32,
                      eff: Efficiency | None = None) -> Workload:
    """ResNet-50 on `image` x `image` pictures on `gpu`, traced at a micro-batch of `batch` images."""
    return workload_from_traces(*_traced("ResNet-50", batch, image, dtype), batch, gpu, dtype, recipe, eff)


def _bert_config(hidden: int, heads: int, layers: int = 1):
    from transformers import BertConfig

    config = BertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
                        num_hidden_layers=layers)
    config._attn_implementation = "eager"  # NVIDIA's and Hugging Face's BERT of these runs: unfused attention
    return config


def bert_layers(name: str, classes: int = 2) -> list[tuple[str, nn.Module, int]]:
    """Hugging Face's BERT (`BERT` sizes) for SQuAD as (name, layer, repeats) on the meta device: embeddings, the
    encoder layers (one, repeated), the span head."""
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

    layers, hidden, heads = BERT[name]
    config = _bert_config(hidden, heads, layers)
    with torch.device("meta"):
        return [("embedding", BertEmbeddings(config), 1), ("block", BertLayer(config), layers),
                ("head", nn.Linear(hidden, classes), 1)]


def bert_workload(name: str, seq: int, gpu: Gpu, dtype: str, recipe: str, batch: int,
                  eff: Efficiency | None = None) -> Workload:
    """BERT-base or BERT-large fine-tuning on `seq` tokens on `gpu`, traced at a micro-batch of `batch`."""
    if name not in BERT:
        raise ValueError(f"unknown BERT {name!r}; choose one of {list(BERT)}")
    return workload_from_traces(*_traced(name, batch, seq, dtype), batch, gpu, dtype, recipe, eff)


def _row(check: str, simulated_on: str, predicted: float, published: float, source: str, model: str = "",
         gpu: str = "") -> dict:
    """One check; `model` and `gpu` name a one-GPU figure whose GPU order per model is checked too."""
    return {"check": check, "rig simulated": simulated_on, "predicted": predicted, "published": published,
            "error": predicted / published - 1, "source": source, "model": model, "gpu": gpu}


def tutorial_rows(rig: str = "2x3090 PCIe") -> list[dict]:
    """PyTorch's model-parallel tutorial (ResNet-50 split after layer2): naive split and pipelines vs one GPU.
    The tutorial does not say which GPUs it ran on."""
    published = load_data("published")
    times, setup = published["pytorch_model_parallel_tutorial"], published["pytorch_model_parallel_tutorial_setup"]
    rig = target_rig(rig)
    workload = resnet50_workload(setup["image"], rig.gpu, setup["dtype"], "fp32 + SGD", batch=setup["batch"])
    batch, cut, single = setup["batch"], (3,), times["seconds"]["single_gpu"]
    one = simulate(workload, Job("single", batch))
    rows = [_row("PyTorch tutorial: naive split vs one GPU (x)", rig.name,
                 one.step_s / simulate(workload, Job("naive", batch, boundaries=cut), rig.link).step_s,
                 single / times["seconds"]["naive_model_parallel"], times["source"])]
    for key, split in setup["split_sizes"].items():
        pipe = simulate(workload, Job("gpipe", batch, microbatches=batch // split, boundaries=cut), rig.link)
        rows.append(_row(f"PyTorch tutorial: pipelined, split size {split}, vs one GPU (x)", rig.name,
                         one.step_s / pipe.step_s, single / times["seconds"][key], times["source"]))
    return rows


def lambda_workloads(gpu: Gpu, eff: Efficiency | None = None, only: str | None = None) -> dict[str, Workload]:
    """Lambda's fp16 training runs as workloads on `gpu`, each at Lambda's per-GPU batch for that GPU: ResNet-50
    (AMP, SGD with momentum) and BERT SQuAD fine-tuning (apex O2: fp16 weights and gradients, fp32 master weights
    and Adam, eager attention, dropout 0.1)."""
    batches = load_data("published")["lambda_batch_per_gpu_fp16"]["batch"][gpu.name]
    build = {"ResNet-50": lambda: resnet50_workload(224, gpu, "fp16", "fp32 + SGD momentum", batches["ResNet-50"],
                                                    eff)}
    build.update({name: (lambda name=name: bert_workload(name, BERT_SEQ, gpu, "fp16", "mixed precision + Adam",
                                                         batches[name], eff)) for name in BERT})
    return {name: make() for name, make in build.items() if only in (None, name)}


def lambda_gradient_exchange(gpu: str) -> Collectives:
    """The gradient exchange of Lambda's two-GPU runs on `gpu`, as their own fp32 BERT-large logs time it
    (data/published.json `lambda_fp32_bert_large_steps`): the seconds two GPUs add to each step over one, for the
    bytes of its fp32 gradients. Their machines pay it whole after the backward, at a rate set by the machine and
    not by its link (the entry's `why`: the same per byte in fp16 and fp32, BERT-base and BERT-large, over NVLink
    and over PCIe), so the fp16 speed-ups are predicted with it, all-reduced in one piece after the backward."""
    entry = load_data("published")["lambda_fp32_bert_large_steps"]
    run = entry["seconds_iterations_51_to_101"][gpu]
    added_s = (run["two_gpus"] - run["one_gpu"]) / entry["steps"]
    exchange = Link(0.0, entry["gradient_bytes_per_param"] * entry["params_with_gradients"] / added_s,
                    f"Lambda's {gpu} gradient exchange")
    return Collectives(exchange, exchange, exchange, exchange, name=exchange.name)


def lambda_ddp(workload: Workload, rig: TargetRig, batch: int) -> Simulation:
    """One step of Lambda's data-parallel run of `workload` on `rig`, `batch` samples per GPU: every gradient
    exchanged after the backward, at the rate Lambda's logs show (`lambda_gradient_exchange`)."""
    return simulate(workload, exposed_exchange(Job("ddp", rig.devices * batch, dp=rig.devices)), rig.link,
                    lambda_gradient_exchange(rig.gpu.name))


def lambda_rows() -> list[dict]:
    """Lambda's fp16 training benchmark for ResNet-50, BERT-base and BERT-large: one GPU's throughput and the
    1 -> 2 GPU data-parallel speed-up, on 2x3090, 2x4090 and 2xA100 (GNMT, an LSTM, is not modelled). The
    speed-ups use the gradient exchange Lambda's fp32 logs time on each machine (`lambda_gradient_exchange`), not
    the rig's link."""
    published = load_data("published")
    batches = published["lambda_batch_per_gpu_fp16"]["batch"]
    single = published["lambda_1gpu_throughput_fp16"]
    rows = []
    for rig_name, key in LAMBDA_RIGS:
        rig, entry = target_rig(rig_name), published[key]
        for model, workload in lambda_workloads(rig.gpu).items():
            batch = batches[rig.gpu.name][model]
            one = simulate(workload, Job("single", batch))
            rows.append(_row(f"Lambda one-GPU throughput, {model} (samples/s)", rig.gpu.name, one.samples_per_s,
                             single["samples_per_s"][rig.gpu.name][model], single["source"], f"Lambda {model}",
                             rig.gpu.name))
            two = lambda_ddp(workload, rig, batch)
            rows.append(_row(f"Lambda DDP speed-up, {model} (x)", rig.name, two.samples_per_s / one.samples_per_s,
                             entry["speedup"][model], entry["source"]))
    return rows


def bert_layer_tflops(seq: int, batch: int, gpu: Gpu, hidden: int = 1024, heads: int = 16,
                      dtype: str = "fp16") -> float:
    """The TFLOPS `micro_bench.ipynb` reports for one BERT layer forward + backward: its formula's FLOPs
    (3 x (24 b s h^2 + 4 b s^2 h)) over the time of its timed statement, `layer(X)[0].sum().backward()` on a fresh
    `BertLayer` (train mode: dropout on) and an input without gradient, here traced as written on the meta device
    (`trace_call`) and timed kernel by kernel on `gpu`. The timer repeats the statement and nothing zeroes the
    gradients between runs, so every run but the first also adds each parameter's new gradient into the one already
    there (16 more kernels, autograd's accumulation), and the sum reads the output once: both traced after one
    untimed run, as `torch.utils.benchmark`'s warm-up leaves the layer."""
    from transformers.models.bert.modeling_bert import BertLayer

    with torch.device("meta"):
        layer = BertLayer(_bert_config(hidden, heads)).to(DTYPES[dtype]).train()
    sample = torch.zeros(batch, seq, hidden, device="meta", dtype=DTYPES[dtype])

    def timed_statement():
        out = layer(sample)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    timed_statement()  # the gradients now exist: the timed runs accumulate into them
    seconds = kernels_s(trace_call(timed_statement), gpu, dtype)
    return 3 * (24 * batch * seq * hidden ** 2 + 4 * batch * seq ** 2 * hidden) / seconds / 1e12


def micro_bench_rows() -> list[dict]:
    """mli/transformers-benchmarks: TFLOPS of one BERT-large layer (fp16, forward + backward) on an RTX 3090 Ti,
    an RTX 4090 and an A100."""
    entry = load_data("published")["mli_bert_layer_tflops"]
    setup = entry["setup"]
    return [_row(f"BERT-large layer fwd+bwd, seq {setup['seq']}, batch {setup['batch']} (TFLOPS)", gpu_name,
                 bert_layer_tflops(setup["seq"], setup["batch"], gpu_named(gpu_name)), published, entry["source"],
                 "BERT-large layer", gpu_name)
            for gpu_name, published in entry["fwd_bwd_tflops"].items()]


def nvlink_rows() -> list[dict]:
    """Hugging Face's DDP training of GPT-2 (fp32, 4 x 1024 tokens per GPU) on 2x TITAN RTX, with its NVLink
    bridge and with NCCL_P2P_DISABLE=1: the time ratio. The all-reduce over the bridge is nccl-tests' on the same
    chip's bridge (2x RTX 2080 Ti); without P2P, the GeForce no-P2P all-reduce (data/hardware.json: what Lambda's
    2x RTX 3090 logs time); each after the backward, as Lambda's logs show; the compute is an RTX 3090's (no TITAN
    RTX figures)."""
    published = load_data("published")
    times, setup = published["hf_nvlink_ddp"], published["hf_nvlink_ddp_setup"]
    gpu, batch = gpu_named("RTX 3090"), setup["per_device_batch"]
    workload = transformer_workload(decoder_shape(*GPT2_SMALL), setup["seq"], gpu, setup["dtype"], "eager",
                                    "fp32 + Adam", batch=batch)
    nvlink, job = allreduce_link("2080ti_nvlink_bridge_nv2"), exposed_exchange(Job("ddp", 2 * batch))
    ratio = (simulate(workload, job, link_named(NO_P2P), allreduce_link(NO_P2P)).step_s
             / simulate(workload, job, nvlink, nvlink).step_s)
    return [_row("HF GPT-2 DDP: no-P2P time / NVLink time (x)", "RTX 3090 compute; 2080 Ti bridge vs no-P2P",
                 ratio, times["seconds"]["nccl_p2p_disable"] / times["seconds"]["nvlink"], times["source"])]


def predictions_vs_published() -> list[dict]:
    """Every check: what was predicted, what was published, the relative error, and the source."""
    return tutorial_rows() + lambda_rows() + micro_bench_rows() + nvlink_rows()


def gpu_orders(rows: list[dict]) -> dict[str, tuple[list[str], list[str]]]:
    """For every model with one-GPU figures on several GPUs: (the GPUs fastest first as predicted, as published)."""
    orders = {}
    for model in sorted({r["model"] for r in rows if r["model"]}):
        mine = [r for r in rows if r["model"] == model]
        orders[model] = ([r["gpu"] for r in sorted(mine, key=lambda r: -r["predicted"])],
                         [r["gpu"] for r in sorted(mine, key=lambda r: -r["published"])])
    return orders


def _bisect(error, low: float, high: float, steps: int = 30) -> float:
    """The root of `error` between `low` and `high` (where it changes sign), by bisection."""
    rising = error(high) > error(low)
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if (error(mid) < 0) == rising else (low, mid)
    return (low + high) / 2


def _lambda_one_gpu_error(model: str, gpu: str, eff: Efficiency | None = None, card: Gpu | None = None) -> float:
    """Predicted over published one-GPU samples/s of a Lambda model on `gpu`, minus 1, under the roofline constants
    `eff` and with `card` (the GPU's description with a constant changed) in place of the GPU's own."""
    published = load_data("published")
    batch = published["lambda_batch_per_gpu_fp16"]["batch"][gpu][model]
    workload = lambda_workloads(card or gpu_named(gpu), eff, only=model)[model]
    predicted = simulate(workload, Job("single", batch)).samples_per_s
    return predicted / published["lambda_1gpu_throughput_fp16"]["samples_per_s"][gpu][model] - 1


def fit_framework_efficiency() -> float:
    """The `framework` share that makes the RTX 3090's one-GPU BERT-large throughput equal Lambda's (`FITTED`)."""
    return _bisect(lambda f: _lambda_one_gpu_error("BERT-large", "RTX 3090", efficiency(framework=f)), 0.3, 1.0)


def fit_conv_efficiency(gpu: str = "RTX 4090") -> float:
    """The convolution efficiency that makes `gpu`'s one-GPU ResNet-50 throughput equal Lambda's (`FITTED`): the
    shared `conv` on the RTX 4090's figure, the A100's own on the A100's."""
    card = gpu_named(gpu)
    return _bisect(lambda conv: _lambda_one_gpu_error("ResNet-50", gpu, card=replace(card, conv_efficiency=conv)),
                   0.05, 1.0)


def fitted_constants() -> dict[str, float]:
    """Every constant fitted on a published figure, refitted now (`FITTED` names the figures): what
    data/hardware.json stores, recomputed."""
    return {"framework": fit_framework_efficiency(), "conv": fit_conv_efficiency("RTX 4090"),
            "A100 conv": fit_conv_efficiency("A100 80GB SXM")}
