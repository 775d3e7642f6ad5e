import atexit
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The leaders the tests start keep their memo of the parts they send (split/part_memo_file.py)
# here, with the children they start, never in the user's ~/.cache.
if not os.environ.get("DS4_TP_LEADER_MEMO_DIR"):
    _memo_dir = tempfile.mkdtemp(prefix="ds4tp-leader-memo-")
    os.environ["DS4_TP_LEADER_MEMO_DIR"] = _memo_dir
    atexit.register(shutil.rmtree, _memo_dir, True)

from pairutil import Procs  # noqa: E402


@pytest.fixture
def procs():
    """Child processes, killed (SIGCONT then SIGKILL) when the test ends."""
    p = Procs()
    yield p
    p.kill_all()


@pytest.fixture
def counted(monkeypatch):
    """mx.distributed.all_sum / all_gather counted as the graph is built (the split plans'
    layers and our vocabulary split both call them); each hands this rank's input back (its
    'peer' holding zeros), so the graph runs in one process."""
    import mlx.core as mx

    calls = {"sums": 0, "gathers": 0}

    def all_sum(x, group=None, stream=None):
        calls["sums"] += 1
        return x

    def all_gather(x, group=None, stream=None):
        calls["gathers"] += 1
        return mx.concatenate([x, mx.zeros_like(x)], axis=0)

    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    monkeypatch.setattr(mx.distributed, "all_gather", all_gather)
    return calls


@pytest.fixture
def bridge(request):
    """Network namespaces on one bridge (test_discovery_link.Bridge; request.param: how many),
    taken down after the test: the discovery, group and doctor tests' machines."""
    from test_discovery_link import Bridge

    link = Bridge(request.param)
    try:
        link.up()
        yield link
    finally:
        link.down()
