"""Host memory told apart from the rank's device on the CPU rig, where the two are one.

On a GPU rig a rank has two memories joined by PCIe: the GPU's, which NCCL serves, and the host's (CPU offload's
parameters and gradients, pinned staging buffers, `.cpu()` results), which it does not: a collective of a host tensor
raises "No backend type associated with device type cpu". On the CPU rig both are the same RAM and `t.cpu()` returns
`t` itself, so the same call passes and the fault is first met by a 3090 owner at the end of a long run.

A device-strict rank (helpers.runtime.strict) therefore keeps a second view of its memory:
- what is host memory on purpose is *marked* by its storage: the parameters and gradients of a module FSDP2
  offloads (`mark_offloaded(module)`, called where the strategy offloads: the shards it holds then and the gradients
  FSDP2 writes later), any tensor given to `mark_host`, and every `.cpu()` result, which in a strict rank is a marked
  copy, as it is a copy on a GPU (so marking it never marks the device tensor it came from);
- a kernel on autograd's CPU key of every communication operator (c10d's and the functional collectives DTensor
  uses) refuses a marked tensor with NCCL's message (torch.inference_mode skips autograd's keys, and so the check).
Moving a host tensor to the device for a collective is `to_device(t, device)`: a copy, unmarked, on every rig, which
is what PyTorch's own full-state-dict gather does with offloaded shards. Outside strict ranks marking does nothing.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_leaves

_offloaded: weakref.WeakSet = weakref.WeakSet()  # modules whose parameters and gradients FSDP2 keeps on the host
_marked: dict[int, weakref.ref] = {}  # storage address -> the tensor marked on it; the mark lasts while it lives
_active: list = []  # the guard's libraries and the original Tensor.cpu, once this process keeps host apart


def collective_ops() -> list[tuple[str, str]]:
    """(namespace, operator) of every communication operator: c10d's, and the functional collectives DTensor uses."""
    names = torch._C._dispatch_get_all_op_names()
    ops = []
    for qualified in sorted(names):
        namespace, _, name = qualified.partition("::")
        if namespace in ("c10d", "_c10d_functional") and name not in ("check_for_nan", "wait_tensor"):
            ops.append((namespace, name.split(".")[0]))
    return sorted(set(ops))


def _refusing_host(op):
    """A kernel for communication operator `op` on CPU tensors, registered under autograd's CPU key (so it costs
    nothing to any other operator): refuse host memory as NCCL does, else run the operator below autograd as before."""
    def kernel(*args, **kwargs):
        for t in tree_leaves((args, kwargs)):
            if is_host(t):
                raise RuntimeError(
                    f"No backend type associated with device type cpu ({op}) of a host tensor: on a GPU rig this "
                    "tensor lives in host memory (CPU offload, a .cpu() result, a pinned buffer) and NCCL serves only "
                    "the GPU; copy it to the rank's device first (helpers.runtime.host.to_device)")
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)
    return kernel


def _guard_collectives() -> list:
    """Register `_refusing_host` for every communication operator; returns the libraries (they must stay alive)."""
    import torch.distributed  # noqa: F401 - registers the c10d operators
    import torch.distributed._functional_collectives  # noqa: F401 - and the functional ones

    libraries: dict[str, torch.library.Library] = {}
    for namespace, name in collective_ops():
        packet = getattr(getattr(torch.ops, namespace), name)
        lib = libraries.setdefault(namespace, torch.library.Library(namespace, "IMPL"))
        for overload in packet.overloads():
            qualified = name if overload == "default" else f"{name}.{overload}"
            lib.impl(qualified, _refusing_host(getattr(packet, overload)), "AutogradCPU")
    return list(libraries.values())


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of the memory `t` lives in (a wrapper subclass, like torchao's NF4 weight, has none of its own:
    its first inner tensor's), or None off the CPU."""
    if t.is_meta or t.device.type != "cpu":
        return None
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return _storage_key(getattr(t, names[0])) if names else None
    return t.untyped_storage().data_ptr()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what lives in the rank's memory), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _offloaded_keys() -> set[int]:
    """The storages of every offloaded module's parameters and gradients, as they are now (FSDP2 replaces a
    gradient's tensor each step)."""
    tensors = [t for m in list(_offloaded) for p in m.parameters() for t in (p, p.grad) if t is not None]
    return {_storage_key(_local(t)) for t in tensors}


def is_host(t) -> bool:
    """Whether `t` is host memory on purpose in this strict rank (see the module's docstring)."""
    if not isinstance(t, torch.Tensor) or not _active:
        return False
    key = _storage_key(_local(t))
    if not key:
        return False
    ref = _marked.get(key)
    owner = ref() if ref is not None else None
    return (owner is not None and _storage_key(_local(owner)) == key) or key in _offloaded_keys()


def mark_offloaded(module: torch.nn.Module) -> torch.nn.Module:
    """Mark what FSDP2's CPUOffloadPolicy keeps in host memory: `module`'s parameter shards and the gradients it will
    write (a no-op outside strict ranks); returns `module`."""
    if _active:
        _offloaded.add(module)
    return module


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Mark `t`'s storage as host memory (a no-op outside strict ranks, and for an empty tensor); returns `t`."""
    if _active and isinstance(t, torch.Tensor):
        key = _storage_key(_local(t))
        if key:
            # `t` itself (a DTensor's to_local() is a fresh view each time); its entry goes when `t` does
            _marked[key] = weakref.ref(t, lambda ref, key=key: _marked.pop(key) if _marked.get(key) is ref else None)
    return t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` copied to `device`: always a copy, unmarked, so that a collective may take it on every rig. A DTensor keeps
    its mesh and placements (its shard is copied), so `to_device(p, device).full_tensor()` gathers through the device
    as NCCL requires."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor import DTensor

        local = t.to_local().to(device, copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return t.to(device, copy=True)


def _marked_cpu(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    out = _active[1](self, *args, **kwargs)
    if _storage_key(_local(out)) == _storage_key(_local(self)):
        out = out.clone()  # on a GPU .cpu() is a copy in host memory: so it is here, and only the copy is marked
    return mark_host(out)


def keep_host_apart() -> None:
    """Guard every collective of this process and make `.cpu()` return marked copies (idempotent; for the rank's
    life: a strict rank never leaves strict mode)."""
    if _active:
        return
    _active.extend([_guard_collectives(), torch.Tensor.cpu])
    torch.Tensor.cpu = _marked_cpu


_PREPARING_ON: list[torch.device] = []  # innermost last: where host-built layers are prepared (`preparing_on`)


@contextmanager
def preparing_on(device: torch.device):
    """Inside, work done on a layer built on the host before it is sharded (QLoRA's NF4 quantization: about 4 M
    values a second per host thread, so hours per rank for a 70B base, seconds on a GPU) runs on `device` when it is
    a GPU, its result copied back to the host; on the CPU rig the host does it, as before."""
    _PREPARING_ON.append(device)
    try:
        yield
    finally:
        _PREPARING_ON.pop()


def preparation_device() -> torch.device | None:
    """The GPU host-built layers are prepared on (`preparing_on`), or None: prepare them where they are."""
    return _PREPARING_ON[-1] if _PREPARING_ON and _PREPARING_ON[-1].type == "cuda" else None
