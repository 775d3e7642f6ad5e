"""Models with random weights on disk: the demo's model (`--model demo`), the bench's presets
and the tests' small models, built by mlx-lm's own classes with a fixed seed.

Product code, not test scaffolding: `ds4tp demo`, `--model demo` and `ds4tp bench` build these,
so it lives in the package proper (it was testing/ once; tools/layout_check.py keeps product
modules from importing a testing/ package).
"""
