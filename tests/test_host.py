"""Host memory and device memory told apart on the CPU rig (helpers.runtime.host), as a GPU rig's NCCL tells them."""
import pytest

from helpers.runtime.launch import run
from helpers.runtime.rig import cpu_rig
from helpers.units import MiB
from tests.host_workers import host_refusals, pipeline_save_growth


def test_strict_ranks_refuse_collectives_of_host_memory_as_nccl_does():
    """In a device-strict rank a `.cpu()` result is a marked copy (the device tensor stays usable), and FSDP2's
    CPU-offloaded shards and gradients are host memory: gathering them in place is refused with NCCL's message, and
    gathering them through the device gives the whole tensors."""
    results = run(host_refusals, rig=cpu_rig(), oversubscribe=True)
    for result in results:
        assert result == {"device tensor": False, ".cpu() result": True, "the device tensor after .cpu()": False,
                          "offloaded shard": True, "offloaded gradient": True, "through the device, exact": True}


@pytest.mark.full
def test_pipeline_save_streams_one_tensor_at_a_time(tmp_path):
    """A pipeline's save at the end of a run (scripts/_stages.py `save_pipeline`) while the stage's weights are still
    allocated: the last stage's rank grows by at most the one tensor in flight (planned: its largest tensor; 32 MiB
    of allocator and pickling slack) where gathering whole stages as objects grew by about three stages' bytes."""
    from helpers.models.hf import hf_config, save_hf_model

    model_dir = tmp_path / "llama"
    save_hf_model(hf_config("llama", n_layers=6, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=2048,
                            seq_len=64), model_dir)
    ranks = run(pipeline_save_growth, str(model_dir), str(tmp_path / "saved"), rig=cpu_rig(), oversubscribe=True)
    last = ranks[1]
    assert last["stage"] > 8 * last["largest"], last  # a stage of many tensors: streaming is what keeps it small
    assert last["growth"] <= last["largest"] + 32 * MiB, {k: v / MiB for k, v in last.items()}
    assert (tmp_path / "saved" / "config.json").exists()


def test_host_built_layers_are_prepared_on_the_ranks_gpu_only():
    """QLoRA's quantization of a layer built on the host runs on the rank's GPU where it has one (inside
    `preparing_on`), on the host otherwise: the CPU rig keeps the host path, which every QLoRA test runs."""
    import torch

    from helpers.runtime.host import preparation_device, preparing_on

    assert preparation_device() is None
    with preparing_on(torch.device("cpu")):
        assert preparation_device() is None
    with preparing_on(torch.device("cuda", 1)):
        assert preparation_device() == torch.device("cuda", 1)
        with preparing_on(torch.device("cpu")):
            assert preparation_device() is None
    assert preparation_device() is None
