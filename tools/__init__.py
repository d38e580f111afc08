"""Tooling around the course, not part of the parallelism library: `python -m tools.wheelhouse` (the offline install
for workshop venues)."""
