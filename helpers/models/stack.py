"""The course's own model: a configurable transformer-style block stack (embedding, blocks, head) that can be cut
anywhere, with per-block widths for non-uniform models."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from helpers.models.layered import materialize_seeded, owned_layers


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


@dataclass(frozen=True)
class StackModel:
    """The block stack as a `LayeredModel`: what a rank needs to build exactly its own layers (see
    helpers.models.layered). Layer i is initialised from its own seed, so any subset equals one device's."""

    cfg: StackConfig = StackConfig()
    seed: int = 0

    def meta_layers(self) -> list[nn.Module]:
        with torch.device("meta"):
            blocks = [Block(self.cfg.hidden, w, self.cfg.heads, self.cfg.attention) for w in self.cfg.widths()]
            return [Embedding(self.cfg), *blocks, Head(self.cfg)]

    def materialize(self, layers: list[nn.Module], indices: Iterable[int], device: torch.device) -> None:
        materialize_seeded(layers, indices, device, self.seed)

    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        return None  # causal attention over the whole sequence: nothing per micro-batch

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab

    @property
    def n_layers(self) -> int:
        return self.cfg.n_blocks + 2


def build_stack(cfg: StackConfig = StackConfig(), seed: int = 0, device: torch.device | str = "cpu") -> nn.Sequential:
    """embedding, blocks..., head as one nn.Sequential: an ordered list of layers the course can cut anywhere.
    The weights are those every engine's ranks build for themselves from the same seed."""
    return nn.Sequential(*owned_layers(StackModel(cfg, seed), range(cfg.n_blocks + 2), torch.device(device)))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
