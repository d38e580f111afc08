"""Deprecated name of `helpers.activation_checkpointing` (recomputing activations in backward), renamed so that it
is not mistaken for training checkpoints (`helpers.training.checkpoint`, DCP). Kept for one release."""
import warnings

from helpers.activation_checkpointing import Checkpointed, checkpoint_in_place, checkpoint_layers, every_kth

warnings.warn("helpers.checkpointing is now helpers.activation_checkpointing", DeprecationWarning, stacklevel=2)

__all__ = ["Checkpointed", "checkpoint_in_place", "checkpoint_layers", "every_kth"]
