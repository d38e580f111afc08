"""Reference answers to the notebooks' exercises, one module per notebook (`nb13.py` for notebook 13): `ANSWERS` maps
each answer variable of the exercise check cells (`my_start = None`) to the Python source of the right answer.
tests/test_exercises.py runs each such notebook with its answers in place and requires every exercise to print
"exercise N: right"."""
