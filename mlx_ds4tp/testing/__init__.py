"""Both ranks on one machine and tiny random models: what the demo, the benchmarks and the tests build."""
