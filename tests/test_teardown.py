"""pagedserve/teardown.py: a process whose teardown hangs past the bound ends with exit code 1 and
every thread's stack on stderr; one that exits in time is unaffected; end_process ends a process
past a hanging finalization with its exit code and its output flushed."""

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


# an atexit hook that never returns stands for a hang in the interpreter's finalization, which the
# watchdog does not reach (the interpreter cancels it while finalizing)
HANGING_FINALIZATION = """
import atexit, sys, time
from pagedserve.teardown import end_process

atexit.register(lambda: time.sleep(3600))
print("logged", end="")  # buffered: end_process flushes it
sys.stderr.write("stopped")
end_process({code})
"""


def test_end_process_skips_a_hanging_finalization_and_keeps_the_output_and_exit_code():
    for code in (0, 3):
        done = _run(HANGING_FINALIZATION.replace("{code}", str(code)), 0)
        assert (done.returncode, done.stdout, done.stderr) == (code, "logged", "stopped")


def test_the_process_commands_end_at_once_and_generate_does_not():
    from pagedserve.cli import COMMANDS

    assert {name for name, command in COMMANDS.items() if command.ends_at_once} == {"serve", "scheduler", "frontend",
                                                                                     "worker"}
