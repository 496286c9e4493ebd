"""Soak test (not CI): many requests of random sizes against `pagedserve serve`, over gRPC and
HTTP, a share of them cut at random moments, then the accounting.

    python bench/soak.py [--requests 10000] [--concurrency 32] [--cancel-fraction 0.2]
                         [--protocol both|grpc|http] [--model demo] [--seed 0]
                         [--num-kv-blocks 2048] [--swap-space 1]
                         [--memory-defaults] [--max-waiting-requests N] [--kill ROLE@FRACTION …]
                         [--serve-args FLAG …]

Starts `serve` on free local ports and sends streaming requests from a thread pool, each over
gRPC (GenerateStream) or HTTP (POST /v1/completions with stream=true: soak_http.py), chosen at
random with --protocol both: prompts of 1 to --max-prompt random token ids, 1 to --max-tokens
output tokens, greedy or seeded sampling, n of 1 or 2. A cancelled request is cut after a random
number of stream messages (zero: before its first): gRPC cancels the call, HTTP closes the
connection. Reported: requests completed, cancelled and failed (any other outcome: expected 0),
resident memory of every process (serve itself and its children) at start (after a warm-up), at
each tenth of the run and at the end, and the block pool once the scheduler is idle (expected
whole: nothing used, free + cached = total, consistent reference counts). A table goes to stdout, JSON to bench/results/. The exit
status is 1 when a request failed or the pool is not whole.

The pool is 2048 blocks by default, which keeps the worker's memory small; --num-kv-blocks 0 uses
the memory-derived size (on a CPU device 10 % of the host's memory, at most 2 GiB: 65536 blocks of
the demo model on a 24 GiB host). --memory-defaults passes neither --num-kv-blocks nor
--swap-space, so the run shows what `serve` takes with its defaults (docs/memory.md). The pool
size does not change the speed (docs/memory.md).

--kill worker-0@0.3 --kill scheduler@0.6 --kill frontend@0.8 SIGKILLs that child of serve once
that share of the requests is done: serve restarts it, the scheduler replays its requests for
restarted workers and the frontend resubmits them to a restarted scheduler, so the run must still
end with no failed request and a whole pool. The streams open on a killed frontend end (gRPC
UNAVAILABLE, HTTP a cut connection): they are counted apart ("cut by the frontend kill"), not as
failures, and the scheduler must have aborted their requests (the pool is whole at the end).
A request refused before its first token (UNAVAILABLE while a replica or the frontend recovers,
RESOURCE_EXHAUSTED when the queue is full; over HTTP 503, 429 or a refused connection) is retried
after a pause, as a client with a retry policy would; the count of such retries is reported
beside the outcomes.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from lib.output import RESULTS_DIR, save_report, timestamp
from lib.soak_http import HttpFailed, HttpRefused, http_stream_once
from pagedserve.launch.serve_process import ServeProcess
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.worker.resident_memory import status_bytes


@dataclass(frozen=True, slots=True)
class SoakRequest:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    n: int
    temperature: float
    seed: int
    cancel_after: int | None  # stream messages to read before cancelling; None: run to the end
    protocol: str = "grpc"  # or "http"

    def message(self) -> pb.GenerateRequest:
        params = pb.SamplingParams(max_tokens=self.max_tokens, n=self.n, temperature=self.temperature,
                                   ignore_eos=True)
        if self.temperature:
            params.seed = self.seed
        return pb.GenerateRequest(request_id=f"soak-{self.index}", params=params,
                                  prompt_token_ids=pb.PromptTokenIds(ids=self.prompt_token_ids))


def make_requests(args, vocab_size: int, first_index: int = 0) -> list[SoakRequest]:
    rng = random.Random(args.seed)
    requests = []
    for index in range(first_index, first_index + args.requests):
        max_tokens = rng.randint(1, args.max_tokens)
        is_cancelled = rng.random() < args.cancel_fraction
        protocol = rng.choice(["grpc", "http"]) if args.protocol == "both" else args.protocol
        requests.append(SoakRequest(
            index=index,
            prompt_token_ids=[rng.randrange(3, vocab_size) for _ in range(rng.randint(1, args.max_prompt))],
            max_tokens=max_tokens, n=rng.choice([1, 1, 1, 2]),
            temperature=rng.choice([0.0, 0.0, 0.8]), seed=rng.randrange(2**31),
            cancel_after=rng.randint(0, max_tokens) if is_cancelled else None, protocol=protocol))
    return requests


def resident_mib(pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """VmRSS (now) and VmHWM (peak) of each process, in MiB."""
    memory = {}
    for role, pid in pids.items():
        fields = status_bytes("VmRSS", "VmHWM", pid=pid)
        memory[role] = {"rss": fields["VmRSS"] / 2**20, "peak": fields["VmHWM"] / 2**20}
    return memory


@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)  # by outcome and by f"{protocol}:{outcome}"
    failures: list[str] = field(default_factory=list)
    num_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: set[int] = field(default_factory=set)  # request indices with a call open now
    on_killed_frontend: set[int] = field(default_factory=set)  # those open when a frontend was killed

    def add(self, outcome: str, num_tokens: int = 0, failure: str = "", protocol: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if protocol:
                self.counts[f"{protocol}:{outcome}"] += 1
            self.num_tokens += num_tokens
            if failure and len(self.failures) < 20:
                self.failures.append(failure)

    def opened(self, index: int) -> None:
        with self.lock:
            self.in_flight.add(index)

    def closed(self, index: int) -> None:
        with self.lock:
            self.in_flight.discard(index)

    def frontend_killed(self) -> None:
        """Called right after a frontend kill: the calls open now were on it."""
        with self.lock:
            self.on_killed_frontend |= self.in_flight

    def fail(self, request: "SoakRequest", failure: str) -> None:
        """A failure, or, for a stream that was open on a killed frontend, its expected end."""
        with self.lock:
            was_on_killed_frontend = request.index in self.on_killed_frontend
        if was_on_killed_frontend:
            self.add("cut_by_frontend_kill", protocol=request.protocol)
        else:
            self.add("failed", 0, f"soak-{request.index} ({request.protocol}): {failure}", request.protocol)


SERVED_NAME = "soak"
RETRYABLE_REFUSALS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
RETRY_WINDOW_S = 120.0
RETRY_BACKOFF_S = 0.25


@dataclass(frozen=True, slots=True)
class Target:
    """Where the requests go: the gRPC stub, and the HTTP port with the served model name."""

    stub: object
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    model: str = ""


def run_one(target: Target, request: SoakRequest, outcomes: Outcomes) -> None:
    """One request to its end. A refusal before the first message (UNAVAILABLE while a replica
    or the frontend recovers, RESOURCE_EXHAUSTED when the queue is full: both safe to retry, see
    docs/operations.md; over HTTP 503, 429 or no connection) is retried after a pause, as a client with a retry
    policy would, for up to RETRY_WINDOW_S; anything that goes wrong once the stream has begun is a
    failure, unless the stream was open on a frontend that was killed."""
    deadline = time.monotonic() + RETRY_WINDOW_S
    while True:
        outcomes.opened(request.index)
        try:
            if request.protocol == "http":
                is_refused, failure = _http_once(target, request, outcomes)
            else:
                num_messages, error = _stream_once(target.stub, request, outcomes)
                is_refused = error is not None and num_messages == 0 and error.code() in RETRYABLE_REFUSALS
                failure = None if error is None else f"{error.code().name}: {error.details()}"
        finally:
            outcomes.closed(request.index)
        if failure is None:
            return
        if is_refused and time.monotonic() < deadline:
            outcomes.add("retried", protocol=request.protocol)
            time.sleep(RETRY_BACKOFF_S)
            continue
        outcomes.fail(request, failure)
        return


def _http_once(target: Target, request: SoakRequest, outcomes: Outcomes) -> tuple[bool, str | None]:
    """(refused before the stream began, the failure), the outcome counted when there is none."""
    try:
        outcome, _, num_tokens = http_stream_once(target.http_host, target.http_port, target.model, request)
    except HttpRefused as exc:
        return True, str(exc)
    except HttpFailed as exc:
        return False, str(exc)
    outcomes.add(outcome, num_tokens, protocol="http")
    return False, None


def _stream_once(stub, request: SoakRequest, outcomes: Outcomes) -> tuple[int, grpc.RpcError | None]:
    """(stream messages read, the error that ended the call when it is not the request's own outcome)."""
    call = stub.GenerateStream(request.message(), timeout=600)
    num_messages = num_tokens = 0
    try:
        if request.cancel_after == 0:
            call.cancel()
        last = None
        for last in call:
            num_messages += 1
            num_tokens += sum(len(c.token_ids) for c in last.completions)
            if request.cancel_after is not None and num_messages >= request.cancel_after:
                call.cancel()
        if last is None or not last.HasField("usage"):
            outcomes.fail(request, "stream ended without usage")
        elif num_tokens != request.max_tokens * request.n:
            outcomes.fail(request, f"{num_tokens} tokens, expected {request.max_tokens * request.n}")
        else:  # includes a cancel that came after the last message
            outcomes.add("completed", num_tokens, protocol="grpc")
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and request.cancel_after is not None:
            outcomes.add("cancelled", num_tokens, protocol="grpc")
        else:
            return num_messages, exc
    return num_messages, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--protocol", choices=("both", "grpc", "http"), default="both",
                        help="how each request is sent (both: gRPC or HTTP at random)")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="0: the memory-derived size")
    parser.add_argument("--swap-space", type=float, default=1.0, metavar="GIB")
    parser.add_argument("--memory-defaults", action="store_true",
                        help="serve's own pool and swap sizes (ignores --num-kv-blocks and --swap-space)")
    parser.add_argument("--max-waiting-requests", type=int, default=4096)
    parser.add_argument("--kill", action="append", default=[], metavar="ROLE@FRACTION",
                        help="SIGKILL serve's child ROLE (scheduler, worker-0, frontend, …) once FRACTION "
                             "of the requests are done (repeatable)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="further `serve` flags (last on the command line)")
    args = parser.parse_args(argv)

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = timestamp()
    memory_args = [] if args.memory_defaults else [
        "--swap-space", str(args.swap_space), *(["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else [])]
    serve_args = ["--max-waiting-requests", str(args.max_waiting_requests), "--served-model-name", SERVED_NAME,
                  *memory_args, *args.serve_args]
    serve = ServeProcess(args.model, RESULTS_DIR / f"soak-{stamp}.log", serve_args, ready_timeout=600,
                         http_port=args.protocol != "grpc")
    try:
        serve.wait_ready()
        target = Target(serve.stub, http_port=serve.http_port, model=SERVED_NAME)
        info = serve.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
        requests = make_requests(args, info.vocab_size)
        outcomes = Outcomes()
        for request in make_requests(argparse.Namespace(**{**vars(args), "requests": 64, "seed": -1,
                                                            "cancel_fraction": 0.0}), info.vocab_size,
                                     first_index=args.requests):
            run_one(target, request, Outcomes())  # warm-up, not counted
        pids = {"serve": serve.proc.pid, **serve.child_pids()}
        memory = {"start": resident_mib(pids)}
        started = time.monotonic()
        milestones = {len(requests) * k // 10 for k in range(1, 10)}
        kills = sorted((max(1, int(float(fraction) * len(requests))), role)
                       for role, fraction in (spec.split("@") for spec in args.kill))
        killed = []
        with ThreadPoolExecutor(args.concurrency) as pool:
            futures = [pool.submit(run_one, target, request, outcomes) for request in requests]
            for done, future in enumerate(futures, 1):
                future.result()
                while kills and done >= kills[0][0]:
                    _, role = kills.pop(0)
                    pid = serve.child_pids()[role]
                    os.kill(pid, signal.SIGKILL)
                    if role == "frontend":
                        outcomes.frontend_killed()
                    killed.append({"role": role, "pid": pid, "after_requests": done,
                                   "seconds": round(time.monotonic() - started, 1)})
                    print(f"  killed {role} (pid {pid}) after {done} requests", flush=True)
                if done in milestones:
                    pids = {"serve": serve.proc.pid, **serve.child_pids()}
                    memory[f"{done}"] = resident_mib(pids)
                    print(f"  {done:>6} requests  {time.monotonic() - started:7.1f}s  "
                          + "  ".join(f"{role} {m['rss']:.0f} MiB" for role, m in memory[f"{done}"].items()),
                          flush=True)
        seconds = time.monotonic() - started
        try:
            stats = serve.wait_idle(120)
        except TimeoutError:
            stats = serve.stats()
        memory["end"] = resident_mib({"serve": serve.proc.pid, **serve.child_pids()})
        pool = {name: getattr(stats, f"num_gpu_blocks_{name}") for name in ("total", "free", "used", "cached")}
        is_pool_whole = (stats.is_pool_consistent and stats.num_gpu_blocks_used == 0 and stats.num_cpu_blocks_used == 0
                         and pool["free"] + pool["cached"] == pool["total"])
    finally:
        code = serve.stop(120)

    report = {
        "requests": args.requests, "concurrency": args.concurrency, "cancel_fraction": args.cancel_fraction,
        "model": args.model, "seconds": round(seconds, 1), "tokens": outcomes.num_tokens,
        "completed": outcomes.counts["completed"], "cancelled": outcomes.counts["cancelled"],
        "failed": outcomes.counts["failed"], "retried": outcomes.counts["retried"],
        "cut_by_frontend_kill": outcomes.counts["cut_by_frontend_kill"], "protocol": args.protocol,
        "by_protocol": {key: value for key, value in sorted(outcomes.counts.items()) if ":" in key},
        "failures": outcomes.failures, "memory_mib": memory,
        "pool": {**pool, "cpu_used": stats.num_cpu_blocks_used, "is_consistent": stats.is_pool_consistent,
                 "is_whole": is_pool_whole},
        "serve_exit_code": code, "killed": killed,
    }
    print(f"\nsoak: {args.requests} requests ({args.protocol}), concurrency {args.concurrency}, "
          f"{args.cancel_fraction:.0%} cancelled at random, model {args.model}, {seconds:.0f}s, "
          f"{outcomes.num_tokens} tokens")
    print(f"  completed {report['completed']}  cancelled {report['cancelled']}  failed {report['failed']}  "
          f"(refusals before the first token, retried: {report['retried']})")
    print(f"  cut by the frontend kill (open on it, counted apart): {report['cut_by_frontend_kill']}")
    print("  by protocol: " + "  ".join(f"{key} {value}" for key, value in report["by_protocol"].items()))
    for kill in killed:
        print(f"  killed {kill['role']} (pid {kill['pid']}) after {kill['after_requests']} requests, {kill['seconds']}s")
    for failure in outcomes.failures:
        print(f"    {failure}")
    print(f"  {'process':<12}{'RSS start':>12}{'RSS end':>12}{'peak':>12}   (MiB)")
    for role in memory["start"].keys() & memory["end"].keys():
        print(f"  {role:<12}{memory['start'][role]['rss']:>12.0f}{memory['end'][role]['rss']:>12.0f}"
              f"{memory['end'][role]['peak']:>12.0f}")
    print(f"  pool at the end: {pool['used']} used, {pool['free']} free + {pool['cached']} cached of "
          f"{pool['total']}, consistent {stats.is_pool_consistent} -> {'whole' if is_pool_whole else 'NOT WHOLE'}")
    print(f"  serve exited with {code}")
    (out,) = save_report(f"soak-{stamp}", report)
    print(f"  -> {out}")
    return 0 if report["failed"] == 0 and is_pool_whole else 1


if __name__ == "__main__":
    sys.exit(main())
