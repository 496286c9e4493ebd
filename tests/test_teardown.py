"""pagedserve/teardown.py: a process whose teardown hangs past the bound ends with exit code 1 and
every thread's stack on stderr; one that exits in time is unaffected."""

from __future__ import annotations

import subprocess
import sys

# a non-daemon thread that never ends: the interpreter's exit waits for it forever
HANGING_EXIT = """
import threading, time
from pagedserve.teardown import bound_teardown

def never_ends():
    while True:
        time.sleep(0.05)

threading.Thread(target=never_ends, name="never-ends").start()
bound_teardown({timeout})
"""

CLEAN_EXIT = """
from pagedserve.teardown import bound_teardown
bound_teardown({timeout})
print("done")
"""


def _run(code: str, timeout: float) -> subprocess.CompletedProcess:
    """Without the watchdog the hanging child would never end: subprocess.run's own timeout fails the test."""
    return subprocess.run([sys.executable, "-c", code.format(timeout=timeout)], capture_output=True, text=True,
                          timeout=60)


def test_a_hanging_teardown_ends_with_the_stacks_and_exit_code_1():
    done = _run(HANGING_EXIT, 1.0)
    assert done.returncode == 1
    assert "never_ends" in done.stderr  # the hanging thread's stack
    assert "Timeout (0:00:01)" in done.stderr


def test_a_clean_exit_is_unaffected():
    done = _run(CLEAN_EXIT, 5.0)
    assert (done.returncode, done.stdout, done.stderr) == (0, "done\n", "")
