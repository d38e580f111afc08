"""Notebook 00's exercises answered (tests/test_exercises.py)."""
ANSWERS = {
    # fp32 weights and gradients (4 + 4 bytes) and Adam's two fp32 moments (8): 16 bytes a parameter
    "my_llama": "(llama_n, ceil(16 * llama_n / usable_3090))",
    # the MLP-only model's activations measured at BATCH; attention accounts for the rest of act_2
    "my_attention_share": "1 - activations_at(BATCH, StackConfig(hidden=HIDDEN, n_blocks=BLOCKS, seq_len=SEQ, "
                          "attention=False)) / act_2",
    # one rank runs both devices' work one after the other: they never compute at once
    "my_overlap_ms": "0.0",
}
