"""Notebook 13's exercises answered (tests/test_exercises.py)."""
ANSWERS = {
    # killed after step 2, before the first save (after step EVERY = 3): no complete checkpoint, so from the start
    "my_resumed_from": "2 // EVERY * EVERY",
    # the run stopped after KILL_AT resumes from its newest save and, seeded afresh, draws other dropout masks at once
    "my_first_diff": "KILL_AT // EVERY * EVERY + 1",
}
