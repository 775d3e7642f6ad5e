"""mlx-lm's own split plan (`Model.shard(group)`) applied over any group, with ours on top.

mlx-lm cuts the blocks; what it leaves whole, and what we add:

- the vocabulary: mlx-lm keeps the embedding and (in most modules) `lm_head` whole on every
  rank, two copies of a 150k-vocabulary model's largest tensors per Mac. We cut both by rows
  (split/layers.py's VocabParallelEmbedding / VocabParallelHead): one all_sum after the lookup,
  one gather of the logits a token. An `lm_head` the plan cuts itself is left to it.
- the checks: the plan runs on a twin first (split/derive.py), so a count that does not divide
  is refused naming the layer before the model changes.
- the reading: the twin shows which indices of each saved tensor this rank keeps, so
  load_split reads only those bytes instead of every rank reading the whole checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..base.log import log
from ..collectives.backend import cut_only_group
from .derive import derive_plan, set_array
from .layers import ReadPart, VocabParallelEmbedding, VocabParallelHead, check_cut, cut_layer

_VOCAB_LAYERS = {"embed_tokens": ((nn.Embedding, nn.QuantizedEmbedding), VocabParallelEmbedding),
                 "lm_head": ((nn.Linear, nn.QuantizedLinear), VocabParallelHead)}


def _vocab_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """(dotted path, our wrapper class) of each whole embedding / vocabulary projection."""
    found = []
    for path, module in model.named_modules():
        kinds = _VOCAB_LAYERS.get(path.rsplit(".", 1)[-1])
        if kinds is not None and type(module) in kinds[0]:
            found.append((path, kinds[1]))
    return found


def _parent(root: nn.Module, path: str) -> tuple[Any, str]:
    *parents, name = path.split(".")
    node: Any = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, name


def _shard_group(group: Any) -> "mx.distributed.Group":
    """The group mlx-lm's shard() is given."""
    # mlx-lm's layers call mx.distributed.all_sum(x, group=...) themselves: only a real
    # mx.distributed.Group can carry their gates. An object with only rank() and size() is
    # enough to cut (tests, tools that save parts): it stands behind a group whose
    # collectives fail saying so. One with collectives of its own would be silently
    # bypassed, so it is refused.
    if isinstance(group, mx.distributed.Group):
        return group
    if not hasattr(group, "all_sum"):
        return cut_only_group(int(group.rank()), int(group.size()))
    raise TypeError(
        f"{type(group).__name__} is not an mx.distributed.Group; mlx-lm's plans run their gates "
        f"through mx.distributed, so give the group mlx_ds4tp.init(...) or mx.distributed.init() returns"
    )


def split_with_mlx_lm_plan(
    model: nn.Module,
    group: Any,
    collective: Any,
    *,
    read_part: Optional[ReadPart] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> list[str]:
    """Cut `model` in place with its mlx-lm module's shard() plan and our vocabulary split;
    returns the cut arrays read_part could not read (read whole and cut in memory).

    group: what shard() is given; collective: the same group as split/layers.py's layers use it.
    Every check runs before the model changes."""
    group = _shard_group(group)
    size = int(group.size())
    vocab = _vocab_layers(model)
    for path, cls in vocab:
        parent, name = _parent(model, path)
        check_cut(parent[name], cls.cut_kind, size, path)
    plan = derive_plan(model, group, trace=read_part is not None)
    wholes = dict(tree_flatten(model.parameters()))  # lazily loaded: nothing read yet
    model.shard(group)
    for path, cls in vocab:
        parent, name = _parent(model, path)
        layer = parent[name]
        if type(layer) in _VOCAB_LAYERS[name][0]:  # not cut by the plan itself
            parent[name] = cls(cut_layer(layer, cls.cut_kind, collective, path, read_part), collective)
    params = tree_flatten(model.parameters())
    in_memory = list(plan.underived) if read_part is not None else []
    for done, (path, value) in enumerate(params, 1):
        cut = plan.cuts.get(path)
        if read_part is not None and cut is not None:
            part = read_part(path, wholes[path], cut.axis, runs=cut.runs)
            if part is not None and part.shape == value.shape and part.dtype == value.dtype:
                set_array(model, path, part)
            else:
                in_memory.append(path)
                mx.eval(value)
        else:
            # Whole on every rank, or cut in memory: one array read at a time, its whole
            # dropped as soon as the part is kept.
            mx.eval(value)
        if progress is not None:
            progress(done, len(params), path)
    if in_memory:
        log(f"{len(in_memory)} cut array(s) read whole and cut in memory (their cut is not a plain "
            f"selection of the saved tensor, or the saved layout differs): {', '.join(in_memory[:4])}"
            f"{', ...' if len(in_memory) > 4 else ''}")
    return in_memory


__all__ = ["split_with_mlx_lm_plan"]
