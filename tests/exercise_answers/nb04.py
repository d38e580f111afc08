"""Reference answers to notebook 04's exercises (tests/test_exercises.py)."""
ANSWERS = {
    # every block is residual and keeps [micro-batch, sequence, hidden]: the cut does not change the bytes
    "my_cut2_bytes": "(BATCH // MICROBATCHES) * SEQ * HIDDEN * 4",
    # twice the messages, each half the bytes: the same bytes, 2 x MICROBATCHES more latencies per step
    "my_extra_us": "2 * MICROBATCHES * p2p.latency_s * 1e6",
    # forward and backward, every micro-batch, 2 bytes a value
    "my_bytes": "2 * MICROBATCHES * (BATCH // MICROBATCHES) * SEQ * HIDDEN * 2",
}
