"""Saved activations of a transformer by formula (the planners that price a model without building it count theirs
on the meta device: helpers.gpu_sizes.footprint, helpers.sizing.training)."""
from __future__ import annotations

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

