"""Activations of a transformer by formula: what training saves for backward (the planners that price a model without
building it count theirs on the meta device: helpers.gpu_sizes.footprint, helpers.sizing.training), and the transient
workspace of one decoder layer's forward, which the inference and the fine-tuning planners both reserve."""
from __future__ import annotations

from helpers.sizing.shape import ModelShape

ATTENTION_STORES_SCORES = {"eager": True, "sdpa": False, "flash": False}


def transformer_activation_bytes(batch: int, seq: int, hidden: int, layers: int, heads: int,
                                 bytes_per_value: int = 2, attention: str = "eager") -> int:
    """Saved activations of a GPT-style stack without checkpointing.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): per layer
    s*b*h*(34 + 5*a*s/h) bytes in 16-bit; scaled by bytes_per_value/2 for other precisions. The 5*a*s^2*b term is the
    attention scores, their softmax and its dropout mask: eager attention stores them (`attention="eager"`, the
    default, the paper's count). PyTorch's `scaled_dot_product_attention` on a fused kernel ("sdpa": FlashAttention-2
    or memory-efficient attention, the implementations its documentation lists besides the math fallback, which
    stores them like eager) and FlashAttention ("flash") keep only the output and the softmax's log-sum-exp and
    recompute the scores in backward (Dao et al. 2022, "FlashAttention"), so for them the term is left out.
    """
    if attention not in ATTENTION_STORES_SCORES:
        raise ValueError(f"unknown attention implementation {attention!r}; choose one of "
                         f"{list(ATTENTION_STORES_SCORES)}")
    scores = 5 * heads * seq / hidden if ATTENTION_STORES_SCORES[attention] else 0
    per_layer = seq * batch * hidden * (34 + scores)
    return int(per_layer * layers * bytes_per_value / 2)


def activation_workspace_bytes(shape: ModelShape, context: int, batch: int) -> int:
    """Transient memory of one decoder layer, the most any device needs while its layers run (an estimate read off
    the Hugging Face Llama code, reserved on every GPU that holds any module):

    - prefill of a `context`-token prompt: the residual stream and its normed copy (2 x hidden per token), plus the
      larger of the MLP's gate, up and gated product (3 x intermediate) and attention's q, k, v, the rotated q and k
      and the output (3 x heads x head_dim + 3 x kv_heads x head_dim), in the activation dtype. PyTorch SDPA's flash
      or memory-efficient kernel is assumed: eager attention would add batch x heads x context^2 scores;
    - decode: DynamicCache.update concatenates the new token onto a layer's K, then V (torch.cat copies), so half the
      largest layer's KV cache is briefly held twice.
    """
    per_token = 2 * shape.hidden + max(3 * shape.intermediate,
                                       3 * shape.heads * shape.head_dim + 3 * shape.kv_heads * shape.head_dim)
    prefill = batch * context * per_token * shape.format.activation_bytes
    cat_copy = max((layer.kv_bytes(context, batch) for layer in shape.decoder_layers), default=0) // 2
    return max(prefill, cat_copy)
