"""Reference answers to notebook 11's exercises (tests/test_exercises.py writes each in place of `name = None`)."""
ANSWERS = {
    "my_exact": '"zero1"',
    "my_dropout": "(True, False)",
    "my_bytes": "VOCAB * HIDDEN * 4",
}
