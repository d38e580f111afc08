"""Rank workers for the FSDP2 sharding tests of LoRA / QLoRA bases (the launcher starts them from tests)."""
import torch
import torch.distributed as dist


def nf4_storage_over_share(model, offload: bool) -> float:
    """Shard `model` (a LoraModel) with FSDP2 over the two ranks as the training loop does, then return the largest
    ratio, over this rank's NF4 shards, of the host memory their tensors keep alive to the bytes of the shard:
    1 when each rank holds only its share, about 2 (the world) when a shard is a view of the whole weight."""
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.models.layered import Stage
    from helpers.training.strategies import apply_fsdp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    module = apply_fsdp(Stage(model.meta_layers()), model, 0, mesh, torch.device("cpu"), True, offload=offload)
    worst = 0.0
    for p in module.parameters():
        local = p.to_local()
        if not hasattr(local, "__tensor_flatten__"):
            continue
        names, _ = local.__tensor_flatten__()
        inner = [getattr(local, n) for n in names]
        kept = sum(t.untyped_storage().nbytes() for t in inner)
        used = sum(t.numel() * t.element_size() for t in inner)
        worst = max(worst, kept / used)
    return worst
