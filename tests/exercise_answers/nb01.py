"""Reference answers to notebook 01's exercises (tests/test_exercises.py writes each in place of `name = None`)."""
ANSWERS = {
    "my_balanced_cut": "min(range(1, len(reference)), "
                       "key=lambda cut: abs(count_params(reference[:cut]) - count_params(reference[cut:])))",
    "my_three": "(lambda three: (naive_train_step(make_executors(three), x, y), three)[1])("
                "split_model(build_stack(cfg), [3, 6], [rig.devices[0], rig.devices[1], rig.devices[0]]))",
}
