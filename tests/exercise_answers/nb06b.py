"""Reference answers to notebook 06b's exercises (tests/test_exercises.py writes them in place of `my_... = None`)."""
ANSWERS = {
    # 1: plain 1F1B's bubble (p-1)/(m+p-1) equals four chunks' (p-1)/(4 x 8 + p-1) at m = 4 x 8
    "my_m": "32",
    # 2: each device's first W in make_schedule("zbv", 3, 5), counted from 0 in its own list
    "my_first_w": "[7, 7, 7]",
    # 3: F one unit, the backward's two units split 3:1 between B and W (weight_share = 0.25)
    "my_fbw": "(1.0, 1.5, 0.5)",
}
