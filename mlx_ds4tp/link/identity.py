"""A model directory's identity as the hello compares it (ModelIdentity):
the shape from config.json and the fingerprint, read before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

from .fingerprint import model_fingerprint
from .hello import ModelIdentity


def model_identity(path: str) -> ModelIdentity:
    """What the hello compares: the shape from config.json and the model's
    fingerprint (safetensors headers and small samples), read before anything
    loads, so a pair with different models stops before either spends time
    loading. FileNotFoundError without config.json, ValueError when the
    directory holds no model*.safetensors."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is not an mlx-lm model directory (no config.json); give the same model "
            "directory on both machines"
        ) from None
    layers = int(config.get("num_hidden_layers", 0))
    quant = config.get("quantization") or {}
    return ModelIdentity(
        layers=layers,
        hidden=int(config.get("hidden_size", 0)),
        vocab=int(config.get("vocab_size", 0)),
        quant_bits=int(quant.get("bits", 0)),
        # Embedding gate, attention and MLP gates per block, logits gather.
        gates_per_token=2 * layers + 2,
        fingerprint=model_fingerprint(path),
    )
