"""Moved to `helpers.hardware`, which the simulator and the inference speed model share; importing from here still
works for one release and warns."""
import warnings

from helpers.hardware import (COLLECTIVES, COMPUTE_TASKS, FREE_LINK, Collectives, Link, SharedCores,  # noqa: F401
                              TargetRig, allgather_s, allreduce_link, allreduce_s, broadcast_s, collective_s,
                              fit_collective_link, fit_collectives, fit_link, gpu_named, link_named, reducescatter_s,
                              target_rig, target_rigs)

warnings.warn("helpers.simulate.hardware is now helpers.hardware", DeprecationWarning, stacklevel=2)
