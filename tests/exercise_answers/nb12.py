"""Notebook 12's exercises answered (tests/test_exercises.py)."""
ANSWERS = {
    # LoRA's parameters grow linearly with the rank; their fp32 gradients (4 bytes each) are split over two ranks
    "my_grads": "peft_trainable * 64 // RANK * 4 // 2",
    # per decoder layer: q, k, v, o take 4096 in and out; gate and up 4096 -> 11008, down 11008 -> 4096
    "my_count": "32 * 64 * (4 * (4096 + 4096) + 3 * (4096 + 11008))",
}
