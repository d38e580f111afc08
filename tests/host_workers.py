"""Rank workers for the host-versus-device tests (tests/test_host.py): each returns what NCCL would have refused."""
import torch
import torch.distributed as dist


def _refused(call) -> bool:
    try:
        call()
    except RuntimeError as e:
        if "No backend type associated with device type cpu" in str(e):
            return True
        raise
    return False


def host_refusals() -> dict[str, bool]:
    """Which collectives a device-strict rank refuses: a `.cpu()` result, an FSDP2 CPU-offloaded shard and its
    gradient gathered in place; and whether the same gathers through the device (`to_device`) give the whole tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from helpers.runtime.host import mark_offloaded, to_device

    device = torch.device("cpu")
    on_device = torch.ones(4, device=device)
    host_copy = on_device.cpu()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, device=device), torch.nn.Linear(4, 4, device=device))
    whole = [p.detach().clone() for p in model.parameters()]
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                offload_policy=CPUOffloadPolicy(pin_memory=False))
    mark_offloaded(model)
    model(torch.ones(2, 4, device=device)).sum().backward()
    weight = next(model.parameters())
    gathered = [to_device(p, device).full_tensor() for p in model.parameters()]
    return {
        "device tensor": _refused(lambda: dist.all_reduce(on_device)),
        ".cpu() result": _refused(lambda: dist.all_reduce(host_copy)),
        "the device tensor after .cpu()": _refused(lambda: dist.all_reduce(on_device)),
        "offloaded shard": _refused(weight.full_tensor),
        "offloaded gradient": _refused(weight.grad.full_tensor),
        "through the device, exact": all(torch.equal(g, w) for g, w in zip(gathered, whole)),
    }


def pipeline_save_growth(model_dir: str, directory: str) -> dict[str, int]:
    """This rank's stage of a two-stage pipeline of the saved model, then the pipeline saved as the take-home scripts
    save it (scripts/_stages.py `save_pipeline`): the rank's memory growth during the save (VmHWM after resetting it,
    less VmRSS before), its stage's bytes and its largest tensor's."""
    import gc
    import sys
    from pathlib import Path

    from helpers.models.hf import HFModel
    from tests.stream_workers import SCRIPTS, _status_bytes

    sys.path.insert(0, str(SCRIPTS))
    from _stages import build_stage, save_pipeline

    model = HFModel(model_dir)
    stage = build_stage(model, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    tensors = [t for layer in stage[0].layers for t in layer.state_dict().values()]
    sizes = [t.numel() * t.element_size() for t in tensors]
    for t in tensors:  # read once: pages a load mapped from the file count from here on, not as the save's growth
        t.sum()
    gc.collect()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    save_pipeline(model, [stage], directory)
    return {"growth": _status_bytes("VmHWM") - before, "stage": sum(sizes), "largest": max(sizes)}


def async_saves_staging_and_groups(folder: str) -> dict:
    """Three async saves of one checkpointer: whether every save staged into the same host copy (the stager's
    storages, the first save's kept), and how many process groups the rank holds after the checkpointer closed,
    beside before it was made."""
    from torch.distributed.distributed_c10d import _world

    from helpers.training.checkpoint import Checkpointer, CheckpointSpec

    groups = len(_world.pg_map)
    model = torch.nn.Linear(8, 8, device="cpu")
    ckpt = Checkpointer(CheckpointSpec(folder, every=1, async_save=True), model,
                        [torch.optim.Adam(model.parameters())])
    staged = []
    for step in (1, 2, 3):
        model(torch.ones(2, 8, device="cpu")).sum().backward()
        ckpt.save(step)
        ckpt.wait()
        cache = ckpt._stager._state_dict_stager._cached_storage_mapping
        staged.append(sorted(id(v) for v in cache.values()))
    ckpt.close()
    return {"same staging copy": staged[0] == staged[1] == staged[2] and bool(staged[0]),
            "groups left": len(_world.pg_map) - groups}
