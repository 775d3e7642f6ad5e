import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pairutil import Procs  # noqa: E402


@pytest.fixture
def procs():
    """Child processes, killed (SIGCONT then SIGKILL) when the test ends."""
    p = Procs()
    yield p
    p.kill_all()
