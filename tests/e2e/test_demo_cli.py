"""A fresh machine serves the built-in demo model and `pagedserve generate` streams from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.harness import ServeProcess


def test_demo_serve_and_generate_cli(tmp_path):
    env = {"PAGEDSERVE_CACHE": str(tmp_path / "cache")}
    server = ServeProcess("demo", tmp_path / "serve.log", env=env)
    try:
        server.wait_ready()
        assert (tmp_path / "cache").is_dir()
        cli = Path(sys.executable).with_name("pagedserve")
        command = [str(cli)] if cli.exists() else [sys.executable, "-m", "pagedserve.cli"]
        result = subprocess.run([*command, "generate", "--address", server.address,
                                 "--max-tokens", "12", "Hello"],
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, **env})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip(), "no text was streamed"
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
