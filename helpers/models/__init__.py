"""Offline models and data: the course's block stack, Hugging Face causal LMs built from configs, synthetic tokens."""
from helpers.models.data import SyntheticTokens, lm_loss
from helpers.models.hf import build_hf_model, hf_layers
from helpers.models.stack import StackConfig, build_stack, count_params, nonuniform_config

__all__ = ["StackConfig", "SyntheticTokens", "build_hf_model", "build_stack", "count_params", "hf_layers", "lm_loss",
           "nonuniform_config"]
