"""LoRA and QLoRA on a frozen base, as a `LayeredModel`: the one training loop shards it with FSDP2 like any model.

LoRA (Hu et al. 2021) freezes the base and trains, beside each adapted nn.Linear W, two small matrices:
y = W x + (alpha / r) * B A x, A: r x in, B: out x r. QLoRA (Dettmers et al. 2023) stores the frozen W in 4-bit NF4
(helpers.finetune.quant). The adapters are peft's own LoRA layers (`inject_adapter_in_model`), trained in fp32 (peft
casts the input to the adapter's dtype and the result back) over a base kept in fp32, bf16 or NF4.

`LoraModel(HFModel(dir), LoraSpec(...))` builds every layer on the meta device with its adapters; a rank
materialises only the layers it owns: the base's tensors read from the `save_pretrained` checkpoint, quantized on
the host (the same bytes on every rig), adapters initialised from a per-layer seed. So one device and two FSDP2 ranks
hold exactly the same numbers, and `TrainJob(LoraModel(...), "fsdp2", activation_checkpointing=True,
offload="cpu")` runs through the one training loop: only the adapters get gradients and optimizer state; the loop
returns the adapters' trained values (`TrainResult.state`), which `save_adapters` writes with peft's
`save_pretrained`, `merged_model` merges with peft's `merge_and_unload`, and `finetune` (one method) and
`finetune_each` (several, in one launch) train with `helpers.training.api.train_each` for notebook 12, returning its
`Trained` with the held-out loss and samples before and after.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from helpers.finetune.quant import dequantize, nf4_layout, nf4_missing, quantize_linear
from helpers.models.hf import HFModel
from helpers.models.layered import layer_seed, owned_layers, seeded
from helpers.dtypes import DTYPES
from helpers.runtime.launch import release_host_memory
from helpers.training.api import Trained
from helpers.training.job import renamed

METHODS = ("lora", "qlora")
BASE_DTYPES = ("fp32", "bf16")
INITS = ("peft", "random")
ALL_LINEAR = "all-linear"
ADAPTER_DTYPE = torch.float32  # adapters, their gradients and Adam's moments: fp32 whatever the base


@dataclass(frozen=True)
class LoraSpec:
    """What to train and how the frozen base is stored.

    `method`: lora (base in `base_dtype`) or qlora (every nn.Linear of the decoder blocks in NF4, dequantized to
    `base_dtype` to compute; embeddings, norms and the head stay in `base_dtype`, as bitsandbytes' QLoRA leaves them).
    `targets`: names of the blocks' nn.Linear modules to adapt ("q_proj", ...), or "all-linear" (every one: the
    QLoRA paper's choice). `init`: "peft" (A Kaiming-uniform, B zero: the adapted model starts equal to the base)
    or "random" (B drawn too, so every adapter gradient is non-zero from the first step: what parity tests use).
    """

    method: str = "lora"
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] | str = ALL_LINEAR
    dropout: float = 0.0
    base_dtype: str = "fp32"
    init: str = "peft"
    seed: int = 0

    def __post_init__(self):
        """Refuse a spec that cannot run, in its own terms."""
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {METHODS}")
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a whole number >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"the frozen base is kept in one of {BASE_DTYPES}, not {self.base_dtype!r}")
        if self.init not in INITS:
            raise ValueError(f"unknown adapter init {self.init!r}; choose one of {INITS}")
        if self.method == "qlora" and nf4_missing():
            raise ValueError(nf4_missing())


def block_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The nn.Linear modules of a decoder block by qualified name (none in the embedding, norm or head layers:
    the head is an nn.Linear itself, and QLoRA leaves it alone)."""
    if not hasattr(layer, "block"):
        return {}
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class LoraModel:
    """A Hugging Face causal LM saved with `save_pretrained` (`base`), frozen, with LoRA adapters (`spec`), as a
    `LayeredModel` the engines cut and shard. Small and picklable: the launcher sends it to every rank."""

    base: HFModel
    spec: LoraSpec = LoraSpec()
    own_dtypes = True  # the loop keeps the base's dtype and the fp32 adapters as they are (no job-wide cast)

    def __post_init__(self):
        if self.base.dtype != DTYPES[self.spec.base_dtype]:
            object.__setattr__(self, "base", replace(self.base, dtype=DTYPES[self.spec.base_dtype]))
        self._check_adaptable()

    def __getattr__(self, name: str):
        """The rest of what a LayeredModel offers is the base's: config, vocab_size, path (its folder: config and
        tokenizer), n_layers, weights_dtype, tied_parameters, context."""
        if name.startswith("_") or name in ("base", "spec"):  # not set yet (unpickling, copying): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    # --- the adapters ---
    def targets(self) -> list[str]:
        """The leaf names of the adapted nn.Linear modules (e.g. q_proj, v_proj)."""
        return self._linear_names() if self.spec.targets == ALL_LINEAR else sorted(set(self.spec.targets))

    def _linear_names(self) -> list[str]:
        layers = self.base.meta_layers()
        return sorted({_leaf(name) for layer in layers for name in block_linears(layer)})

    def _check_adaptable(self) -> None:
        available = self._linear_names()
        if not available:
            raise ValueError(f"{self.config.model_type} has no nn.Linear layers in its blocks to adapt (GPT-2's "
                             "blocks use Conv1D): LoRA/QLoRA here adapts nn.Linear layers; use a Llama-style model")
        if self.spec.targets != ALL_LINEAR:
            unknown = sorted(set(self.spec.targets) - set(available))
            if unknown or not self.spec.targets:
                raise ValueError(f"LoRA targets {unknown or '()'} are not nn.Linear layers of this model's blocks; "
                                 f"choose among {available} or 'all-linear'")
        if self.spec.method == "qlora":
            layer = self.base.meta_layers()[1]
            for name, linear in block_linears(layer).items():
                layout = nf4_layout(linear.weight.shape)
                if isinstance(layout, str):
                    raise ValueError(f"QLoRA cannot store {_leaf(name)} in NF4: {layout}")

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.spec.rank, lora_alpha=self.spec.alpha, lora_dropout=self.spec.dropout,
                          target_modules=self.targets(), init_lora_weights=self.spec.init == "peft")

    def _adapt(self, layer: nn.Module, index: int, initialise: bool) -> nn.Module:
        """Freeze `layer`, store its block's linears in NF4 (qlora), add adapters; with `initialise`, draw the
        adapters from the layer's own seed (peft's init, or nn.Linear's for both matrices with init='random')."""
        layer.requires_grad_(False)
        linears = block_linears(layer)
        if not linears:
            return layer
        return adapt_linears(layer, linears, self.peft_config(), self.spec.method == "qlora",
                             layer_seed(self.spec.seed, index) if initialise else None, self.spec.init)

    def meta_layers(self) -> list[nn.Module]:
        layers = self.base.meta_layers()
        return [self._adapt(layer, i, initialise=False) for i, layer in enumerate(layers)]

    def materialize(self, layers: list[nn.Module], indices: Iterable[int], device: torch.device) -> None:
        """The base's layers at `indices` read from the checkpoint onto the host, quantized there (qlora), adapters
        added and drawn from each layer's seed, then moved to `device`."""
        owned = sorted(set(indices))
        self.base.materialize(layers, owned, torch.device("cpu"))
        with torch.device("cpu"):  # the adapters too are made on the host, whatever the caller's default device
            adapted = {i: self._adapt(layers[i], i, initialise=True) for i in owned}
        for i in owned:
            layers[i] = adapted[i].to(device)

    def export_hf(self, layers: list[nn.Module], directory: str | Path, merge: bool = True) -> Path:
        """What `helpers.training.export.export_hf` writes for this model: the adapters of `layers` (the whole
        model) merged into the base (peft's `merge_and_unload`: a plain Hugging Face folder), or alone (`merge=False`:
        adapter_config.json + adapter_model.safetensors, for `PeftModel.from_pretrained(base, folder)`)."""
        directory, adapters = Path(directory), adapter_state(layers)
        if not merge:
            return save_adapters(self, adapters, directory)
        with tempfile.TemporaryDirectory(prefix="lab-adapters-") as tmp:
            merged_model(self, save_adapters(self, adapters, tmp)).save_pretrained(directory)
        return directory


def adapt_linears(layer: nn.Module, linears: Mapping[str, nn.Linear], config, quantize: bool, seed: int | None,
                   init: str = "peft") -> nn.Module:
    """`layer` (frozen) with `linears` (its nn.Linear modules by qualified name) stored in NF4 when `quantize`, and
    peft's adapters (`config`, a LoraConfig) injected, in fp32. With `seed`, the adapters are drawn from it (peft's
    init, or nn.Linear's for both matrices with init='random'): the same values on every rank and every rig, so a
    rank can build a whole layer on the host and keep its shard. Works on the meta device too (shapes only)."""
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    if quantize:
        for name, linear in linears.items():
            parent, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(parent), leaf, quantize_linear(linear))
            release_host_memory()  # quantization's workspace (a chunk's level table and the result), before the next weight
    layer = inject_adapter_in_model(config, layer)
    adapters = [m for m in layer.modules() if isinstance(m, LoraLayer)]
    for m in adapters:
        m.lora_A.to(ADAPTER_DTYPE)
        m.lora_B.to(ADAPTER_DTYPE)
    if seed is not None:
        with seeded(seed):
            for m in adapters:
                if init == "peft":
                    m.reset_lora_parameters("default", True)
                else:
                    m.lora_A["default"].reset_parameters()
                    m.lora_B["default"].reset_parameters()
    return layer


# --- adapters in and out: peft's names, save_pretrained, merge_and_unload --------------------------------------------

def _peft_names(model: LoraModel, layers: Iterable[int]) -> dict[int, dict[str, str]]:
    """For each layer, its adapter tensors' local names -> their names in a peft model (`base_model.model.` + the
    checkpoint's module path + `lora_A.default.weight`), as `get_peft_model_state_dict` expects them."""
    indices = sorted(set(layers))
    checkpoint = model.base.checkpoint_names(indices)
    meta = model.meta_layers()
    out = {}
    for i in indices:
        names = {}
        for local, p in meta[i].named_parameters():
            if not p.requires_grad:
                continue
            module, _, tail = local.partition(".lora_")
            base_name = checkpoint[i][f"{module}.weight"]
            names[local] = f"base_model.model.{base_name.rsplit('.', 1)[0]}.lora_{tail}"
        out[i] = names
    return out


def adapter_state(layers: list[nn.Module]) -> dict[int, dict[str, torch.Tensor]]:
    """The trainable (adapter) tensors of in-memory layers, by layer index: what the training loop returns."""
    return {i: {n: p.detach().cpu().clone() for n, p in layer.named_parameters() if p.requires_grad}
            for i, layer in enumerate(layers) if any(p.requires_grad for p in layer.parameters())}


def save_adapters(model: LoraModel, state: dict[int, dict[str, torch.Tensor]], directory: str | Path) -> Path:
    """Write trained adapters (by layer, as the loop returns them) with peft's `save_pretrained`: adapter_config.json
    and adapter_model.safetensors, reloadable with `PeftModel.from_pretrained(base, directory)`. The base model is
    built on the meta device: nothing but the adapters is ever in memory."""
    names = _peft_names(model, state)
    missing = [n for i in names for n in names[i] if n not in state[i]]
    if missing:
        raise ValueError(f"the adapter state lacks {missing[:3]}: pass what the training loop returned")
    tensors = {names[i][local]: t.to(ADAPTER_DTYPE).contiguous() for i in state for local, t in state[i].items()}
    from peft import get_peft_model

    peft_model = get_peft_model(model.base.skeleton(real_buffers=False), model.peft_config())
    peft_model.peft_config["default"].base_model_name_or_path = model.base.path
    directory = Path(directory)
    peft_model.save_pretrained(str(directory), state_dict=tensors)
    return directory


def load_adapters(model: LoraModel, directory: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """Adapters saved by `save_adapters` (or by peft for the same base and targets), by layer, as the loop returns
    them."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(directory) / "adapter_model.safetensors"))
    names = _peft_names(model, range(model.n_layers))
    out = {}
    for i, local_names in names.items():
        for local, full in local_names.items():
            key = full.replace(".default.", ".")
            if key not in saved:
                raise ValueError(f"{directory} has no adapter {key!r}: saved for another model or other targets?")
            out.setdefault(i, {})[local] = saved[key]
    return out


def full_layers(model: LoraModel, state: dict[int, dict[str, torch.Tensor]] | None = None,
                device: torch.device = torch.device("cpu")) -> list[nn.Module]:
    """Every layer on `device` (one device: held-out loss and samples on a small model), adapters set to `state`
    (the trained values) or left as initialised."""
    layers = owned_layers(model, range(model.n_layers), device)
    with torch.no_grad():
        for i, tensors in (state or {}).items():
            params = dict(layers[i].named_parameters())
            for name, t in tensors.items():
                params[name].copy_(t)
    return layers


def base_for_merge(model: LoraModel) -> nn.Module:
    """The Hugging Face model the adapters were trained on, whole, on the CPU: the checkpoint in `base_dtype`, and
    for qlora every block linear replaced by its NF4 values (the base the adapters saw). For small models."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.base.path, dtype=model.weights_dtype)
    if model.spec.method == "qlora":
        from helpers.finetune.quant import to_nf4

        with torch.no_grad():
            for module in hf.modules():
                if isinstance(module, nn.Linear) and module is not hf.lm_head:
                    module.weight.copy_(dequantize(to_nf4(module.weight)))
    return hf.eval()


def merged_model(model: LoraModel, adapters: str | Path) -> nn.Module:
    """The base with the saved adapters merged into its weights by peft (`PeftModel.from_pretrained` then
    `merge_and_unload`): a plain Hugging Face model computing what base + adapters compute (QLoRA: merged into the
    dequantized base, in `base_dtype`)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base_for_merge(model), str(adapters)).merge_and_unload()


# --- one call for notebook 12 -----------------------------------------------------------------------------------------

def small_llama_config(vocab: int = 512, seq_len: int = 64, n_layers: int = 4, hidden: int = 128):
    """The config of `small_llama`: 4 query heads over 2 key/value heads (grouped-query attention), intermediate
    4 x hidden, `seq_len` positions."""
    from helpers.models.hf import hf_config

    return hf_config("llama", n_layers=n_layers, hidden=hidden, heads=4, kv_heads=2, vocab=vocab, seq_len=seq_len)


def small_llama(directory: str | Path, vocab: int = 512, seq_len: int = 64, n_layers: int = 4, hidden: int = 128,
                seed: int = 0) -> HFModel:
    """A small Llama-style model (grouped-query attention) with random weights, saved with `save_pretrained`."""
    from helpers.models.hf import save_hf_model

    return save_hf_model(small_llama_config(vocab, seq_len, n_layers, hidden), directory, seed=seed)


def finetune(model: str | Path | None = None, method: str = "qlora", save_to: str | Path | None = None,
             **options) -> Trained:
    """LoRA / QLoRA of `model` (a save_pretrained directory; None: `small_llama` in `workdir`) on real text (`text`,
    default the standard library): `helpers.training.train` with FSDP2 over 2 ranks of a `LoraModel`, for `steps`
    optimizer steps (>= 3) of Adam on the adapters, and the adapters saved with peft's `save_pretrained`. The result
    (`Trained`) also holds `held_out_loss` (on `held_out_windows` held-out windows) and `samples` (the greedy
    continuation of `prompt`), before and after. `options` and their defaults: `_finetune`'s (steps=20, batch=8,
    seq_len=32, rank=8, alpha=16, targets, base_dtype, activation_checkpointing=True, offload, text, lr=3e-3, prompt,
    workdir, rig, timeout, held_out_windows, max_chars; `checkpoint`, `restarts` as in `train`: the checkpoints hold
    the adapters, not the base). Bad input is refused before any process starts."""
    return _finetune(model, (method,), {method: save_to}, **renamed(options))[method]


def finetune_each(model: str | Path | None = None, methods: Sequence[str] = METHODS,
                  save_to: str | Path | None = None, **options) -> dict[str, Trained]:
    """`finetune` of the same base on the same text with each of `methods` (default LoRA and QLoRA), one after the
    other in one launch of the ranks (`helpers.training.api.train_each`): one start-up of the processes for all of
    them. `save_to`: a folder; each method's adapters go to its own subfolder (save_to/lora, ...), and so do its
    checkpoints (checkpoint/lora, ...). `options`: those of `finetune`."""
    methods = tuple(dict.fromkeys(methods))
    if not methods:
        raise ValueError(f"no fine-tuning method given: choose among {METHODS}")
    folders = {m: (Path(save_to) / m if save_to is not None else None) for m in methods}
    return _finetune(model, methods, folders, **renamed(options))


def _finetune(model, methods: Sequence[str], save_to: Mapping[str, str | Path | None], steps: int = 20,
              batch: int = 8, seq_len: int = 32, rank: int = 8, alpha: float = 16.0,
              targets: tuple[str, ...] | str = ALL_LINEAR, base_dtype: str = "fp32",
              activation_checkpointing: bool = True,
              offload: str | None = None, text: str | Path | None = None, lr: float = 3e-3, prompt: str = "def ",
              workdir: str | Path | None = None, rig=None, timeout: float = 600.0, held_out_windows: int = 32,
              max_chars: int = 200_000, checkpoint=None, restarts: int = 0) -> dict[str, Trained]:
    """A LoraModel per method, trained by `train_each` (one check, one launch), each measured before and after."""
    from helpers.models.layered import Stage
    from helpers.models.text import greedy_sample, load_rows, stdlib_path, text_loss
    from helpers.runtime.scratch import scratch_dir
    from helpers.training.api import train_each

    specs = {m: LoraSpec(method=m, rank=rank, alpha=alpha, targets=targets, base_dtype=base_dtype) for m in methods}
    workdir = Path(workdir or scratch_dir("lab-lora-"))
    base = HFModel(str(model)) if model is not None else small_llama(workdir / "base", seq_len=max(64, seq_len))
    out = train_each({m: LoraModel(base, spec) for m, spec in specs.items()}, "fsdp2", "processes", steps=steps,
                     seq_len=seq_len, save_to=save_to, save=save_adapters, rig=rig, timeout=timeout,
                     text=text if text is not None else stdlib_path(), workdir=workdir / "text",
                     max_chars=max_chars, checkpoint=checkpoint, restarts=restarts, batch=batch, microbatches=1,
                     optimizer="adam", lr=lr, activation_checkpointing=activation_checkpointing, offload=offload)
    first = next(iter(out.values()))
    held = load_rows(first.held_out_path)[:held_out_windows]
    context = getattr(base.config, "max_position_embeddings", None)

    def measure(lora: LoraModel, state):
        stage = Stage(full_layers(lora, state)).eval()
        return text_loss(stage, held), greedy_sample(stage, first.tokenizer, prompt, 40, context)

    for trained in out.values():
        (loss_before, sample_before), (loss_after, sample_after) = (measure(trained.model, None),
                                                                    measure(trained.model, trained.state))
        trained.held_out_loss, trained.samples = (loss_before, loss_after), (sample_before, sample_after)
    return out
