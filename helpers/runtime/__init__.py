"""Where code runs: the rig, ranks launched from a notebook or torchrun (no orphans), device-strict CPU ranks."""
