"""ds4tp bench: gate, model and serving benchmarks."""
