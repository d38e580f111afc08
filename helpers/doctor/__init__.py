"""`python -m helpers.doctor`: the first command on a new machine. Every engine and strategy this rig supports, run
once against one device, and the links the engines really use, measured.

It prints, and with `--json PATH` writes:
1. the rig and its topology: GPUs, driver, CUDA, NCCL, `nvidia-smi topo -m`, peer access between every pair, NVLink
   state, the environment variables that change NCCL's behaviour, and the rig's advice;
2. what NCCL needs of the machine: /dev/shm's size (Docker's 64 MB default breaks it), IOMMU and PCIe ACS (which
   make GPU-to-GPU traffic hang or slow), and on two GPUs a copy between them checked byte for byte;
3. the links: the multi-process engines' point-to-point and all-reduce (NCCL, or gloo), and on GPUs the threaded
   engine's GPU-to-GPU copies and host transfers, over a size sweep, fitted as latency + bytes / bandwidth (the
   all-reduce fitted again over hidden-state sizes alone: the small-message latency tensor parallelism pays);
   and each device's speed: the same timed forward + backward of a small model on each, the relative speeds and
   the split `optimal_split(costs, 2, speeds=...)` would give it (on the CPU rig the emulated pair, device 1 at
   slowdown 2.0: the check fails if the emulation does not show);
4. a one-step parity check of every strategy of the catalog (helpers.catalog) on every engine it lists (threads,
   processes, torch.distributed.pipelining), and of chosen features (16-bit precision, compressed gradients, a
   Hugging Face model, generation), against one device: PASS, FAIL, or REFUSED with the reason this rig cannot run
   it; the CUDA-only paths (CUDA-event timelines, copy and compute streams, the NVML panel);
5. the take-home scripts (QLoRA's included), two steps each under torchrun, and the bench's calibration in its
   ranks;
6. each notebook's GPU sizes against this rig's memory;
7. the long-run paths where host and GPU memory differ: FSDP2 with CPU offload to its end gather, a sync and an async
   DCP save and load, a script killed and restarted by torchrun, a `--save-to` export, a checkpoint written on the
   CPU loaded on the GPU, notebook 13's deterministic resume, and what each GPU holds beyond PyTorch's allocator once
   NCCL has run (its buffers, the CUDA context, the allocator's slack) against the planners' runtime reserve.
Every section is guarded: whatever fails is a FAIL row with its reason, and the table is printed anyway. WARN says
what to change without failing. Exit status 1 if anything FAILed. On the CPU rig it runs the same checks there (CI
runs it), its ranks device-strict (`helpers.runtime.strict`): a tensor that would be on the wrong device under NCCL
fails there too.

The package, by section: `checks` (the rows and the printed table), `system` (the rig, the machine under it, the
links), `speeds` (each device's speed and the split), `engines` (the parity checks, derived from the catalog),
`scripts` (the take-home scripts, the bench's calibration and launch, the notebooks' GPU sizes), `long_runs`
(section 7), `cli` (the command line and `--gpu-suite`).
"""
from helpers.doctor.cli import main, report
from helpers.doctor.engines import plan_checks, schedule_label
from helpers.doctor.checks import Check, guarded, print_report
from helpers.doctor.scripts import notebook_plan_checks
from helpers.doctor.system import links, shm_verdict

__all__ = ["Check", "guarded", "links", "main", "notebook_plan_checks", "plan_checks", "print_report", "report",
           "schedule_label", "shm_verdict"]
