"""Multi-process training: a job (`job`), the strategies applied to a rank's module over one DeviceMesh
(`strategies`), the one loop every strategy runs (`loop`), which rig runs what (`support`), and the one entry point
that trains a Hugging Face causal LM and saves it (`api.train`)."""
from helpers.training.api import train

__all__ = ["train"]
