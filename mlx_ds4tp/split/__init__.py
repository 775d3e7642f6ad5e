"""Tensor-parallel plans and layers (behind model_split.py)."""
