"""Tensor-parallel generation with PyTorch's `parallelize_module`: every decoder layer's matrices split over two
devices, both devices working on every token.

The plan (the shape of PyTorch's tensor-parallel tutorial and of torchtitan's Llama, without sequence parallelism):
q, k, v and the MLP's gate and up projections are `ColwiseParallel` (each device computes half the heads and half
the MLP's hidden units from the full input), o and down are `RowwiseParallel` (each device multiplies its half and
the partial results are summed by an all-reduce). Two all-reduces per layer per step, whatever the batch: in decode
they carry a few KiB, so their latency, not their size, is what they cost. The head is `ColwiseParallel` with
replicated output (each device computes half the vocabulary's logits, then one all-gather); the embedding and the
norms are replicated. Each device's KV cache holds its own heads: half the cache.

Each rank builds the model on the meta device, shards it there, and reads from the checkpoint only its own half of
each sharded matrix (and the replicated rest) onto its device (`load_sharded`): no rank ever holds the whole model, so
a model that does not fit one card loads, the case tensor parallelism exists for. Hugging Face's own `generate` then
runs unchanged on every rank, in lock step (both ranks see the same logits, so they stop together).
Runs through `helpers.runtime.launch.run`: gloo on the CPU rig, NCCL on two GPUs; refused (before any process starts)
where it cannot run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from helpers.inference.generate import Generation, Request, Stopping, hf_generate, stopping_for
from helpers.inference.throughput import Throughput
from helpers.measure import median_time
from helpers.models.hf import HFModel
from helpers.timeline import Event, Recorder
from helpers.training.support import Support

ROTARY_FAMILIES = ("llama", "mistral", "qwen2", "gemma")  # q_proj/k_proj/v_proj/o_proj and gate/up/down_proj
ALLREDUCE_PROBES = 20


def layer_plan() -> dict:
    """The plan of one decoder layer: submodule name -> ParallelStyle."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def apply_tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    """Shard a Hugging Face Llama-family causal LM over a 1-D DeviceMesh in place (see the module's docstring)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan())
    if model.lm_head.weight is not model.get_input_embeddings().weight:  # a tied head stays whole with its embedding
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return model


def load_sharded(model: HFModel, mesh, device: torch.device) -> nn.Module:
    """`model` tensor-parallel over `mesh` (see the module's docstring), this rank's parameters on `device`: built and
    sharded on the meta device, then each parameter read from the checkpoint, a sharded one only its own chunk."""
    from torch.distributed.tensor import DTensor, Shard

    from helpers.models.hf import _as_dtype, read_tensors

    hf = model.skeleton()
    apply_tensor_parallel(hf, mesh)
    rank, world = mesh.get_local_rank(), mesh.size()
    params = dict(hf.named_parameters())  # a tied head is the embedding's parameter, listed once
    slices = {name: (p.placements[0].dim, rank, world) for name, p in params.items()
              if isinstance(p, DTensor) and isinstance(p.placements[0], Shard)}
    tensors = read_tensors(model.path, params, slices)
    for name, p in params.items():
        local = _as_dtype(tensors[name], model.weights_dtype).to(device)
        if isinstance(p, DTensor):
            local = DTensor.from_local(local, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        owner, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(owner), attr, nn.Parameter(local, requires_grad=False))
    for owner, module in hf.named_modules():
        for attr, buf in list(module.named_buffers(recurse=False)):
            setattr(module, attr, buf.to(device))
    if model.tied:
        hf.lm_head.weight = hf.get_input_embeddings().weight
    return hf.eval()


def check_shardable(config, world: int = 2) -> None:
    """Refuse what cannot be split evenly over `world` devices, in the model's own terms."""
    family = config.model_type
    if family not in ROTARY_FAMILIES:
        raise ValueError(f"tensor parallelism here knows the {', '.join(ROTARY_FAMILIES)} layout (separate q, k, v, o "
                         f"and gate, up, down projections); {family} is not one of them"
                         + (" (GPT-2 fuses q, k and v into one Conv1D, c_attn)" if family == "gpt2" else ""))
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for what, n in (("query heads", heads), ("key/value heads", kv), ("MLP hidden units", config.intermediate_size)):
        if n % world:
            raise ValueError(f"{n} {what} do not split evenly over {world} devices: tensor parallelism gives each "
                             f"device whole heads (grouped-query attention needs key/value heads divisible by the "
                             "number of devices too)")


def tensor_parallel_support(rig, world: int = 2) -> Support:
    """Whether this rig can run two-rank tensor parallelism, and if not, why (checked before any process starts)."""
    from helpers.training.support import GLOO_CUDA

    if rig.kind == "one_gpu":
        return Support(False, GLOO_CUDA.format(what="DTensor's collectives on one device",
                                               source="two processes would only take turns on one card") +
                       ": tensor parallelism gains a second card's memory bandwidth, and there is none here")
    if not rig.is_cpu and rig.max_ranks < world:
        return Support(False, f"{world} ranks need {world} GPUs, this rig has {rig.max_ranks}")
    if rig.is_cpu and rig.max_ranks < world:
        return Support(True, f"{world} ranks share {rig.max_ranks} virtual device's cores (oversubscribe=True): "
                             "exact tokens, timings mean little")
    return Support(True)


# --- the ranks ------------------------------------------------------------------------------------------------------

def _record_allreduces(model: nn.Module, recorder: Recorder) -> int:
    """Record every row-parallel layer's all-reduce as an "allreduce" span: a hook placed before
    parallelize_module's output hook opens it (the local matmul is done), one placed after waits for the sum (the
    output hook only starts it: DTensor hands back an AsyncCollectiveTensor, waited for at its first use) and closes
    it. Returns how many all-reduces one forward makes."""
    marks: dict[int, object] = {}

    def opened(module, args, output):
        marks[id(module)] = recorder.start()

    def closed(module, args, output):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        if isinstance(output, AsyncCollectiveTensor):  # the sum is still on its way: the residual add would wait
            output = output.wait()                      # for it; wait here, so the span holds the whole all-reduce
        recorder.finish(marks.pop(id(module)), "allreduce")
        return output

    n = 0
    for layer in model.model.layers:
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            module.register_forward_hook(opened, prepend=True)
            module.register_forward_hook(closed)
            n += 1
    return n


def _allreduce_probe(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> float:
    """Median seconds of one all-reduce of a tensor of `shape` (the message a row-parallel layer sends)."""
    import torch.distributed as dist

    buf = torch.zeros(shape, dtype=dtype, device=device)
    return median_time(lambda: dist.all_reduce(buf), ALLREDUCE_PROBES, device, warmup=3, before=dist.barrier)


def _linear_probe(module: nn.Module, x: torch.Tensor) -> dict:
    """Median seconds of one call of a column-parallel linear through parallelize_module's hooks (input wrapped as
    a DTensor, DTensor dispatch, output unwrapped) and of the same local matmul on plain tensors: the difference is
    what DTensor adds to every sharded linear, with no communication involved."""
    import torch.nn.functional as F

    weight = module.weight.to_local()
    bias = module.bias.to_local() if module.bias is not None else None
    with torch.no_grad():
        return {name: median_time(fn, 4 * ALLREDUCE_PROBES, x.device, warmup=5)
                for name, fn in (("dtensor", lambda: module(x)), ("plain", lambda: F.linear(x, weight, bias)))}


def tensor_parallel_rank(path: str, attn: str, dtype: torch.dtype | None, requests: Sequence[Request],
                         rule: Stopping, repeats: int, warmup: int) -> dict:
    """Rank worker (runs in each spawned process): load, shard, generate `warmup + repeats` times (the last
    `repeats` timed), then probe the all-reduce at decode's and prefill's message sizes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.runtime.launch import rank_device

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    model = HFModel(path, attn, dtype)
    check_shardable(model.config, world)
    mesh = init_device_mesh(device.type, (world,))
    hf = load_sharded(model, mesh, device)
    recorder = Recorder(rank, device)
    per_forward = _record_allreduces(hf, recorder)
    runs = []
    for i in range(warmup + repeats):
        recorder.clear()
        dist.barrier()
        g = hf_generate(hf, requests, rule, device, "tensor parallel", rank)
        if i >= warmup:
            runs.append(g)
    last = runs[-1]
    spans = recorder.events()
    prefill_windows = [(e.start, e.end) for e in last.events if e.kind == "prefill"]
    in_prefill = [any(a <= s.start < b for a, b in prefill_windows) for s in spans]
    hidden, rows = model.config.hidden_size, max(r.rows for r in requests)
    longest = max(r.ids.shape[1] for r in requests)
    probe_dtype = model.weights_dtype
    linear = _linear_probe(hf.model.layers[0].mlp.gate_proj, torch.zeros(rows, 1, hidden, dtype=probe_dtype,
                                                                          device=device))
    return {"rank": rank, "runs": [(g.prefill_s, g.decode_s) for g in runs], "tokens": last.tokens,
            "events": last.events + spans, "prompt_tokens": last.prompt_tokens, "decode_tokens": last.decode_tokens,
            "allreduce_s": {"prefill": sum(s.duration for s, p in zip(spans, in_prefill) if p),
                            "decode": sum(s.duration for s, p in zip(spans, in_prefill) if not p)},
            "allreduces": {"prefill": sum(in_prefill), "decode": len(spans) - sum(in_prefill)},
            "per_forward": per_forward,
            "probe": {"decode": {"bytes": rows * hidden * probe_dtype.itemsize,
                                 "s": _allreduce_probe((rows, 1, hidden), probe_dtype, device)},
                      "prefill": {"bytes": rows * longest * hidden * probe_dtype.itemsize,
                                  "s": _allreduce_probe((rows, longest, hidden), probe_dtype, device)},
                      "sharded_linear": linear,
                      "sharded_linears_per_forward": 7 * len(hf.model.layers) + 1}}


# --- the caller's side -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorParallelRun:
    """What the ranks measured: medians (`throughput`), the last run's tokens and both devices' timeline (`last`),
    the all-reduces (how many per forward, their summed time per phase on rank 0, and a probe of one all-reduce at
    each phase's message size)."""

    throughput: Throughput
    per_forward: int
    allreduce_s: dict
    allreduces: dict
    probe: dict
    ranks_agree: bool = field(default=True)

    @property
    def last(self) -> Generation:
        return self.throughput.last

    @property
    def tokens(self) -> list[torch.Tensor]:
        return self.last.tokens

    def allreduce_share(self, phase: str) -> float:
        """Fraction of rank 0's time in `phase` spent inside all-reduces (waiting for the peer included)."""
        total = self.throughput.prefill_s if phase == "prefill" else self.throughput.decode_s
        return self.allreduce_s[phase] / total if total > 0 else float("nan")

    @property
    def decode_forwards(self) -> int:
        """Decode steps (forwards) of the last run, summed over requests."""
        return self.allreduces["decode"] // max(self.per_forward, 1)

    def decode_step_parts(self) -> dict:
        """Rank 0's median decode step, in milliseconds, and what the measurements attribute to fixed costs: the
        all-reduces as they ran inside generate (waiting for the slower rank included), one all-reduce alone with
        both ranks ready (the probe), and DTensor's host work on the sharded linears (probe: through DTensor minus
        the same local matmul)."""
        steps = max(self.decode_forwards, 1)
        lin = self.probe["sharded_linear"]
        n_lin = self.probe["sharded_linears_per_forward"]
        return {"step_ms": self.throughput.decode_s / steps * 1e3,
                "allreduce_ms": self.allreduce_s["decode"] / steps * 1e3,
                "allreduce_mean_us": self.allreduce_s["decode"] / max(self.allreduces["decode"], 1) * 1e6,
                "allreduce_alone_us": self.probe["decode"]["s"] * 1e6,
                "dtensor_ms": max(lin["dtensor"] - lin["plain"], 0.0) * n_lin * 1e3,
                "dtensor_us_per_linear": (lin["dtensor"] - lin["plain"]) * 1e6, "linears": n_lin}

    def describe(self) -> str:
        d = self.decode_step_parts()
        return (f"a decode step took {d['step_ms']:.1f} ms on rank 0; its {self.per_forward} all-reduces (2 per "
                f"layer) {d['allreduce_ms']:.1f} ms of it ({self.allreduce_share('decode'):.0%}), "
                f"{d['allreduce_mean_us']:.0f} us each on average against {d['allreduce_alone_us']:.0f} us for one "
                f"all-reduce of {self.probe['decode']['bytes']:,} B with both ranks ready (the rest is waiting for the "
                f"slower rank); DTensor adds {d['dtensor_us_per_linear']:.0f} us of host work to each of its "
                f"{d['linears']} sharded linears, about {d['dtensor_ms']:.1f} ms per step; plus one all-gather of the "
                f"logits. In prefill the all-reduces took {self.allreduce_share('prefill'):.0%} of the time")


def run_tensor_parallel(model: HFModel, requests: Sequence[Request], new_tokens: int, rig, repeats: int = 3,
                        warmup: int = 1, stopping: Stopping | None = None, timeout: float = 300.0,
                        world: int = 2) -> TensorParallelRun:
    """Generate the requests with tensor parallelism over the rig's devices (one rank each), `warmup + repeats`
    times in the ranks; medians of the timed runs. Refused before any process starts where the rig cannot run it."""
    from helpers.runtime.launch import run

    support = tensor_parallel_support(rig, world)
    support.require("tensor parallelism")
    check_shardable(model.config, world)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    rule = stopping or stopping_for(model, new_tokens)
    results = run(tensor_parallel_rank, model.path, model.attn_implementation, model.dtype, list(requests), rule,
                  repeats, warmup, nranks=world, rig=rig, timeout=timeout, oversubscribe=bool(support.reason))
    r0 = results[0]
    agree = all(len(r["tokens"]) == len(r0["tokens"]) and all(torch.equal(a, b) for a, b in
                                                              zip(r["tokens"], r0["tokens"])) for r in results)
    events: list[Event] = [e for r in results for e in r["events"]]
    runs = [Generation("tensor parallel", r0["tokens"], p, d, r0["prompt_tokens"], r0["decode_tokens"], events)
            for p, d in r0["runs"]]
    return TensorParallelRun(Throughput.of("tensor parallel", runs), r0["per_forward"], r0["allreduce_s"],
                             r0["allreduces"], r0["probe"], agree)
