"""split_model and load_split, behind the face mlx_ds4tp/model_split.py (docs/families.md says
what is cut and how).

The blocks are cut by a plan (split/plans.py picks mlx-lm's own or ours), run on twins first for
the checks and the indices each rank keeps (split/derive.py). What a plan leaves whole we add on
top: the vocabulary, which mlx-lm keeps whole on every rank (the embedding and, in most modules,
`lm_head`: two copies of a 150k-vocabulary model's largest tensors per Mac), cut by rows
(split/layers.py); an `lm_head` the plan cuts itself is left to it. And the reading: load_split
reads only this rank's bytes, where mlx-lm's own loader reads the whole checkpoint on every rank.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..base.log import log
from ..checkpoint.parts import SafetensorsParts
from ..collectives.backend import cut_only_group
from ..collectives.seam import as_collective
from ..link.fingerprint import model_fingerprint
from ..link.hello import receives_part
from .columns import under
from .derive import MLX_SHARDED, set_array
from .layers import (
    SHARDED,
    ReadPart,
    VocabParallelEmbedding,
    VocabParallelHead,
    check_rows,
    cut_rows,
    rank_and_size,
)
from .plans import OWN_PLANS, plan_of, saved_layout, summed_blocks
from .share import EVEN, SplitShare, pair_cut_rules
from .units import Layout, choose_layout, part_shape, run_plan, share_granules, take_runs

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


def _shard_group(group: Any) -> "mx.distributed.Group":
    """The group the plan is given."""
    # The plans' layers call mx.distributed.all_sum(x, group=...) themselves: only a real
    # mx.distributed.Group can carry their gates. An object with only rank() and size() is
    # enough to cut (tests, tools that save parts): it stands behind a group whose
    # collectives fail saying so. One with collectives of its own would be silently
    # bypassed, so it is refused.
    if isinstance(group, mx.distributed.Group):
        return group
    if not hasattr(group, "all_sum"):
        rank, size = rank_and_size(group)
        return cut_only_group(rank, size)
    raise TypeError(
        f"{type(group).__name__} is not an mx.distributed.Group; the split plans run their gates "
        f"through mx.distributed, so give the group mlx_ds4tp.init(...) or mx.distributed.init() returns"
    )


def _check_vocab(model: nn.Module, vocab: list[tuple[str, Any]], size: int) -> None:
    modules = dict(model.named_modules())
    for path, _ in vocab:
        check_rows(modules[path], size, path)


def _label(model: nn.Module) -> str:
    module = type(model).__module__
    name = module.rsplit(".", 1)[-1]
    return f"our {name} plan" if module in OWN_PLANS else f"mlx-lm's {name} plan"


def _refuse_split_twice(model: nn.Module) -> None:
    already = [type(m).__name__ for m in model.modules()
               if isinstance(m, SHARDED + MLX_SHARDED + summed_blocks())]
    if already:
        raise ValueError(f"the model is already split (it holds {already[0]} layers); split a model once")


def split_model(
    model: nn.Module,
    group: Any,
    *,
    split: Union[SplitShare, str] = EVEN,
    read_part: Optional[ReadPart] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> nn.Module:
    """Split a loaded mlx-lm model in place across the group's ranks; returns the model.

    Arguments:
      model: a model from mlx_lm.load / mlx_lm.utils.load_model (lazy or evaluated), of a
        supported family (an mlx-lm module with Model.shard(), or one of split/plans.py's),
        float or quantized.
      group: an mx.distributed.Group: the one mlx_ds4tp.init(...) returns, or MLX's own.
        An object with only rank() and size() is enough to cut (its gates fail if run).
      split: the share each rank keeps: "even" (default) or "A:B[:C...]" (one part per rank of
        the group, rank 0's first), or a SplitShare. Where the model's counts cannot give it,
        the nearest share that can is used and logged (split/units.py); from three ranks that
        holds for "even" too (8 KV heads on 3 ranks: 3:3:2). "auto" must be resolved first.
      read_part: (load_split passes one) reads a part straight from the model's files instead
        of cutting the loaded array; default None cuts in memory. A cut it cannot read (the
        plan's cut is not a selection of the saved tensor, or the saved layout differs) is
        cut in memory and logged.
      progress: progress(done, total, where) after each array (the CLI draws its bar with it).

    Every rank calls this with the same model and share. All checks run before anything
    changes, so an error leaves the model whole. Each array is evaluated in turn, so a lazily
    loaded model never holds more than its part plus one whole tensor.

    Raises:
      ValueError: the family is not supported (the message lists the supported ones), a count
        does not divide by two ranks' even split (heads, KV heads, expert or MLP width, vocabulary,
        quantization group: the message names the layer, the values and the fix), a count has
        fewer whole units than the group has ranks (the message names it and the group sizes
        the model allows), the share is not one (or is "auto", or its parts do not match the
        ranks), or the model is already split.
      TypeError: `group` is neither an mx.distributed.Group nor an object with rank()/size().
    """
    for _ in cut_arrays(model, group, split=split, read_part=read_part, progress=progress):
        pass
    return model


def cut_arrays(
    model: nn.Module,
    group: Any,
    *,
    split: Union[SplitShare, str] = EVEN,
    read_part: Optional[ReadPart] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
    layout: Optional[Layout] = None,
) -> Iterator[tuple[str, mx.array]]:
    """split_model one array at a time: the model is cut (cut_structure) at the first next(),
    then each of its arrays, in tree_flatten order, is read or cut, evaluated, put in the model
    and yielded as (dotted path, array). The leader sending a worker its part (split/part_send.py)
    drops each array from the model once it has sent it, so it never holds that whole part.
    layout: traced_layout's for this model's files, group and share, kept from before (the
    leader sending parts again: split/part_memo.py), so the trace does not run again."""
    layout, wholes = cut_structure(model, group, split=split, read_part=read_part, layout=layout)
    params = tree_flatten(model.parameters())
    in_memory = list(layout.plan.underived) if read_part is not None else []
    for done, (path, value) in enumerate(params, 1):
        cut = layout.plan.cuts.get(path)
        whole = wholes.pop(path, value)  # not kept past its array: its data goes with the part
        part = read_part(path, whole, cut.axis, runs=cut.runs) if read_part and cut else None
        if cut is not None and (part is None or part.shape != part_shape(cut) or part.dtype != value.dtype):
            if read_part is not None:
                in_memory.append(path)
            # One unit's part is the plan's own cut; a rank of several units takes its runs.
            part = take_runs(whole, cut) if layout.takes_runs(path) else None
        del whole
        if part is not None:
            mx.eval(part)
            set_array(model, path, part)
            value = part
        else:
            # Whole on every rank, or cut in memory: one array read at a time, its whole
            # dropped as soon as the part is kept.
            mx.eval(value)
        if progress is not None:
            progress(done, len(params), path)
        yield path, value
    if in_memory:
        log(f"{len(in_memory)} cut array(s) read whole and cut in memory (their cut is not a plain "
            f"selection of the saved tensor, or the saved layout differs): {', '.join(in_memory[:4])}"
            f"{', ...' if len(in_memory) > 4 else ''}")


def cut_lazily(model: nn.Module, group: Any, *, split: Union[SplitShare, str] = EVEN) -> nn.Module:
    """The model cut as split_model cuts it, every array at its part's shape and dtype but left
    lazy (only the vocabulary's parts are evaluated). A worker building its part's model from
    received files (split/part_plan.py) loads its arrays into this; the leader lists a part's
    arrays from it."""
    layout, wholes = cut_structure(model, group, split=split)
    for path, _ in tree_flatten(model.parameters()):
        cut = layout.plan.cuts.get(path)
        if cut is not None and layout.takes_runs(path):
            set_array(model, path, take_runs(wholes[path], cut))
    return model


def traced_layout(model: nn.Module, group: Any, *, split: Union[SplitShare, str] = EVEN) -> Layout:
    """The layout cut_structure chooses when it reads parts (traced: each cut array's indices),
    for the same model files, `group` (the same object) and share given to cut_arrays later."""
    return _chosen_layout(model, _shard_group(group), SplitShare.of(split), trace=True)


def _chosen_layout(model: nn.Module, group: Any, share: SplitShare, *, trace: bool) -> Layout:
    size = int(group.size())
    vocab = _vocab_layers(model)
    # A pair's even split keeps 1:1 exactly, as it always has, so its rows must divide by two;
    # from three ranks the vocabulary is cut in proportion at any row, as an uneven share's is.
    if share.is_even and pair_cut_rules(size):
        _check_vocab(model, vocab, size)
    layout = choose_layout(model, group, plan_of(model), share, trace=trace, label=_label(model))
    if layout.vocab.is_even and not share.is_even and pair_cut_rules(size):  # fell back to even: the rows must divide
        _check_vocab(model, vocab, size)
    if not layout.is_even:
        log(layout.describe())
    return layout


def cut_structure(
    model: nn.Module,
    group: Any,
    *,
    split: Union[SplitShare, str] = EVEN,
    read_part: Optional[ReadPart] = None,
    layout: Optional[Layout] = None,
) -> tuple[Layout, dict[str, mx.array]]:
    """The model cut as split_model cuts it, its arrays left lazy (only the vocabulary's parts
    are evaluated; an array a finer share takes by its runs is still the plan's cut): the layout
    chosen (or `layout`, traced_layout's from before) and each array's whole as loaded, by
    dotted path."""
    shard = plan_of(model)
    _refuse_split_twice(model)
    share = SplitShare.of(split)
    collective = as_collective(group)
    group = _shard_group(group)
    rank = int(group.rank())
    vocab = _vocab_layers(model)
    if layout is None:
        layout = _chosen_layout(model, group, share, trace=read_part is not None)
    wholes = dict(tree_flatten(model.parameters()))  # lazily loaded: nothing read yet
    run_plan(layout, model, shard, group)
    modules = dict(model.named_modules())
    for path, cls in vocab:
        layer = modules[path]
        if type(layer) in _VOCAB_LAYERS[path.rsplit(".", 1)[-1]][0]:  # not cut by the plan itself
            bounds = layout.vocab.bounds(layer["weight"].shape[0])
            rows = (bounds[rank], bounds[rank + 1])
            set_array(model, path, cls(cut_rows(layer, rows, path, read_part), collective, bounds))
    return layout, wholes


class ModelCuts:
    """The shares a model's counts let a load take, read off the model built lazily (no weight
    read): `--split auto` picks among them, and checks the memory of the part a load would
    keep, not of the share it asked for."""

    def __init__(self, path: Union[str, Path]):
        from mlx_lm.utils import load_model

        self._model, _ = load_model(Path(path), lazy=True)
        self._shard = plan_of(self._model)
        self._label = _label(self._model)
        self.granules = share_granules(self._model, self._shard, self._label)

    def kept(self, share: SplitShare) -> float:
        """The part of the split weights' bytes rank 0 of a pair keeps when a load asks for
        `share`."""
        return self.parts(share, 2)[0]

    def layout(self, share: SplitShare, size: int) -> Layout:
        """The cut a load of `size` ranks takes when it asks for `share` (choose_layout's, on rank
        0's twin, the same for every rank): `ds4tp doctor --ranks N` names even's nearest with it
        (8 KV heads on 3 ranks: 3:3:2). ValueError naming the counts where no cut gives every
        rank a part."""
        return choose_layout(self._model, cut_only_group(0, size), self._shard, share, trace=False,
                             label=self._label)

    def parts(self, share: SplitShare, size: int) -> tuple[float, ...]:
        """The part of the split weights' bytes each of `size` ranks keeps when a load asks for
        `share` (choose_layout's cuts, on rank 0's twin, the same for every rank: the
        attention's, the columns' and the vocabulary's each by its own share)."""
        if share.is_even and pair_cut_rules(size):
            return (0.5, 0.5)
        layout = self.layout(share, size)
        vocab = {path for path, _ in _vocab_layers(self._model)}
        held, whole = [Fraction(0)] * size, 0
        for path, value in tree_flatten(self._model.parameters()):
            if path in layout.plan.axes:
                held = [h + value.nbytes * layout.fraction_of(path, r) for r, h in enumerate(held)]
            elif under(path, vocab):
                held = [h + value.nbytes * Fraction(layout.vocab.counts[r], layout.vocab.units)
                        for r, h in enumerate(held)]
            else:
                continue
            whole += value.nbytes
        return tuple(float(h / whole) if whole else 1 / size for h in held)


def agree_model(model_path: Path, group: Any) -> None:
    """For a group of our own (transport tcp or rdma) whose hellos carried no model fingerprint
    (init without identity, or an identity of the user's own without one): every rank, at the
    same point of load_split, compares model_path's fingerprint with each peer's before any
    reads a weight, and a difference is HelloMismatchError on both ends of a link, naming both. A hello that carried
    fingerprints already agreed on them (a difference stops the hello), so nothing is read
    twice; MLX's groups have no channel for it."""
    if not callable(getattr(group, "link_to", None)):
        return
    fingerprint = None
    # Each link in rank order, as every rank walks them: a swap writes before it reads, so no
    # order of links can leave two ranks waiting on each other.
    for peer in (r for r in range(group.size()) if r != group.rank()):
        link = group.link_to(peer)
        # Both hellos of a link carry one or neither (one without is refused at the hello), so
        # both its ranks take the same branch here.
        if link.mine.fingerprint and link.peer_hello.fingerprint:
            continue
        if receives_part(link.peer_hello):
            continue  # a rank without the model: its part is checked against this one's (part_receive)
        fingerprint = fingerprint or model_fingerprint(model_path)
        link.agree_fingerprint(fingerprint)


def load_split(
    path: Union[str, Path],
    group: Any,
    *,
    split: Union[SplitShare, str] = EVEN,
    lazy: bool = True,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> tuple[nn.Module, Any]:
    """Load an mlx-lm model directory holding only this rank's part of the split weights.

    Arguments:
      path: a local mlx-lm model directory (config.json, *.safetensors, tokenizer files), as
        mlx_lm.convert or mlx_ds4tp.synthetic.tiny_model write it, or an original Hugging Face checkpoint
        of a supported family (experts saved one by one are stacked while reading).
      group: as for split_model.
      split: as for split_model ("even", "A:B" or a SplitShare; "auto" is refused here, it is
        resolved at the hello before anything is loaded).
      lazy: True (default): mlx-lm builds the model without reading the weights and each cut
        weight's part is read straight from the .safetensors files (for an expert stack, one
        range per expert), so a rank reads and holds about 1/size of the model. False: mlx-lm
        reads the whole model first and it is cut in memory (same result, the whole model's
        peak memory).
      progress: as for split_model.

    Returns (model, tokenizer), like mlx_lm.load.

    With a group of our own (transport tcp or rdma) whose hello carried no model fingerprint,
    both ranks compare the model's fingerprint first (agree_model).

    Raises:
      FileNotFoundError: `path` holds no config.json (mlx-lm would take it for a hub id).
      ValueError, TypeError: as split_model, before any weight is read.
      HelloMismatchError: the two ranks' models differ (both fingerprints named), before
        any weight is read.
    """
    from mlx_lm.utils import load_model, load_tokenizer

    model_path = Path(path)
    # Checked here because mlx-lm takes a path that does not exist for a Hugging Face repo id
    # and would try to download it.
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_path} is not an mlx-lm model directory (no config.json in it); give the "
            f"directory mlx_lm.convert or mlx_ds4tp.synthetic.tiny_model wrote"
        )
    rank, size = rank_and_size(group)
    share = SplitShare.of(split)
    share.check(size)
    agree_model(model_path, group)
    model, config = load_model(model_path, lazy=lazy)
    # The reader's scratch buffers go with it as soon as the split is done (not kept through
    # the tokenizer's load, which would add them to this rank's peak).
    split_model(model, group, split=share, progress=progress,
                read_part=SafetensorsParts(model_path, rank, size, **saved_layout(type(model).__module__))
                if lazy else None)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))

    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    log(f"rank {rank}/{size} holds its part of {model_path}: {nbytes / 2**20:.1f} MiB of weights")
    return model, tokenizer
