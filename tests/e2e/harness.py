"""Starts `pagedserve serve` as a user would (a real process tree) and talks to it over gRPC."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pagedserve.internal import scheduler_pb2
from pagedserve.launch.serve_process import READY_SERVICE, ServeProcess as _ServeProcess
from pagedserve.v1 import generation_pb2


class ServeProcess(_ServeProcess):
    """`serve` on the CPU in float32 (the HF-equality oracle's precision; `--dtype auto` would pick
    bfloat16 on CPUs with native bfloat16) with a small swap space (preemption tests swap into it)."""

    def __init__(self, model: str | Path, log_path: Path, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, **options) -> None:
        super().__init__(model, log_path, ["--dtype", "float32", "--swap-space", "0.25", *(extra_args or [])], env, **options)

    def log_events(self) -> list[dict]:
        """The JSON log events of every process of the tree, parsed."""
        return parse_log_events(self.logs())

    def log_events_named(self, name: str) -> int:
        """How many log events of that name the tree has written."""
        return sum(event["event"] == name for event in self.log_events())


def token_request(prompt_token_ids: list[int], **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.PromptTokenIds(ids=prompt_token_ids),
        params=generation_pb2.SamplingParams(**params))


def text_request(prompt: str, **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt,
                                          params=generation_pb2.SamplingParams(**params))


def stream_tokens(server, prompt: list[int], received: list[int], errors: list[Exception], *,
                  max_tokens: int, timeout: float = 240) -> None:
    """Streams one greedy request (EOS ignored) into received; an error goes to errors (for
    threads, whose test thread reports it)."""
    try:
        for message in server.stub.GenerateStream(
                token_request(prompt, max_tokens=max_tokens, ignore_eos=True), timeout=timeout):
            for completion in message.completions:
                received.extend(completion.token_ids)
    except Exception as exc:
        errors.append(exc)


def parse_log_events(text: str) -> list[dict]:
    """JSON objects of a log several processes wrote to: one per line, except where a process
    left its line unterminated (it exited mid-line) and another's follows on the same line."""
    decoder = json.JSONDecoder()
    events = []
    for line in text.splitlines():
        position = line.find("{")
        while position != -1:
            try:
                event, end = decoder.raw_decode(line, position)
            except json.JSONDecodeError:
                end = position + 1
            else:
                if isinstance(event, dict) and "event" in event:
                    events.append(event)
            position = line.find("{", end)
    return events


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Polls predicate until it is true (True) or timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def assert_pool_whole(server: ServeProcess, timeout: float = 30.0) -> scheduler_pb2.SchedulerStats:
    """Waits until the scheduler is idle, then requires every block back: none used on GPU or
    CPU, free + cached = total, and consistent reference counts."""
    stats = server.wait_idle(timeout)
    assert stats.is_pool_consistent, stats
    assert stats.num_gpu_blocks_used == 0 and stats.num_cpu_blocks_used == 0, stats
    assert stats.num_gpu_blocks_free + stats.num_gpu_blocks_cached == stats.num_gpu_blocks_total, stats
    return stats
