"""Notebook 06's exercises answered (tests/test_exercises.py)."""
ANSWERS = {
    # 1F1B keeps every stage busy in its steady state only with at least one micro-batch per stage
    "my_min_m": "4",
    # stage s runs p - s forwards before its first backward (the last stage: one)
    "my_warmup": "[4, 3, 2, 1]",
}
