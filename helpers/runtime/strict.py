"""Device-strict ranks: a CPU rank fails where the same code would fail on a GPU rank.

Under NCCL a process group has a backend for the `cuda` device type only, and a tensor created without `device=`
lives on the host: a collective or a send of it raises "No backend type associated with device type cpu", and an
operation mixing it with the rank's tensors raises "Expected all tensors to be on the same device". On the CPU rig
the rank's device *is* the host, so the same mistake passes silently and is first seen by a 3090 owner. In
device-strict mode a CPU rank is set up the way a GPU rank is:

1. its process group gets a backend for the rank's device type only (`"cpu:gloo"`, as NCCL's is for `cuda`);
2. a tensor created without `device=` lands on the `meta` device (`torch.set_default_device`), which is not the
   rank's device, as the host is not a GPU; deliberate host data says `device="cpu"`, as it must on GPUs;
3. a collective or point-to-point operation on such a tensor raises NCCL's error with its device type: the meta
   kernels of the `c10d` operators (which otherwise return without communicating, for tracing) refuse;
4. host memory made on purpose (CPU offload's shards and gradients, `.cpu()` results) is told apart from the rank's
   device and refused by every collective, as NCCL refuses it (helpers.runtime.host).

CI and the test suite run every rank in this mode (`LAB_DEVICE_STRICT=1`, set by the tests' conftest and inherited by
the ranks): the engines', the bench's, the take-home scripts' and those that notebook kernels start (but for the
notebooks conftest.NOT_STRICT names, each with its reason); `python -m helpers.doctor` on the CPU rig too. The
kernels themselves never are, nor a notebook or the bench run by hand: the default-device mode costs a little Python
work on every torch call, which the bench would time.
"""
from __future__ import annotations

import os
import warnings

import torch

from helpers.runtime.host import collective_ops, keep_host_apart

STRICT_ENV = "LAB_DEVICE_STRICT"
STAND_IN = torch.device("meta")  # where a tensor created without device= lands in a strict rank
_refusing: list = []  # the torch.library registrations, kept alive (dropping them would restore the meta kernels)


TRUTHY = {"1", "true", "yes", "on", "y", "t"}


def strict_requested() -> bool:
    """Whether this process was asked to run its ranks device-strict (LAB_DEVICE_STRICT=1, or true, yes, on, any
    case): the one parser of the flag, which the take-home scripts share."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in TRUTHY


def strict_backend(device: torch.device, backend: str) -> str:
    """The process-group backend string for `backend` serving `device`'s type only, as NCCL serves `cuda` only:
    'cpu:gloo' for a CPU rank (plain 'gloo' would register itself for cpu and cuda)."""
    return f"{device.type}:{backend}"


def _no_backend(*args, **kwargs):
    raise RuntimeError(f"No backend type associated with device type {STAND_IN.type} (device-strict rank: this "
                       "tensor was created without device=, so on a GPU it would be on the CPU, where NCCL has no "
                       "backend; create it on the rank's device)")


def refuse_stand_in_collectives() -> None:
    """Make every communication operator raise on a `meta` tensor, as NCCL raises on a host tensor. Idempotent."""
    if _refusing:
        return
    import torch.distributed  # noqa: F401 - registers the c10d operators
    import torch.distributed._functional_collectives  # noqa: F401 - and the functional ones

    libraries: dict[str, torch.library.Library] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        for namespace, name in collective_ops():
            lib = libraries.setdefault(namespace, torch.library.Library(namespace, "IMPL"))
            lib.impl(name, _no_backend, "Meta")
    _refusing.extend(libraries.values())


def enter_device_strict_mode() -> None:
    """Steps 2 to 4 above, for the calling thread (torch's default device is per thread: a rank's other threads
    create their tensors with device= anyway). Call before the rank builds anything."""
    refuse_stand_in_collectives()
    keep_host_apart()
    torch.set_default_device(STAND_IN)


def plain_backend(group=None) -> str:
    """The library carrying `group`'s tensors ('gloo', 'nccl'), whether the group was created for every device type
    ('gloo') or for one ('cpu:gloo', as device-strict ranks create it)."""
    import torch.distributed as dist

    return str(dist.get_backend(group)).split(",")[0].split(":")[-1]
