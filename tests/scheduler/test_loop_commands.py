"""LoopCommands (scheduler/loop_commands.py): a posted command wakes the loop and calls on_command
(the engine ends a decode run with it); a read wakes the loop without it, runs after the commands
posted before it, hands back its result or exception, and times out when the loop never applies it."""

from __future__ import annotations

import threading

import pytest

from pagedserve.scheduler.loop_commands import LoopCommands


def test_commands_call_on_command_and_reads_do_not():
    calls: list = []
    commands = LoopCommands(on_command=lambda: calls.append("on_command"))
    commands.post(lambda: calls.append("first"))
    assert calls == ["on_command"] and commands.wakeup.is_set() and commands.has_commands()
    commands.wakeup.clear()
    result: list = []
    reader = threading.Thread(target=lambda: result.append(commands.read(lambda: calls.append("read") or 7, 5)))
    reader.start()
    assert commands.wakeup.wait(5)
    commands.post(lambda: calls.append("second"))  # posted after the read, applied before it all the same
    commands.apply()
    reader.join(5)
    assert calls == ["on_command", "on_command", "first", "second", "read"] and result == [7]
    assert not commands.has_commands()


def test_a_read_raises_what_fn_raises_and_times_out_when_never_applied():
    commands = LoopCommands(on_command=lambda: None)
    failures: list = []

    def read_failing():
        try:
            commands.read(lambda: 1 / 0, 5)
        except ZeroDivisionError as exc:
            failures.append(exc)

    reader = threading.Thread(target=read_failing)
    reader.start()
    assert commands.wakeup.wait(5)
    while reader.is_alive():
        commands.apply()
        reader.join(0.01)
    assert len(failures) == 1
    with pytest.raises(TimeoutError):
        LoopCommands(on_command=lambda: None).read(lambda: None, 0.05)
