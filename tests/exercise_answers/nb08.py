"""Notebook 08's exercises answered (tests/test_exercises.py)."""
ANSWERS = {
    # over the bridge the whole all-reduce takes less than DDP's margin over the pipeline: exposing it flips nothing
    "my_nvlink_choice": '"DDP"',
    # bf16 weights and gradients (2 + 2 bytes), fp32 master weights and Adam's two moments (4 + 8): 16 bytes each
    "my_ddp_gib": "recommend_model('GPT-2 XL').n_params * (2 + 2 + 4 + 8) / 2**30",
}
