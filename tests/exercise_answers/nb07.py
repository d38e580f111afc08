"""Notebook 07's exercises answered (tests/test_exercises.py)."""
ANSWERS = {
    # two fp32 moments (8 bytes) per parameter, sharded over four ranks
    "my_adam_bytes_4": "8 * n // 4",
    # ZeRO-2 keeps the fp32 weights whole and shards the fp32 gradients and Adam's two moments over N = 2
    "my_zero2_bytes": "4 * n + (4 * n + 8 * n) / 2",
}
