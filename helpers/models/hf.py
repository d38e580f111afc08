"""Hugging Face causal LMs built from a config with random weights (nothing loads from a hub), and their layer view."""
from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
from torch import nn


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
