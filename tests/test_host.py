"""Host memory and device memory told apart on the CPU rig (helpers.runtime.host), as a GPU rig's NCCL tells them."""
from helpers.runtime.launch import run
from helpers.runtime.rig import cpu_rig
from tests.host_workers import host_refusals


def test_strict_ranks_refuse_collectives_of_host_memory_as_nccl_does():
    """In a device-strict rank a `.cpu()` result is a marked copy (the device tensor stays usable), and FSDP2's
    CPU-offloaded shards and gradients are host memory: gathering them in place is refused with NCCL's message, and
    gathering them through the device gives the whole tensors."""
    results = run(host_refusals, rig=cpu_rig(), oversubscribe=True)
    for result in results:
        assert result == {"device tensor": False, ".cpu() result": True, "the device tensor after .cpu()": False,
                          "offloaded shard": True, "offloaded gradient": True, "through the device, exact": True}
