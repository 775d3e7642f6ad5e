"""Every rank on this machine, one process each (one host, hence the name; tests/localranks.py
is another thing, N ranks in one process): free ports, the child environment, the rank
processes started and waited for together, and every rank of `ds4tp run` on 127.0.0.1.

Product code, not test scaffolding: `ds4tp demo`, `ds4tp bench` and `ds4tp doctor` run their
ranks here, so it lives beside them (the tests use it too). It was testing/ once; no product
module may import a testing/ package (tools/layout_check.py keeps that rule).
"""
