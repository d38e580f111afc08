"""Notebook 03's exercises answered (tests/test_exercises.py)."""
ANSWERS = {
    # each of stage 0's four blocks frees the same bytes: three of them free 3/4 of what checkpointing all four does
    "my_stage0_bytes": "act_stage0['none'] - 3 / 4 * (act_stage0['none'] - act_stage0['every 1'])",
    # the fullest device's state stays; what is left of the card holds activations at their bytes per sample
    "my_prediction": "max_batch(max(m.params + m.grads + m.optimizer for m in runs[0].ledger.report().values()), "
                     "max(m.activations for m in runs[0].ledger.report().values()) / BATCH, CARD)",
}
