"""What every other package of the lab stands on: where things are, spec files and their overrides, the
lab's processes (identity, clean-up) and the limited child that checks what a viewer names (sandbox)."""
