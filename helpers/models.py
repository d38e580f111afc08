"""Offline models and data: a configurable transformer-style block stack, Hugging Face GPT-2 / Llama built from
a config with random weights, and a deterministic synthetic token dataset. Nothing loads from a hub."""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class StackConfig:
    """Sizes of the block stack. `ffn_widths` gives each block its own MLP width (non-uniform models)."""

    vocab: int = 256
    seq_len: int = 32
    hidden: int = 128
    n_blocks: int = 4
    heads: int = 4
    ffn_mult: int = 4
    attention: bool = True
    ffn_widths: tuple[int, ...] | None = None

    def widths(self) -> tuple[int, ...]:
        return self.ffn_widths if self.ffn_widths is not None else (self.ffn_mult * self.hidden,) * self.n_blocks

    def __post_init__(self):
        if self.ffn_widths is not None and len(self.ffn_widths) != self.n_blocks:
            raise ValueError(f"ffn_widths has {len(self.ffn_widths)} entries for {self.n_blocks} blocks")
        if self.attention and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by {self.heads} heads")


def nonuniform_config(scale: int = 1) -> StackConfig:
    """Notebook 02's model: a large vocabulary (big embedding, expensive head) and MLP widths growing from 256 to
    2048 (x `scale`), so that equal-layer, equal-parameter and greedy splits all differ from the time-optimal one."""
    widths = (256, 256, 256, 512, 512, 1024, 1024, 1536, 2048, 2048)
    return StackConfig(vocab=8192, hidden=256 * scale, n_blocks=len(widths), seq_len=32,
                       ffn_widths=tuple(w * scale for w in widths))


class Embedding(nn.Module):
    """Token + learned position embedding."""

    def __init__(self, cfg: StackConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (optional) and an MLP, each residual."""

    def __init__(self, hidden: int, ffn: int, heads: int, attention: bool = True):
        super().__init__()
        self.heads = heads
        self.attention = attention
        if attention:
            self.ln1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention:
            x = x + self._attn(x)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits."""

    def __init__(self, cfg: StackConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def build_stack(cfg: StackConfig = StackConfig(), seed: int = 0) -> nn.Sequential:
    """embedding, blocks..., head as one nn.Sequential: an ordered list of layers the course can cut anywhere."""
    torch.manual_seed(seed)
    blocks = [Block(cfg.hidden, w, cfg.heads, cfg.attention) for w in cfg.widths()]
    return nn.Sequential(Embedding(cfg), *blocks, Head(cfg))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over all tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class SyntheticTokens:
    """Deterministic token sequences with learnable structure: each token follows from the previous one by a fixed
    random permutation, with a fraction of noise tokens. Same seed, same data, on every rig."""

    n_samples: int
    seq_len: int = 32
    vocab: int = 256
    noise: float = 0.1
    seed: int = 0
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both [n_samples, seq_len] int64; targets are inputs shifted by one."""
        if "data" not in self._cache:
            g = torch.Generator().manual_seed(self.seed)
            perm = torch.randperm(self.vocab, generator=g)
            seq = torch.empty(self.n_samples, self.seq_len + 1, dtype=torch.long)
            seq[:, 0] = torch.randint(self.vocab, (self.n_samples,), generator=g)
            for t in range(1, self.seq_len + 1):
                noisy = torch.rand(self.n_samples, generator=g) < self.noise
                seq[:, t] = torch.where(noisy, torch.randint(self.vocab, (self.n_samples,), generator=g),
                                        perm[seq[:, t - 1]])
            self._cache["data"] = (seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
        return self._cache["data"]

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` (wrapping around) of `batch_size` samples."""
        x, y = self.tensors()
        if not 0 < batch_size <= self.n_samples:
            raise ValueError(f"batch size {batch_size} must be between 1 and the {self.n_samples} samples")
        start = (index * batch_size) % (self.n_samples - batch_size + 1)
        return x[start:start + batch_size], y[start:start + batch_size]


def build_hf_model(family: str = "gpt2", n_layers: int = 4, hidden: int = 128, heads: int = 4, vocab: int = 256,
                   seq_len: int = 64, intermediate: int | None = None, seed: int = 0, meta: bool = False,
                   tie_embeddings: bool = False) -> nn.Module:
    """A Hugging Face causal LM (GPT-2 or Llama) built from a config with random weights: no download.

    `meta=True` builds it on the meta device: exact shapes and parameter counts of a 7B model with no memory.
    Embeddings are untied by default so the embedding and the head can live on different devices
    (`tie_embeddings=True` gives GPT-2's published parameter counts).
    """
    torch.manual_seed(seed)
    with torch.device("meta") if meta else nullcontext():
        return _hf_from_config(family, n_layers, hidden, heads, vocab, seq_len, intermediate or 4 * hidden,
                               tie_embeddings).eval()


def _hf_from_config(family: str, n_layers: int, hidden: int, heads: int, vocab: int, seq_len: int,
                    intermediate: int, tie: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if family == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=hidden, n_layer=n_layers, n_head=heads,
                         n_inner=intermediate, tie_word_embeddings=tie,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=heads,
                          max_position_embeddings=seq_len, tie_word_embeddings=tie)
        return LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model family {family!r}; choose 'gpt2' or 'llama'")


class HFEmbedding(nn.Module):
    """Token (+ learned position, for GPT-2) embedding of a Hugging Face decoder, as a layer of its own."""

    def __init__(self, model: nn.Module):
        super().__init__()
        base = model.base_model
        self.tok = base.wte if hasattr(base, "wte") else base.embed_tokens
        self.pos = getattr(base, "wpe", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        if self.pos is not None:
            h = h + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return h


class HFDecoderBlock(nn.Module):
    """One decoder layer as a tensor -> tensor layer; Llama blocks carry their own rotary embedding (buffers only)."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None):
        super().__init__()
        self.block = block
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kwargs = {}
        if self.rotary is not None:
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            kwargs = {"position_ids": positions, "position_embeddings": self.rotary(h, position_ids=positions)}
        out = self.block(h, **kwargs)  # no mask: the SDPA path is causal
        return out[0] if isinstance(out, tuple) else out


def hf_layers(model: nn.Module) -> nn.Sequential:
    """A Hugging Face GPT-2 or Llama causal LM as an ordered list: embedding, blocks..., final norm, head.

    The layers share the model's parameters (nothing is copied), so cutting this list cuts the model.
    """
    base = getattr(model, "base_model", None)
    blocks = getattr(base, "h", None) or getattr(base, "layers", None)
    norm = getattr(base, "ln_f", None) or getattr(base, "norm", None)
    head = getattr(model, "lm_head", None)
    if blocks is None or norm is None or head is None:
        raise TypeError(f"cannot list the layers of {type(model).__name__}: expected a Hugging Face causal LM with "
                        "base_model.(h|layers), base_model.(ln_f|norm) and lm_head (GPT-2 or Llama style)")
    if getattr(model.config, "tie_word_embeddings", False) and head.weight is HFEmbedding(model).tok.weight:
        raise ValueError("the embedding and the head share one weight (tie_word_embeddings=True): they cannot sit "
                         "on different devices; build the model with tie_word_embeddings=False")
    rotary = getattr(base, "rotary_emb", None)
    return nn.Sequential(HFEmbedding(model), *(HFDecoderBlock(b, rotary) for b in blocks), norm, head)
