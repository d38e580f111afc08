"""What each notebook keeps on each GPU at its heaviest moments, read off its code cells.

One function per notebook turns the constants of its parameters cell into phases (helpers.gpu_sizes.plans): the
models a section keeps alive (with their gradients and optimizer state, which persist between steps) plus the step
it runs at that moment, or the ranks it spawns beside what the notebook process still holds. The notebook process
gives its cached memory back before ranks start (`helpers.runtime.launch.run` empties PyTorch's cache), so a rank
phase counts the notebook's live tensors only. Models that only exist on the CPU rig (a glibc probe) or on four GPUs
(the 2 x 2 mesh) are left out.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from helpers.gpu_sizes.footprint import Footprint, HFSpec, ModelSpec, held, n_layers, stage_bytes, training_step
from helpers.gpu_sizes.plans import NOTEBOOK, Inventory, Part, Phase
from helpers.models.stack import StackConfig, nonuniform_config
from helpers.pipeline.schedules import make_schedule, peak_in_flight
from helpers.runtime.rig import Rig

Constants = Mapping[str, object]
MiB = 2**20


def _stack(c: Constants) -> StackConfig:
    return StackConfig(hidden=c["HIDDEN"], n_blocks=c["BLOCKS"], seq_len=c["SEQ"])


def _cut(spec: ModelSpec) -> int:
    """Where the notebooks cut in two: `len(model) // 2`; the training jobs' equal-count split agrees for an even
    number of layers and puts the extra layer first otherwise."""
    return (n_layers(spec) + 1) // 2


def _stages(spec: ModelSpec) -> tuple[range, range]:
    n, cut = n_layers(spec), _cut(spec)
    return range(0, cut), range(cut, n)


def keep(what: str, spec: ModelSpec, grads: bool = True, optimizer: str | None = None, device: int = 0,
         layers: Sequence[int] | None = None, process: str = NOTEBOOK) -> Part:
    """A model (or its `layers`) alive on `device` between steps."""
    return Part(what, device, held(stage_bytes(spec, 1, layers).params, grads, optimizer), process)


def keep_split(what: str, spec: ModelSpec, grads: bool = True, optimizer: str | None = None) -> list[Part]:
    """A two-stage copy of the model alive between steps: stage s on device s."""
    return [keep(f"{what}, stage {s}", spec, grads, optimizer, s, layers) for s, layers in enumerate(_stages(spec))]


def step(what: str, spec: ModelSpec, batch: int, optimizer: str = "sgd", device: int = 0,
         layers: Sequence[int] | None = None, in_flight: int = 1, keeps_outputs: bool = False, autocast: bool = False,
         process: str = NOTEBOOK, state_shards: int = 1) -> Part:
    """A model training one step (its weights, grads and state included) at micro-batch `batch`."""
    stage = stage_bytes(spec, batch, layers, autocast=autocast)
    return Part(what, device, training_step(stage, optimizer, in_flight, keeps_outputs, autocast, state_shards),
                process)


def pipeline(what: str, spec: ModelSpec, batch: int, m: int, schedule: str = "gpipe", optimizer: str = "sgd",
             ranks: bool = False, autocast: bool = False, torch_engine: bool = False) -> list[Part]:
    """A two-stage pipeline step over global batch `batch` in `m` micro-batches: each stage holds the activations of
    the micro-batches its schedule keeps in flight (GPipe: all m; 1F1B: at most p on the first stage), the first
    stage also their outputs. `ranks`: one process per stage (else threads of the notebook). torch.distributed.
    pipelining also allocates a receive buffer per micro-batch for activations and for gradients."""
    schedule_lists, stages = make_schedule(schedule, 2, m), _stages(spec)
    boundary = stage_bytes(spec, batch // m, stages[0]).output
    parts = []
    for s, layers in enumerate(stages):
        stage = stage_bytes(spec, batch // m, layers, autocast=autocast)
        fp = training_step(stage, optimizer, peak_in_flight(schedule_lists[s]), keeps_outputs=s == 0,
                           autocast=autocast)
        if torch_engine:
            fp = fp + Footprint(workspace=2 * m * boundary)
        parts.append(Part(f"{what}, stage {s}", s, fp, f"rank {s}" if ranks else NOTEBOOK))
    return parts


def data_parallel(what: str, spec: ModelSpec, batch: int, strategy: str, optimizer: str = "adam",
                  world: int = 2, autocast: bool = False) -> list[Part]:
    """One rank per device, each with a replica (DDP, ZeRO-1) or a shard (FSDP2) and batch / world sequences (in one
    step: accumulation steps hold less). DDP copies gradients into its buckets (as many bytes again); ZeRO-1 keeps
    1/N of the optimizer state; FSDP2 keeps 1/N of weights, grads and state, gathers whole layers around the one
    computing (two gathered: the current and the prefetched; ZeRO-2-like `reshard_after_forward=False` keeps every
    gathered layer from forward to backward) and reduce-scatters each layer's whole gradient (two in flight)."""
    stage = stage_bytes(spec, batch // world, autocast=autocast)
    parts = []
    for r in range(world):
        if strategy in ("ddp", "zero1"):
            fp = training_step(stage, optimizer, autocast=autocast, state_shards=world if strategy == "zero1" else 1)
            fp = fp + Footprint(grads=stage.params)  # the buckets
        else:
            whole, layer = training_step(stage, optimizer, autocast=autocast), stage.largest_layer_params
            gathered = stage.params if strategy == "zero2" else 2 * layer
            fp = Footprint(whole.weights // world + gathered, whole.grads // world + 2 * layer,
                           whole.optimizer // world, whole.activations, whole.workspace)
        parts.append(Part(f"{what}, rank {r}", r, fp, f"rank {r}"))
    return parts


def small_ranks(what: str, nbytes: int, world: int = 2) -> list[Part]:
    """Ranks that compute on small tensors (link benchmarks, demo spans): their contexts matter, not their bytes."""
    return [Part(f"{what}, rank {r}", r, Footprint(workspace=nbytes), f"rank {r}") for r in range(world)]


# --- the notebooks ---------------------------------------------------------------------------------------------------

def nb00(c: Constants, rig: Rig) -> list[Phase]:
    spec, b = _stack(c), c["BATCH"]
    model, fresh = keep("model + Adam", spec, optimizer="adam"), keep("fresh", spec)
    return [
        Phase("section 2: the model's Adam step", (step("model, Adam step", spec, b, "adam"),)),
        Phase("section 2: the ledger's Adam step", (model, step("fresh, Adam step", spec, b, "adam"))),
        Phase("section 2: activations at the batch", (model, fresh, step("a third copy, SGD step", spec, b))),
        Phase("section 3: the split trained with Adam",
              (model, fresh, *pipeline("split, naive step", spec, b, 1, optimizer="adam"))),
        Phase("section 4: two ranks' spans", (model, fresh, *keep_split("split", spec, optimizer="adam"),
                                              *small_ranks("timed_spans", 3 * MiB))),
    ]


def nb01(c: Constants, rig: Rig) -> list[Phase]:
    spec, b = _stack(c), c["BATCH"]
    reference, hand = keep("reference", spec), keep_split("hand split", spec)
    split, fresh, single = keep_split("split", spec), keep("fresh", spec), keep("single", spec)
    return [
        Phase("sections 2-3: one device's step", (step("reference, step", spec, b), *hand)),
        Phase("sections 2-3: the hand split's step", (reference, *pipeline("hand split, step", spec, b, 1))),
        Phase("section 4: the reference gradients", (reference, *hand, *split, step("fresh, step", spec, b))),
        Phase("section 5: one device with Adam", (reference, *hand, *split, fresh,
                                                  step("single, Adam step", spec, b, "adam"))),
        Phase("section 5: the split with Adam", (reference, *hand, fresh, single,
                                                 *pipeline("split, Adam step", spec, b, 1, optimizer="adam"))),
    ]


def nb02(c: Constants, rig: Rig) -> list[Phase]:
    """The splits come from this run's profile, so each pipeline copy is planned as if either device could hold
    every layer (its cut unknown in advance): an upper bound."""
    spec, b, m = nonuniform_config(c["SCALE"]), c["BATCH"], c["MICROBATCHES"]
    copies = 5  # up to four distinct splits and the control
    whole = stage_bytes(spec, b)
    runs = [Part(f"pipeline copy {k}, stage {s}", s, held(whole.params, True)) for k in range(copies) for s in (0, 1)]
    active = [Part(f"pipeline step, stage {s}", s, Footprint(activations=whole.activations + whole.output,
                                                             workspace=stage_bytes(spec, b // m).backward_workspace))
              for s in (0, 1)]
    model = keep("model", spec)
    return [
        Phase("section 4: one device, the whole batch", (step("model, step", spec, b), *runs)),
        Phase("section 4: a pipeline step", (model, *runs, *active)),
    ]


def _checkpointed_batch(c: Constants, spec: StackConfig) -> int:
    """Section 5's `big`: the largest batch of the fully checkpointed GPipe run within BUDGET per device, computed
    as the notebook computes it (`batch_budget`: state and activations per sample of the fullest device)."""
    b, m, blocks = c["BATCH"], c["MICROBATCHES"], range(1, c["BLOCKS"] + 1)
    stages = [stage_bytes(spec, b, layers, checkpointed=blocks) for layers in _stages(spec)]
    state = max(2 * s.params for s in stages)
    per_sample = max(s.activations for s in stages) / b
    largest = int((c["BUDGET"] - state) // per_sample) if c["BUDGET"] > state else 0
    return largest // m * m


def nb03(c: Constants, rig: Rig) -> list[Phase]:
    spec, b, m = _stack(c), c["BATCH"], c["MICROBATCHES"]
    blocks = range(1, c["BLOCKS"] + 1)
    plain, wrapped, model = keep("plain", spec), keep("wrapped", spec), keep("model", spec)
    runs = [p for k in range(5) for p in keep_split(f"pipeline copy {k}", spec)]
    live = keep_split("live", spec, optimizer="momentum")
    big = _checkpointed_batch(c, spec)
    check = []
    for s, layers in enumerate(_stages(spec)):
        stage = stage_bytes(spec, big // m, layers, checkpointed=blocks)
        check.append(Part(f"check run at batch {big}, stage {s}", s,
                          training_step(stage, in_flight=m, keeps_outputs=s == 0)))
    return [
        Phase("section 1: one device, plain", (step("plain, step", spec, b), wrapped)),
        Phase("section 2: the plain pipeline", (plain, wrapped, model, *runs, *pipeline("pipeline step", spec, b, m))),
        Phase("section 3: the live run, checkpointing off",
              (plain, wrapped, model, *runs, *pipeline("live step", spec, b, m, optimizer="momentum"))),
        Phase("section 4: the reference's gradients", (plain, wrapped, *runs, *live, step("model, step", spec, b))),
        Phase("section 5: the check at the largest batch", (plain, wrapped, model, *runs, *live, *check)),
    ]


def nb04(c: Constants, rig: Rig) -> list[Phase]:
    spec, b, m = _stack(c), c["BATCH"], c["MICROBATCHES"]
    model = keep("model", spec, grads=False)
    runs = [p for name in ("fp32", "bf16", "fp16") for p in keep_split(f"{name} wire copy", spec)]
    amp = keep_split("bf16 autocast split", spec)
    copy_bytes = c["COPY_BYTES"] + 2 * c["COPY_BYTES"] + 2048 * 2048 * 4  # source, its copy, one in flight, the matrix
    return [
        Phase("section 4: a pipeline with fp32 transfers", (model, *runs[2:], *pipeline("fp32 wire", spec, b, m))),
        Phase("section 5: one device, fp32", (model, *runs, step("one device, fp32", spec, b))),
        Phase("section 5: the bf16 pipeline", (model, *runs, *pipeline("bf16 pipeline", spec, b, m, autocast=True))),
        Phase("section 5: processes", (model, *runs, *amp, *pipeline("ranks", spec, b, m, "gpipe", "none", True))),
        Phase("section 6: a copy beside compute", (model, *runs, *amp, Part("copies", 0, Footprint(
            workspace=copy_bytes)))),
        Phase("check yourself: the reference", (step("model, step", spec, b), *runs, *amp,
                                                *keep_split("exact copy", spec))),
    ]


def nb05(c: Constants, rig: Rig) -> list[Phase]:
    spec, b, m = _stack(c), c["BATCH"], c["M"]
    model, alone = keep("model", spec), keep("alone", spec)
    runs = [p for k in c["SWEEP"] for p in keep_split(f"m={k} copy", spec)]
    phases = [
        Phase("section 3: one device, the reference", (keep("model", spec, grads=False), step("alone, step", spec, b))),
        Phase("section 3: the reference's gradients", (alone, step("model, step", spec, b))),
        Phase("section 4: one device in the sweep", (alone, step("model, step", spec, b), *runs)),
        *[Phase(f"section 4: GPipe m={k}", (model, alone, *runs, *pipeline(f"m={k} step", spec, b, k)))
          for k in c["SWEEP"]],
        Phase("section 6: our engine's ranks", (model, alone, *runs, *pipeline("ours", spec, b, m, "gpipe", "none",
                                                                               True))),
    ]
    if c["TORCH_PIPELINING"].ok:
        torch_ranks = pipeline("ScheduleGPipe", spec, b, m, "gpipe", "sgd", True, torch_engine=True)
        phases += [Phase("section 3: your ScheduleGPipe ranks", (model, alone, *torch_ranks)),
                   Phase("section 6: torch's ranks", (model, alone, *runs, *pipeline(
                       "torch", spec, b, m, "gpipe", "none", True, torch_engine=True)))]
    return phases


def nb06(c: Constants, rig: Rig) -> list[Phase]:
    spec, b, m = _stack(c), c["BATCH"], c["M"]
    model, alone = keep("model", spec), keep("alone", spec)
    runs = [p for k in c["SWEEP"] for s in ("gpipe", "1f1b") for p in keep_split(f"{s} m={k} copy", spec)]
    live = keep_split("live", spec, optimizer="adam")
    phases = [
        Phase("section 2: the reference", (step("model, step", spec, b),)),
        Phase("section 2: one device's SGD steps", (model, step("alone, step", spec, b))),
        *[Phase(f"section 3: {s} m={k}", (model, alone, *runs, *pipeline(f"{s} m={k}", spec, b, k, s)))
          for k in c["SWEEP"] for s in ("gpipe", "1f1b")],
        *[Phase(f"section 4: the live {s}", (model, alone, *runs, *pipeline(f"live {s}", spec, b, m, s, "adam")))
          for s in ("gpipe", "1f1b")],
        Phase("section 6: our engine's ranks", (model, alone, *runs, *live,
                                                *pipeline("ours", spec, b, m, "1f1b", "none", True))),
    ]
    if c["TORCH_PIPELINING"].ok:
        phases += [Phase("section 2: your Schedule1F1B ranks", (model, alone, *pipeline(
                       "Schedule1F1B", spec, b, m, "1f1b", "sgd", True, torch_engine=True))),
                   Phase("section 6: torch's ranks", (model, alone, *runs, *live, *pipeline(
                       "torch", spec, b, m, "1f1b", "none", True, torch_engine=True)))]
    return phases


def nb07(c: Constants, rig: Rig) -> list[Phase]:
    spec, b = _stack(c), c["BATCH"]
    strategies = c["STRATEGIES"]
    model = keep("model", spec, grads=False)
    alone = keep("alone + Adam", spec, optimizer="adam")
    pipe = keep_split("1f1b pipeline + Adam", spec, optimizer="adam")
    model_adam = keep("model + Adam", spec, optimizer="adam")
    # your script's variants: each strategy (FSDP2 with bf16 weights gathers half as much), and DDP with 16-bit
    # gradient buckets (one 4 MiB bucket's copy more than DDP)
    phases = [Phase(f"section 2: your {s} ranks", (model, *data_parallel(s, spec, b, s))) for s in strategies]
    phases += [
        Phase("section 2: one device, the reference", (model, step("alone, Adam step", spec, b, "adam"))),
        Phase("section 2: the reference's gradients", (alone, step("model, step", spec, b))),
        *[Phase(f"section 3: the engine's {s} ranks", (keep("model", spec), alone, *data_parallel(s, spec, b, s)))
          for s in strategies],
        Phase("section 3: one device beside the pipeline", (alone, *pipe, step("model, Adam step", spec, b, "adam"))),
        Phase("section 3: the 1F1B pipeline", (alone, model_adam, *pipeline("1f1b pipeline", spec, b, 4, "1f1b",
                                                                            "adam"))),
        Phase("section 5: buckets and accumulation", (alone, model_adam, *pipe,
                                                      *data_parallel("ddp", spec, b, "ddp"))),
    ]
    return phases


def nb08(c: Constants, rig: Rig) -> list[Phase]:
    spec, b, m = _stack(c), c["BATCH"], c["M"]
    model = keep("model", spec)
    phases = [Phase("section 1: the reference", (step("model, step", spec, b),)),
              Phase("section 1: one device's SGD steps", (model, step("alone, step", spec, b)))]
    if c["TORCH_PIPELINING"].ok:
        alone = keep("alone", spec)
        per_replica = [step(f"replica {r}", spec, b // 2 // m, "sgd", r, process=f"rank {r}") for r in (0, 1)]
        phases += [
            Phase("section 1: mesh 1 x 2", (model, alone, *pipeline("1 x 2", spec, b, m, "1f1b", "sgd", True,
                                                                     torch_engine=True))),
            Phase("section 1: mesh 2 x 1", (model, alone, *per_replica)),
            # torchrun is started with subprocess, not `run`: the notebook's allocator still caches its largest step
            Phase("section 4: your torchrun script", (step("cached since the reference's step", spec, b),
                                                      *small_ranks("train_dp_x_pp.py", 64 * MiB))),
        ]
    return phases


def _nb09_config(c: Constants):
    from transformers import LlamaConfig

    h = c["HIDDEN"]
    return LlamaConfig(vocab_size=c["VOCAB"], hidden_size=h, intermediate_size=11 * h // 4,
                       num_hidden_layers=c["LAYERS"], num_attention_heads=h // 64, num_key_value_heads=h // 256,
                       max_position_embeddings=1024, bos_token_id=None, eos_token_id=None)


def nb09(c: Constants, rig: Rig) -> list[Phase]:
    """Generation only: weights, KV cache and workspace per device from the course's inference planner (the
    placement the notebook itself asks it for), for each copy of the model the notebook holds: the device_map
    model and the stage loop's layers (sections 4-5), then the stage loop's layers, the one-device model and the
    layer split the engines share (section 6; the device_map model is deleted first), and the two
    tensor-parallel ranks beside them on two GPUs."""
    from helpers.inference.generate import rig_gpus
    from helpers.sizing.shape import model_shape
    from helpers.inference.plan import plan_shape

    shape = model_shape(_nb09_config(c), "fp32")
    context, batch = max(c["PROMPT_LENGTHS"]) + c["NEW_TOKENS"], c["REQUESTS"]
    placement = plan_shape(shape, rig_gpus(rig), context, batch, logits="last")

    def copy(what: str) -> list[Part]:
        return [Part(f"{what}, device {d.device}", d.device, Footprint(weights=d.weights_bytes,
                                                                      activations=d.kv_cache_bytes,
                                                                      workspace=d.workspace_bytes))
                for d in placement.devices]

    one_device = sum(d.weights_bytes for d in placement.devices)
    largest = max(placement.devices, key=lambda d: d.workspace_bytes + d.kv_cache_bytes)
    one = Part("one device", 0, Footprint(weights=one_device, activations=sum(d.kv_cache_bytes for d in
                                                                              placement.devices),
                                          workspace=largest.workspace_bytes))
    phases = [Phase("sections 4-5: device_map generate and the stage loop", (*copy("device_map model"),
                                                                            *copy("stage loop"))),
              Phase("section 6: the engines", (*copy("stage loop"), one, *copy("layer split")))]
    if rig.kind == "two_gpus":
        embedding = shape.hidden * shape.vocab * 4  # whole on both ranks
        tp = [Part(f"tensor parallel, rank {r}", r, Footprint(weights=one_device // 2 + embedding,
                                                              activations=largest.kv_cache_bytes,
                                                              workspace=largest.workspace_bytes), f"rank {r}")
              for r in (0, 1)]
        phases.append(Phase("section 6: tensor parallel ranks", (*copy("stage loop"), one, *copy("layer split"),
                                                                 *tp)))
    return phases


def nb10(c: Constants, rig: Rig) -> list[Phase]:
    """The strategy run in section 4 is the simulator's choice for the target model, or RUN_HERE: planned as the
    heaviest of the four it can be."""
    spec, b, m = _stack(c), c["BATCH"], c["MICRO"]
    mb = b // m
    model = keep("model", spec)
    choices = {"ddp": data_parallel("ddp", spec, b, "ddp"), "zero1": data_parallel("zero1", spec, b, "zero1"),
               "fsdp2": data_parallel("fsdp2", spec, b, "fsdp2"),
               "1f1b": pipeline("1f1b", spec, b, m, "1f1b", "adam", True)}
    return [
        Phase("section 1: the profile", (step("model, micro-batch", spec, mb),)),
        *[Phase(f"section 4: {name} ranks", (model, *parts)) for name, parts in choices.items()],
        Phase("section 4: calibration ranks", (model, *[step("model copy", spec, b // 2, "sgd", r,
                                                             process=f"rank {r}") for r in (0, 1)])),
        Phase("section 4: the run's profile and Adam step", (step("model, Adam step", spec, b // 2, "adam"),)),
    ]


def _nb11_spec(c: Constants, family: str) -> HFSpec:
    gpt2 = family == "gpt2"
    return HFSpec(family, c["LAYERS"], c["HIDDEN"], 4, c["VOCAB"], c["SEQ"], tie_embeddings=gpt2,
                  kv_heads=None if gpt2 else 2)


def nb11(c: Constants, rig: Rig) -> list[Phase]:
    """bf16 autocast everywhere; AdamW like Adam. The DDP script runs on two ranks, then on one with the whole
    batch; `train` runs 1F1B on two ranks, then the naive split in this process's threads."""
    llama, gpt2, b = _nb11_spec(c, "llama"), _nb11_spec(c, "gpt2"), c["BATCH"]
    return [
        Phase("section 3: DDP on two ranks", tuple(data_parallel("your DDP", llama, b, "ddp", autocast=True))),
        Phase("section 3: the script on one rank", tuple(data_parallel("your DDP, one rank", llama, b, "ddp", world=1,
                                                                       autocast=True))),
        Phase("section 4: 1F1B ranks", tuple(pipeline("1f1b", gpt2, b, 4, "1f1b", "adam", True, autocast=True))),
        Phase("section 4: the naive split in threads", tuple(pipeline("naive", gpt2, b, 1, "gpipe", "adam",
                                                                      autocast=True))),
    ]


def nb12(c: Constants, rig: Rig) -> list[Phase]:
    """Three FSDP2 runs on two ranks, one after the other, each planned by the training-memory planner
    (helpers.finetune.memory_plan, through helpers.finetune.compare) for the notebook's small Llama: full fine-tuning,
    LoRA and QLoRA. The notebook process measures held-out loss and samples on the host: nothing of it on a GPU. On
    the one-GPU rig the notebook runs on the CPU rig instead (FSDP2 needs two GPUs there): nothing on the GPU."""
    if rig.kind != "two_gpus":
        return [Phase("the runs use the CPU rig (FSDP2 needs two GPUs)", ())]
    from helpers.finetune.compare import run_format
    from helpers.finetune.lora import small_llama_config
    from helpers.finetune.memory_plan import plan_training

    config = small_llama_config(c["VOCAB"], c["POSITIONS"], c["LAYERS"], c["HIDDEN"])
    phases = []
    for method in ("full", "lora", "qlora"):
        lora = {} if method == "full" else {"lora_rank": c["RANK"], "lora_targets": "all"}
        plan = plan_training(config, method, context=c["SEQ"], batch=c["BATCH"] // 2, strategy="fsdp2",
                             checkpointing=True, precision="pure" if method == "full" else "mixed",
                             dtype=run_format(method, c["BASE_DTYPE"]), **lora)
        ranks = tuple(Part(f"{method}, rank {d.device}", d.device, Footprint(
            weights=d.frozen_bytes + d.trainable_bytes, grads=d.gradient_bytes, optimizer=d.optimizer_bytes,
            activations=d.activation_bytes, workspace=max(d.workspace_bytes, d.step_bytes - d.activation_bytes)),
            f"rank {d.device}") for d in plan.devices)
        phases.append(Phase(f"section 3: {method} fine-tuning ranks", ranks))
    return phases


INVENTORIES = {
    "00": Inventory(nb00, ("BATCH", "SEQ")),
    "01": Inventory(nb01, ("BATCH", "SEQ")),
    "02": Inventory(nb02, ("BATCH", "SCALE")),
    "03": Inventory(nb03, ("BATCH", "SEQ", "BUDGET")),
    "04": Inventory(nb04, ("BATCH", "SEQ")),
    "05": Inventory(nb05, ("BATCH", "SEQ")),
    "06": Inventory(nb06, ("BATCH", "SEQ")),
    "07": Inventory(nb07, ("BATCH", "SEQ")),
    "08": Inventory(nb08, ("BATCH", "SEQ")),
    "09": Inventory(nb09, ("LAYERS", "HIDDEN")),
    "10": Inventory(nb10, ("BATCH", "SEQ")),
    "11": Inventory(nb11, ("BATCH", "SEQ")),
    "12": Inventory(nb12, ("BATCH", "SEQ")),
}
