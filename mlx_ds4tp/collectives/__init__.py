"""The collectives over a pair (behind gate_ops.py)."""
