"""The simulator's other-hardware predictions next to published results (data/published.json, with sources).

Each check rebuilds the published setup as a workload on the nearest rig in data/hardware.json, simulates it, and
reports predicted, published and the relative error. Where the published hardware is not one of ours, the row says
which rig stands in for it: the error then includes that difference, and is reported, not hidden.
"""
from __future__ import annotations

from helpers.course import load_data
from helpers.simulate.guide import transformer_workload
from helpers.sizing.shape import decoder_shape
from helpers.simulate.hardware import GPU, target_rig
from helpers.simulate.roofline import ADAM_BYTES_PER_PARAM, VALUE_BYTES, roofline_s
from helpers.simulate.strategies import Job, simulate
from helpers.simulate.workload import LayerCost, Workload

BERT = {"BERT-base": ("gpt2", 12, 768, 12, 30522, 3072), "BERT-large": ("gpt2", 24, 1024, 16, 30522, 4096)}
BERT_OUTPUTS = 2  # SQuAD's span logits: the task head instead of the language-model head
BERT_SEQ = 384  # SQuAD fine-tuning's usual max_seq_length (NVIDIA DeepLearningExamples' default); an assumption
RESNET50_STAGES = (("layer1", 3, 64, 1), ("layer2", 4, 128, 2), ("layer3", 6, 256, 2), ("layer4", 3, 512, 2))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int, hw: int) -> tuple[float, float, int, int]:
    """Convolution + batch norm (+ ReLU) on a hw x hw input, per image: (FLOPs, values saved for backward: the conv
    input, the BN input and the ReLU output, parameters, output size)."""
    out = hw // stride
    return (2 * kernel * kernel * cin * cout * out * out, cin * hw * hw + 2 * cout * out * out,
            kernel * kernel * cin * cout + 2 * cout, out)


def resnet50_workload(image: int, gpu: GPU, dtype: str, recipe: str, classes: int = 1000) -> Workload:
    """torchvision's ResNet-50 (v1.5: the stride in the 3x3 conv) as six layers (stem, layer1-4, pool + fc) from its
    convolution shapes, each timed by the roofline on `gpu`."""
    v = VALUE_BYTES[dtype]
    flops, saved, params, hw = _conv_bn(3, 64, 7, 2, image)
    groups = [("stem", flops, saved + 64 * hw * hw, params, 64 * (hw // 2) ** 2)]  # + the max-pool's input
    hw, cin = hw // 2, 64
    for name, blocks, width, stride in RESNET50_STAGES:
        flops = saved = params = 0
        for i in range(blocks):
            step = stride if i == 0 else 1
            out = hw // step
            convs = [(cin, width, 1, 1, hw), (width, width, 3, step, hw), (width, 4 * width, 1, 1, out)]
            if i == 0:
                convs.append((cin, 4 * width, 1, step, hw))  # the downsampling shortcut
            for c_in, c_out, kernel, s, size in convs:
                f, a, p, _ = _conv_bn(c_in, c_out, kernel, s, size)
                flops, saved, params = flops + f, saved + a, params + p
            hw, cin = out, 4 * width
        groups.append((name, flops, saved, params, cin * hw * hw))
    groups.append(("pool + fc", 2 * cin * classes, cin * hw * hw + cin, cin * classes + classes, classes))
    layers = []
    for name, f, saved_values, p, out_values in groups:
        written = (saved_values + out_values) * v
        layers.append(LayerCost(name, roofline_s(f, written, gpu, dtype), roofline_s(2 * f, 2 * written, gpu, dtype),
                                p, saved_values * v, out_values * v))
    n_params = sum(layer.params for layer in layers)
    return Workload(tuple(layers), recipe, ADAM_BYTES_PER_PARAM * n_params / gpu.memory_bandwidth)


def _row(check: str, simulated_on: str, predicted: float, published: float, source: str) -> dict:
    return {"check": check, "rig simulated": simulated_on, "predicted": predicted, "published": published,
            "error": predicted / published - 1, "source": source}


def tutorial_rows(rig: str = "2x3090 PCIe") -> list[dict]:
    """PyTorch's model-parallel tutorial (ResNet-50 split after layer2): naive split and pipelines vs one GPU.
    The tutorial does not say which GPUs it ran on."""
    published = load_data("published")
    times, setup = published["pytorch_model_parallel_tutorial"], published["pytorch_model_parallel_tutorial_setup"]
    rig = target_rig(rig)
    workload = resnet50_workload(setup["image"], rig.gpu, setup["dtype"], "fp32 + SGD")
    batch, cut, single = setup["batch"], (3,), times["seconds"]["single_gpu"]
    one = simulate(workload, Job("single", batch))
    rows = [_row("PyTorch tutorial: naive split vs one GPU (x)", rig.name,
                 one.step_s / simulate(workload, Job("naive", batch, cut=cut), rig.link).step_s,
                 single / times["seconds"]["naive_model_parallel"], times["source"])]
    for key, split in setup["split_sizes"].items():
        pipe = simulate(workload, Job("gpipe", batch, microbatches=batch // split, cut=cut), rig.link)
        rows.append(_row(f"PyTorch tutorial: pipelined, split size {split}, vs one GPU (x)", rig.name,
                         one.step_s / pipe.step_s, single / times["seconds"][key], times["source"]))
    return rows


def lambda_rows() -> list[dict]:
    """Lambda's fp16 training benchmark for ResNet-50, BERT-base and BERT-large: one GPU's throughput (the roofline's
    absolute calibration) and the 1 -> 2 GPU data-parallel speed-up, on 2x3090, 2x4090 and 2xA100 (GNMT, an LSTM,
    is not modelled)."""
    published = load_data("published")
    batches = published["lambda_batch_per_gpu_fp16"]["batch"]
    single = published["lambda_1gpu_throughput_fp16"]
    rows = []
    for rig_name, key in (("2x3090 PCIe", "lambda_2x3090_data_parallel"), ("2x4090", "lambda_2x4090_data_parallel"),
                          ("2xA100", "lambda_2xa100_sxm4_data_parallel")):
        rig, entry = target_rig(rig_name), published[key]
        workloads = {"ResNet-50": resnet50_workload(224, rig.gpu, "fp16", "fp32 + SGD momentum")}
        workloads.update({name: transformer_workload(decoder_shape(*sizes), BERT_SEQ, rig.gpu, "fp16", "eager",
                                                     "fp32 + Adam", head_outputs=BERT_OUTPUTS)
                          for name, sizes in BERT.items()})
        for model, workload in workloads.items():
            batch = batches[rig.gpu.name][model]
            one = simulate(workload, Job("single", batch))
            rows.append(_row(f"Lambda one-GPU throughput, {model} (samples/s)", rig.gpu.name, one.samples_per_s,
                             single["samples_per_s"][rig.gpu.name][model], single["source"]))
            two = simulate(workload, Job("ddp", rig.devices * batch, replicas=rig.devices), rig.link)
            rows.append(_row(f"Lambda DDP speed-up, {model} (x)", rig.name, two.samples_per_s / one.samples_per_s,
                             entry["speedup"][model], entry["source"]))
    return rows


def nvlink_rows() -> list[dict]:
    """Hugging Face's DDP training of GPT-2 (fp32) with and without NVLink, 2x TITAN RTX: the time ratio, predicted
    on 2x3090 PCIe vs 2x3090 NVLink (no TITAN RTX figures here)."""
    published = load_data("published")
    times, setup = published["hf_nvlink_ddp"], published["hf_nvlink_ddp_setup"]
    pcie, nvlink = target_rig("2x3090 PCIe"), target_rig("2x3090 NVLink")
    workload = transformer_workload(decoder_shape("gpt2", 12, 768, 12, 50257, 3072), setup["seq"], pcie.gpu,
                                    setup["dtype"], "eager", "fp32 + Adam")
    job = Job("ddp", 2 * setup["per_device_batch"])
    ratio = simulate(workload, job, pcie.link).step_s / simulate(workload, job, nvlink.link).step_s
    return [_row("HF GPT-2 DDP: no-P2P time / NVLink time (x)", f"{pcie.name} vs {nvlink.name} (for 2x TITAN RTX)",
                 ratio, times["seconds"]["nccl_p2p_disable"] / times["seconds"]["nvlink"], times["source"])]


def predictions_vs_published() -> list[dict]:
    """Every check: what was predicted, what was published, the relative error, and the source."""
    return tutorial_rows() + lambda_rows() + nvlink_rows()
