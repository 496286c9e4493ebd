"""A child started by `serve` dies with it (pagedserve/launch/parent_death.py), even when serve is killed
with SIGKILL and has no chance to stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.e2e.harness import is_running

PARENT = """
import subprocess, sys, time
from pagedserve.launch.parent_death import child_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_env(None))
print(child.pid, flush=True)
time.sleep(600)
"""
CHILD = """
import time

from tests.e2e.harness import is_running
from pagedserve.launch.parent_death import die_with_parent
die_with_parent()
time.sleep(600)
"""


def test_a_child_gets_sigterm_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        time.sleep(1.0)  # the child has made its request
        assert is_running(child_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while is_running(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_running(child_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
