"""Rank workers of the streamed-load tests (tests/test_streamed_load.py): each rank loads a saved model as one
training path does and returns its host RAM around the load, read from /proc/self/status."""
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {key}")


def _measured(load) -> tuple[dict, object]:
    """Run `load()` after resetting the process's peak RSS (`clear_refs` 5): `overhead` is VmRSS just before (what
    a rank that loads nothing holds: interpreter, libraries, process group, meta model), `peak` the VmHWM of the
    load itself, that overhead included. Every library the load uses is imported before."""
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from helpers.finetune.quant import _nf4

    _nf4()
    gc.collect()
    overhead = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    loaded = load()
    return {"overhead": overhead, "peak": _status_bytes("VmHWM")}, loaded


def _shard_bytes(model: torch.nn.Module) -> int:
    """The host bytes this rank's parameter shards hold (every inner tensor of an NF4 shard counted)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        inner = [getattr(local, n) for n in local.__tensor_flatten__()[0]] if hasattr(local, "__tensor_flatten__") \
            else [local]
        total += sum(t.untyped_storage().nbytes() for t in inner)
    return total


def helpers_load(model) -> dict:
    """train()'s and finetune()'s load: `apply_fsdp` on the meta-built layers, as the training loop calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.models.layered import Stage
    from helpers.training.strategies import apply_fsdp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    meta = Stage(model.meta_layers())
    figures, module = _measured(lambda: apply_fsdp(meta, model, 0, mesh, torch.device("cpu"), True))
    return dict(figures, shards=_shard_bytes(module),
                trainable=[n for n, p in module.named_parameters() if p.requires_grad])


def script_load(model_dir: str, *flags: str) -> dict:
    """scripts/finetune_lora.py's load (`load_model`), with the devices of every parameter `fully_shard` is given
    recorded (meta only: FSDP2 then has no host tensor to move, and a frozen NF4 weight cannot become trainable)."""
    sys.path.insert(0, str(SCRIPTS))
    import _common
    import finetune_lora

    sys.argv = ["finetune_lora.py", "--model", model_dir, *flags]
    ns = _common.parse("finetune_lora.py", lora=True)
    seen: set[str] = set()
    shard = finetune_lora.fully_shard

    def recording(module, **options):
        seen.update(p.device.type for p in module.parameters())
        return shard(module, **options)

    finetune_lora.fully_shard = recording
    figures, (model, _) = _measured(lambda: finetune_lora.load_model(ns, dist.get_rank(), dist.get_world_size(),
                                                                     torch.device("cpu")))
    return dict(figures, shards=_shard_bytes(model), devices_at_fully_shard=sorted(seen),
                trainable=[n for n, p in model.named_parameters() if p.requires_grad])
