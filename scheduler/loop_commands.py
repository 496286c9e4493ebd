"""Work other threads hand to the step loop thread (scheduler/engine.py), which alone touches the
Scheduler:

    commands   change the requests (submit, abort, finish a completion): posting one wakes the
               loop and calls `on_command`, with which the engine ends a decode run in flight
               after its current step (worker_link.py EndRun), so the change waits one step
    reads      look at the state (Engine.call, GetStats): they wake an idle loop but end no run,
               and run after the commands posted before them, once the run in flight has ended

The loop applies both between steps (`apply`), commands first.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable


class LoopCommands:
    def __init__(self, on_command: Callable[[], None]) -> None:
        self.wakeup = threading.Event()  # set by every post and read; the idle loop waits on it
        self._on_command = on_command
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, command: Callable[[], object]) -> None:
        """A command for the loop thread (module doc)."""
        self._commands.put(command)
        self.wakeup.set()
        self._on_command()

    def read(self, fn: Callable[[], object], timeout: float) -> object:
        """fn's result, run on the loop thread between steps (module doc); TimeoutError when the
        loop did not run it within timeout seconds; what fn raises is raised here."""
        done = threading.Event()
        box: list = []

        def run() -> None:
            try:
                box.append(fn())
            except Exception as exc:  # handed back to the caller's thread
                box.append(exc)
            done.set()

        self._reads.put(run)
        self.wakeup.set()
        if not done.wait(timeout):
            raise TimeoutError("the step loop did not answer in time")
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def has_commands(self) -> bool:
        """Whether a command waits (a read does not count)."""
        return not self._commands.empty()

    def apply(self) -> None:
        """On the loop thread: every command waiting, then every read."""
        for pending in (self._commands, self._reads):
            while True:
                try:
                    command = pending.get_nowait()
                except queue.Empty:
                    break
                command()
