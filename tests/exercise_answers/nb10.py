"""Notebook 10's exercises answered (tests/test_exercises.py)."""
ANSWERS = {
    # the all-reduce takes bytes / bandwidth: it shrinks to the flip's size at allreduce_s / flip_s times the rate
    "my_flip_gb_s": "answer.allreduce_s / answer.flip_s * target_rig('2x3090 PCIe').collectives.bandwidth / 1e9",
    # GPipe's bubble (p - 1) / (m + p - 1) with p = 4: 3 / 15 = 20% at m = 12
    "my_m": "12",
}
