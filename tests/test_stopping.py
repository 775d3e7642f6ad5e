"""base/stopping.py: SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, the first is
named for the stopped command's last line, and a stop under way (shielded) is not cut short by
another signal. Each case in a fresh interpreter: the handlers are the process's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pairutil import REPO

SCRIPT = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from mlx_ds4tp.base.stopping import shielded, stop_on_signals, stop_reason
stop_on_signals()
try:
    os.kill(os.getpid(), signal.{first})
    signal.pause()
except KeyboardInterrupt:
    with shielded():
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while stopping: recorded only
        print("finished the stop")
    print(stop_reason())
"""


@pytest.mark.parametrize("first, named", [("SIGTERM", "SIGTERM"), ("SIGINT", "SIGINT (Ctrl-C)")])
def test_a_stop_signal_interrupts_once_and_is_named(first, named):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=REPO, first=first)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["finished the stop", named], out
