"""Offline models and data: the course's block stack, Hugging Face causal LMs built from configs, synthetic tokens."""
from helpers.models.data import IGNORE_INDEX, SyntheticTokens, kept_tokens, lm_loss, lm_loss_sum
from helpers.models.hf import HFContext, HFModel, build_hf_model, hf_config, hf_layers, save_hf_model
from helpers.models.layered import LayeredModel, Stage
from helpers.models.stack import StackConfig, StackModel, build_stack, count_params, nonuniform_config

__all__ = ["IGNORE_INDEX", "kept_tokens", "lm_loss_sum", "HFContext", "HFModel", "LayeredModel", "Stage", "StackConfig",
           "StackModel", "SyntheticTokens", "build_hf_model", "build_stack", "count_params", "hf_config", "hf_layers",
           "lm_loss", "nonuniform_config", "save_hf_model"]
