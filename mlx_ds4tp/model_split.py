"""Tensor-parallel split of mlx-lm models across 2 (or more) ranks, each rank reading only its
bytes of the weights (the face; the plans and their application live in split/).

    from mlx_ds4tp.model_split import load_split, split_model
    model, tokenizer = load_split("path/to/mlx-lm-model", group=g)   # each rank loads its half
    split_model(model, group=g)                                       # or split a loaded model

The blocks are cut by mlx-lm's own plan (Model.shard) where the model's module has one, by ours
(split/plans.py) where it has none; the vocabulary is cut by rows and the logits' parts
gathered; each rank reads only its bytes (split/apply.py says how).
"""

from .collectives.seam import Collective, MlxCollective, as_collective
from .split.apply import (
    SafetensorsParts,
    VocabParallelEmbedding,
    VocabParallelHead,
    agree_model,
    check_rows,
    cut_rows,
    load_split,
    split_model,
)
from .split.layers import AllSumGate

__all__ = [
    "AllSumGate",
    "Collective",
    "MlxCollective",
    "SafetensorsParts",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "agree_model",
    "as_collective",
    "check_rows",
    "cut_rows",
    "load_split",
    "split_model",
]
