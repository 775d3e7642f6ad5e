"""The leader's memo of a part (split/part_memo.py) kept on its disk, so a leader started again
neither plans, traces nor hashes a part it sent before: a small JSON file a part under
$XDG_CACHE_HOME/mlx_ds4tp/leader-memo/ (default ~/.cache; $DS4_TP_LEADER_MEMO_DIR to choose: the
tests and the bench keep theirs apart), named by a digest of the memo's key
and holding that key whole, the part's file plan, its traced layout (each cut array's runs) and
the digests of the part files sent whole.

Never trusted blindly: a file whose key is not the memo's key (the model's files as they are now,
rank, size, share), made by other code (code_stamp), that cannot be read, or that is malformed is
ignored (logged) and the part is planned, traced and hashed again, and the file rewritten. The
worker still checks every digest against the bytes it receives (split/part_receive.py): a digest
from here that the bytes do not match is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..base.log import log
from ..checkpoint.tensor_runs import TensorRuns
from ..collectives.backend import cut_only_group
from .derive import ArrayCut, ShardPlan
from .part_plan import PartPlan, PartTensor, part_file
from .share import UnitCut
from .units import Layout

FORMAT = 2  # bumped when what the file holds changes: an older file is then ignored, rebuilt
MAX_FILES = 64  # memo files kept (each a few kB to a few MB); the least recently written go first


MEMO_DIR_ENV = "DS4_TP_LEADER_MEMO_DIR"


def memo_dir() -> Path:
    chosen = os.environ.get(MEMO_DIR_ENV)
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_ds4tp" / "leader-memo"


def code_stamp() -> list:
    """What made the plan and the trace: MLX's, mlx-lm's and this package's versions, and the
    stats of this package's split code and of mlx-lm's models. A leader started again after an
    upgrade (or an edit: the package is not versioned a commit) could cut the part otherwise
    (other runs, same shapes: bytes its own digests would vouch for), so that memo is not used."""
    import mlx.core as mx
    import mlx_lm

    from .. import __version__

    stamp: list = [mx.__version__, mlx_lm.__version__, __version__]
    for folder in (Path(__file__).parent, Path(mlx_lm.__file__).parent / "models"):
        for path in sorted(folder.glob("*.py")):
            st = path.stat()
            stamp.append([path.name, st.st_size, st.st_mtime_ns])
    return stamp


def _path(key: Tuple[Any, ...]) -> Path:
    return memo_dir() / (hashlib.sha256(json.dumps(key).encode("utf-8")).hexdigest()[:32] + ".json")


def _plan_json(plan: PartPlan) -> dict:
    return {"part_config": plan.part_config.decode("utf-8"),
            "files": [[f.name, [[t.key, t.dtype, list(t.shape), t.nbytes] for t in f.tensors]] for f in plan.files],
            "sources": {path: [key, [[r.file, r.start, r.rows, r.row_bytes, [list(s) for s in r.spans]] for r in runs]]
                        for path, (key, runs) in plan.sources.items()}}


def _plan_of(data: dict) -> PartPlan:
    files = tuple(part_file(name, [PartTensor(k, d, tuple(s), n) for k, d, s, n in tensors])
                  for name, tensors in data["files"])
    sources = {str(path): (str(key), tuple(TensorRuns(str(f), int(start), int(rows), int(row_bytes),
                                                      tuple((int(a), int(b)) for a, b in spans))
                                           for f, start, rows, row_bytes, spans in runs))
               for path, (key, runs) in data["sources"].items()}
    return PartPlan(files, data["part_config"].encode("utf-8"), sources)


def _layout_json(layout: Layout, group: Any) -> dict:
    plan = layout.plan
    own = layout.plan_group is group
    return {
        "cut": list(layout.cut.counts), "rank": layout.rank,
        # the memo's own cut-only group (an even cut), or one of the cut's units
        "plan_group": None if own else [int(layout.plan_group.rank()), int(layout.plan_group.size())],
        "columns": list(layout.columns.counts) if layout.columns is not None else None,
        "column_arrays": sorted(layout.column_arrays),
        "axes": plan.axes,
        "cuts": {p: [list(c.shape), c.axis, [list(r) for r in c.runs]] for p, c in plan.cuts.items()},
        "underived": plan.underived,
        "divided": [[path, attr, value] for (path, attr), value in plan.divided.items()],
        "replaced": plan.replaced,
        "share_bound": plan.share_bound,
    }


def _layout_of(data: dict, group: Any) -> Layout:
    plan = ShardPlan(
        axes={p: int(a) for p, a in data["axes"].items()},
        cuts={p: ArrayCut(p, tuple(shape), int(axis), tuple((int(a), int(b)) for a, b in runs))
              for p, (shape, axis, runs) in data["cuts"].items()},
        underived=list(data["underived"]),
        divided={(path, attr): int(value) for path, attr, value in data["divided"]},
        replaced={p: (None if v is None else float(v)) for p, v in data["replaced"].items()},
        share_bound=list(data["share_bound"]),
    )
    plan_group = group if data["plan_group"] is None else cut_only_group(*map(int, data["plan_group"]))
    columns = UnitCut(tuple(data["columns"])) if data["columns"] is not None else None
    return Layout(UnitCut(tuple(data["cut"])), int(data["rank"]), plan, plan_group, columns,
                  frozenset(data["column_arrays"]))


def load_memo(key: Tuple[Any, ...], group: Any) -> Optional[Tuple[PartPlan, Layout, Dict[str, str]]]:
    """(plan, layout, digests) kept for `key`, or None where there is none to trust."""
    path = _path(key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != json.loads(json.dumps(key)):
            log(f"leader memo {path} is of other model files or another part; planning and tracing again")
            return None
        if data.get("code") != code_stamp():
            log(f"leader memo {path} was made by other code (MLX, mlx-lm or mlx_ds4tp changed since); "
                "planning and tracing again")
            return None
        layout = _layout_of(data["layout"], group)
        digests = {str(k): str(v) for k, v in data["digests"].items()}
        return _plan_of(data["plan"]), layout, digests
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log(f"leader memo {path} cannot be read ({type(e).__name__}: {e}); planning and tracing again")
        return None


def save_memo(key: Tuple[Any, ...], plan: PartPlan, layout: Layout, group: Any,
              digests: Dict[str, str]) -> None:
    """Write the memo of `key` (atomically: a reader sees the old file or the new one); a failure
    is logged, never raised (the next start plans and traces again)."""
    path = _path(key)
    data = {"format": FORMAT, "key": key, "code": code_stamp(), "plan": _plan_json(plan),
            "layout": _layout_json(layout, group), "digests": dict(digests)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)
        kept = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[MAX_FILES:]:
            old.unlink(missing_ok=True)
    except OSError as e:
        log(f"leader memo {path} not written ({e}); a leader started again traces this part again")


__all__ = ["FORMAT", "MAX_FILES", "code_stamp", "load_memo", "memo_dir", "save_memo"]
