"""pagedserve.launch.serve_process: a tree whose starting process dies without stopping it stops too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.harness import is_running, parse_log_events, wait_for

STARTER = """
import json, os, signal, sys
from pathlib import Path
from pagedserve.launch.serve_process import ServeProcess
server = ServeProcess(sys.argv[1], Path(sys.argv[2]), ["--num-kv-blocks", "64"])
server.wait_ready()
print(json.dumps({"serve": server.proc.pid, **server.child_pids()}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no stop(), no atexit
"""


def test_a_tree_stops_when_its_starter_is_killed_without_stopping_it(llama_checkpoint, tmp_path):
    starter = subprocess.run([sys.executable, "-c", STARTER, str(llama_checkpoint), str(tmp_path / "serve.log")],
                             capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert starter.returncode == -9, starter.stderr[-3000:]
    pids = json.loads(starter.stdout.strip().splitlines()[-1])
    assert set(pids) >= {"serve", "scheduler", "worker-0", "frontend"}
    try:
        assert wait_for(lambda: not any(is_running(pid) for pid in pids.values()), timeout=60), \
            (tmp_path / "serve.log").read_text()[-3000:]
        events = parse_log_events((tmp_path / "serve.log").read_text())
        assert any(e.get("event") == "stopping" and e.get("signal") == "SIGTERM" for e in events)
    finally:
        for pid in pids.values():
            if is_running(pid):
                os.kill(pid, 9)
