"""The simulator's LoRA, QLoRA and offloading mechanics (helpers.simulate.finetune, Job.cpu_offload,
Job.activation_offload): each cost appears where the engines pay it, on small made-up workloads whose arithmetic
is checked by hand, and on one real model's traced block."""
import pytest

from helpers.hardware import target_rig
from helpers.simulate.finetune import HOST_ADAMW_ACCESSES, finetune_workload, rig_host
from helpers.simulate.guide import transformer_workload
from helpers.simulate.job import Host, Job
from helpers.simulate.strategies import simulate
from helpers.simulate.workload import LayerCost, Workload
from helpers.sizing.shape import model_shape
from helpers.sizing.training import training_shape

GB = 1e9


def frozen_workload(frozen: float, trainable: int = 1000, layers: int = 4) -> Workload:
    """`layers` layers of 1 s forward and 1 s backward per sample, each with `frozen` frozen bytes and `trainable`
    adapter parameters; activations 1 GB a sample, output 0.5 GB."""
    return Workload(tuple(LayerCost(f"l{i}", 1.0, 1.0, trainable, 1 * GB, 0.5 * GB, frozen_bytes=frozen)
                          for i in range(layers)), optimizer_bytes=10 * GB)


def test_offloading_needs_the_rigs_host_and_cpu_offload_is_fsdp2s():
    with pytest.raises(ValueError, match="needs the rig's host"):
        simulate(frozen_workload(GB), Job("fsdp2", 2, dp=2, cpu_offload=True))
    with pytest.raises(ValueError, match="CPUOffloadPolicy"):
        Job("ddp", 2, dp=2, cpu_offload=True)


def test_cpu_offload_copies_each_shard_in_before_every_gather_and_steps_on_the_host():
    """A PCIe link of 1 GB/s and 8 GB frozen per layer: each gather first copies the 4 GB shard in (4 s) on the
    device's host-to-device stream, 8 copies a step (forward and backward of 4 layers) back to back against 1 s of
    compute per layer and pass: the copies set the pace (32 s), then the first layer's backward after its copy (1 s),
    its gradients' copy out (8 kB) and the host's step, 10 GB at 5 GB/s."""
    host = Host(pcie=1 * GB, memory=5 * GB)
    job = Job("fsdp2", 2, dp=2, cpu_offload=True)
    sim = simulate(frozen_workload(8 * GB), job, host=host)
    assert sim.step_s == pytest.approx(8 * 4 + 1 + 10 / 5, rel=1e-5)
    on_gpu = simulate(frozen_workload(8 * GB), Job("fsdp2", 2, dp=2))
    assert on_gpu.step_s == pytest.approx(4 * 2, rel=1e-6)  # the gathers over a free link: compute alone


def test_activation_offload_copies_what_each_layer_saves_out_and_back_on_the_compute_stream():
    """Checkpointed: each layer keeps its input (the previous layer's 0.5 GB output; the first layer nothing) and
    moves it to the host and back at 1 GB/s, in line with the compute: 3 layers x 2 x 0.5 s on top of 4 x (1 + 1 + 1)
    s (forward, recompute, backward); the GPU holds one layer's input and recomputed activations at a time."""
    job = Job("fsdp2", 1, dp=1, activation_checkpointing=True, activation_offload=True)
    sim = simulate(frozen_workload(0.0), job, host=Host(pcie=1 * GB, memory=GB))
    assert sim.step_s == pytest.approx(4 * 3 + 3 * 2 * 0.5, rel=1e-6)
    plain = simulate(frozen_workload(0.0), Job("fsdp2", 1, dp=1, activation_checkpointing=True))
    assert sim.memory[0].activations == 1.5 * GB < plain.memory[0].activations == 2.5 * GB


@pytest.fixture(scope="module")
def llama_1b():
    gpu = target_rig("2x3090 PCIe").gpu
    full = transformer_workload(model_shape("llama-3.2-1b", "bf16"), 2048, gpu, batch=1)
    lora = finetune_workload(training_shape("llama-3.2-1b", "lora"), 2048, gpu, batch=1)
    qlora = finetune_workload(training_shape("llama-3.2-1b", "qlora", "nf4-dq"), 2048, gpu, batch=1)
    return full, lora, qlora


def test_lora_backward_skips_the_frozen_weights_gradients_and_qlora_dequantizes(llama_1b):
    """A frozen block's backward computes input gradients only: less than the full block's (its matmuls halve;
    attention's backward and the element-wise kernels stay, and the adapters add theirs); its forward adds the
    adapters; QLoRA's block adds one dequantization per linear per
    pass, forward and backward; frozen bytes are the planner's (bf16 base, packed codes); only adapters train."""
    full, lora, qlora = llama_1b
    block_full, block_lora, block_qlora = full.layers[1], lora.layers[1], qlora.layers[1]
    assert 0.5 < block_lora.backward_s / block_full.backward_s < 0.85
    assert 1.0 < block_lora.forward_s / block_full.forward_s < 1.2
    assert block_qlora.forward_s > block_lora.forward_s and block_qlora.backward_s > block_lora.backward_s
    units = [u for u in training_shape("llama-3.2-1b", "qlora", "nf4-dq").units if u.kind == "decoder"]
    assert block_qlora.frozen_bytes == units[0].packed_bytes < block_lora.frozen_bytes / 3
    assert block_lora.params == units[0].trainable_params and lora.layers[0].params == 0  # the embedding is frozen
    assert lora.optimizer_bytes == HOST_ADAMW_ACCESSES * 4 * lora.n_params


def test_fsdp2_gathers_frozen_bytes_and_reduce_scatters_adapter_gradients_only(llama_1b):
    """Over the 3090 pair's link, LoRA's step is its compute and the gathers of its frozen bf16 weights: faster
    than the full fine-tune (no weight gradients, nothing of the base reduce-scattered); QLoRA's gathers carry a
    quarter of the bytes. CPU offload adds the host's copies and step, never speeds a step up."""
    full, lora, qlora = llama_1b
    rig, host = target_rig("2x3090 PCIe"), rig_host()
    job = Job("fsdp2", 2, activation_checkpointing=True, dp=2)
    step = {name: simulate(w, job, rig.link, rig.collectives).step_s
            for name, w in (("full", full), ("lora", lora), ("qlora", qlora))}
    assert step["lora"] < step["full"]
    offloaded = Job("fsdp2", 2, activation_checkpointing=True, dp=2, cpu_offload=True)
    for w in (lora, qlora):
        assert simulate(w, offloaded, rig.link, rig.collectives, host=host).step_s >= \
            simulate(w, job, rig.link, rig.collectives).step_s
    gathered = {name: sum(layer.frozen_bytes + 2 * layer.params for layer in w.layers)
                for name, w in (("lora", lora), ("qlora", qlora))}
    assert gathered["qlora"] < gathered["lora"] / 2
