"""Tensor-parallel split of mlx-lm models across 2 (or more) ranks, each rank reading only its
bytes of the weights (the face; the plans and their application live in split/).

    from mlx_ds4tp.model_split import load_split, split_model
    model, tokenizer = load_split("path/to/mlx-lm-model", group=g)   # each rank loads its half
    split_model(model, group=g)                                       # or split a loaded model

q/k/v and gate/up projections are column parallel, o and down row parallel followed by the
gate; experts are cut by their intermediate features with the router whole; the vocabulary is
cut by rows and the logits' parts gathered (split/apply.py says which families, how).
"""

from .collectives.seam import MlxCollective
from .split.apply import (
    Collective,
    ColumnParallelLinear,
    GatedBlock,
    RowParallelLinear,
    SafetensorsParts,
    VocabParallelEmbedding,
    VocabParallelHead,
    agree_model,
    as_collective,
    check_cut,
    cut_layer,
    family_of,
    load_split,
    plan_split,
    split_model,
)
from .split.layers import AllSumGate

__all__ = [
    "AllSumGate",
    "Collective",
    "ColumnParallelLinear",
    "GatedBlock",
    "MlxCollective",
    "RowParallelLinear",
    "SafetensorsParts",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "agree_model",
    "as_collective",
    "check_cut",
    "cut_layer",
    "family_of",
    "load_split",
    "plan_split",
    "split_model",
]
