"""Simulate a training step before running it: the engines' schedules over a cost model of layers and links.

- `simulate(workload, job, link)`: one optimizer step of any strategy of `helpers.catalog` (one device, the
  pipelines, DDP, ZeRO-1, ZeRO-2, FSDP2, DP x PP) as a discrete-event simulation: step time, per-device busy
  fraction, peak memory, and a timeline in the format measured timelines use (`helpers.timeline.plot_timeline`
  draws both).
- `Workload.from_profile(profile)` / `Workload.from_lists(...)`: per-layer costs; `transformer_workload(shape, seq,
  gpu)` (a `helpers.sizing.shape.ModelShape`): the same costs on a GPU you do not have, each layer's kernels traced
  on the meta device and timed by a per-kernel roofline (`trace_kernels`, `kernels_s`, `efficiency()`);
  `on_gpu(workload, flops, gpu)` from totals.
- `finetune_workload(training_shape(...), seq, gpu)`: LoRA and QLoRA (frozen base, adapters, QLoRA's
  dequantizations); `Job(cpu_offload=..., activation_offload=...)` with `simulate(..., host=rig_host())`: offloading.
- `target_rig(name)`, `fit_link(sizes, seconds)`, `fit_collective_link(sizes, seconds)`: hardware from
  data/hardware.json or your own link benchmark; `SharedCores`: devices sharing a pool of cores (the CPU rig).
- `recommend_model(name)`, `decision_table()`: which strategy for two GPUs, every strategy treated alike.
- `Playground().show()`: the pipeline playground widget.
- `predictions_vs_published()`: predictions beside published results, with the error; `gpu_orders(rows)`: the
  GPUs fastest first per model, predicted and published; `fitted_constants()`: the constants fitted on them.
- `predict_speed(model, dtype, rig, batch, context)`, `speed_rig(name)`, `crossovers(...)`: inference, prefill and
  decode tokens/s of the layer split, pipelined requests and tensor parallelism (`helpers.inference.speed`).
"""
from types import ModuleType as _ModuleType

from helpers.inference.speed import SpeedPrediction, breakeven_latency, crossovers, predict_speed
from helpers.inference.speed_rigs import SpeedRig, speed_rig, speed_rigs
from helpers.simulate.events import TaskGraph
from helpers.simulate.finetune import finetune_workload, rig_host
from helpers.simulate.guide import (MODELS, Recommendation, block_tflops, decision_table, recommend, recommend_model,
                                    transformer_workload)
from helpers.hardware import (FREE_LINK, Collectives, Efficiency, Link, SharedCores, TargetRig, allgather_s,
                              allreduce_s, broadcast_s, collective_s, efficiency, fit_collective_link, fit_collectives,
                              fit_link, gpu_named, link_named, reducescatter_s, target_rig, target_rigs)
from helpers.simulate.playground import Knobs, Playground
from helpers.simulate.published import (bert_workload, fitted_constants, gpu_orders,
                                        predictions_vs_published, resnet50_workload)
from helpers.simulate.roofline import Kernel, kernels_s, layer_flops, on_gpu, roofline_s, trace_kernels
from helpers.simulate.job import Host, Job
from helpers.simulate.strategies import Simulation, simulate, simulate_memory
from helpers.simulate.workload import LayerCost, Workload

# every name imported above (the inference speed model's, a floor below, too): the list is the imports
__all__ = sorted(name for name, value in globals().items()
                 if not name.startswith("_") and not isinstance(value, _ModuleType))
