"""guidellm (`guidellm run`, a load generator pagedserve did not write) as a benchmark client: where
its executable is, the command line of one measured point, and the figures read back from its JSON.

    guidellm = find_guidellm()                                   # SystemExit with the install line
    command = point_command(guidellm, Point(Shape(256, 64), 8, seed=1), target=..., model="smollm2",
                            tokenizer=folder, budget=Budget(seconds=60), output=path)
    figures = run_point(command, path, log_path, num_processes=1)

guidellm lives in its own virtual environment, <cache>/guidellm-venv (PAGEDSERVE_CACHE, default
~/.cache/pagedserve), because installing it would change httpx and click in the project's; $GUIDELLM
names another executable. It runs offline: the tokenizer is a local folder and the Hugging Face hub
is switched off in its environment.

One point is `guidellm run` with a concurrent profile (N streams, each sending its next request when
the last one ends), synthetic chat prompts (`synthetic_text`, /v1/chat/completions, streamed) and a
budget of seconds or requests. guidellm asks for the output length with `max_completion_tokens`
and `ignore_eos: true`, so every completed request has exactly the tokens asked for; the figures
say so (`output_tokens_min`, `output_tokens_max`). Figures, all from guidellm's own statistics:

    output_tokens_per_second   output tokens of every request (completed or cut at the end) over
                               the point's measured time, as guidellm's console reports it
    requests_per_second        completed requests over that time
    ttft_p50_ms, ttft_p99_ms   time to first token, over completed requests
    itl_p50_ms, itl_p99_ms     inter-token latency: a request's (last token - first token) /
                               (output tokens - 1), percentiles over completed requests weighted
                               by their token gaps
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pagedserve.cache_root import cache_dir

GUIDELLM_ENV = "GUIDELLM"
VENV_NAME = "guidellm-venv"
RUN_TIMEOUT_MARGIN_S = 300.0  # guidellm's start (imports, tokenizer, prompts) and its report


def default_guidellm() -> Path:
    """$GUIDELLM, else <cache>/guidellm-venv/bin/guidellm."""
    if os.environ.get(GUIDELLM_ENV):
        return Path(os.environ[GUIDELLM_ENV])
    return cache_dir() / VENV_NAME / "bin" / "guidellm"


def install_hint() -> str:
    venv = cache_dir() / VENV_NAME
    return (f"guidellm not found; install it in its own virtual environment (it would change httpx and click "
            f"in the project's): python3 -m venv {venv} && {venv}/bin/python -m pip install guidellm "
            f"(or set ${GUIDELLM_ENV} to a guidellm executable)")


def guidellm_version(binary: Path) -> str:
    result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=120)
    return result.stdout.strip().rsplit(" ", 1)[-1] if result.returncode == 0 else "unknown"


@dataclass(frozen=True)
class Shape:
    """Prompt and output tokens of every request: "256x64"."""

    prompt_tokens: int
    output_tokens: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        prompt, sep, output = text.strip().partition("x")
        if not sep or not prompt.isdigit() or not output.isdigit() or int(prompt) < 1 or int(output) < 1:
            raise ValueError(f"a shape is PROMPTxOUTPUT tokens, both positive, like 256x64: {text!r}")
        return cls(int(prompt), int(output))

    def __str__(self) -> str:
        return f"{self.prompt_tokens}x{self.output_tokens}"


@dataclass(frozen=True)
class Budget:
    """How long one point runs: seconds, or a number of requests (exactly one of them)."""

    seconds: float | None = None
    num_requests: int | None = None

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.num_requests is None):
            raise ValueError("a point's budget is seconds or requests, exactly one of them")
        if any(value is not None and value <= 0 for value in (self.seconds, self.num_requests)):
            raise ValueError("a point's budget must be positive")

    def constraint(self) -> str:
        if self.seconds is not None:
            return f"kind=max_duration,seconds={self.seconds:g}"
        return f"kind=max_requests,count={self.num_requests}"


@dataclass(frozen=True)
class Point:
    shape: Shape
    concurrency: int
    seed: int  # the same for every server at this point, another at every point (no prefix reuse)


@dataclass(frozen=True)
class PointFigures:
    output_tokens_per_second: float
    requests_per_second: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    num_completed: int
    num_incomplete: int
    num_errored: int
    output_tokens_min: float | None  # of completed requests: both equal to the shape's when all went as asked
    output_tokens_max: float | None
    seconds: float
    first_error: str | None
    warnings: list[str]
    client_cpu_seconds: float = 0.0  # guidellm's own CPU time over its whole run (start and report too)
    client_wall_seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def point_command(binary: Path, point: Point, *, target: str, model: str, tokenizer: Path, budget: Budget,
                  output: Path, warmup_fraction: float, body: dict[str, object]) -> list[str]:
    """`guidellm run` for one server at one point; `body` adds fields to every request (sampling);
    the first and last `warmup_fraction` of the point (time or requests) are left out of its figures."""
    extras = ",".join(f"extras.body.{name}={value}" for name, value in body.items())
    transient = (f",warmup.percent={warmup_fraction:g},cooldown.percent={warmup_fraction:g}"
                 if warmup_fraction > 0 else "")
    return [str(binary), "run",
            "--backend", f"kind=openai_http,target={target},model={model},request_format=/v1/chat/completions,"
                         f"stream=true{',' + extras if extras else ''}",
            "--profile", f"kind=concurrent,streams={point.concurrency}{transient}",
            "--data", f"kind=synthetic_text,prompt_tokens={point.shape.prompt_tokens},"
                      f"output_tokens={point.shape.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer},load_kwargs.local_files_only=true",
            "--constraint", budget.constraint(),
            "--seed", f"kind=static,value={point.seed}",
            "--output", f"kind=json,path={output}",
            "--disable-console"]


def run_point(command: list[str], output: Path, log_path: Path, *, num_processes: int, budget: Budget) -> PointFigures:
    """Runs guidellm (its output in log_path) and reads its figures; raises with the log's tail
    when it fails or writes no report."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               GUIDELLM__MAX_WORKER_PROCESSES=str(num_processes))
    timeout = (budget.seconds or 0) * 2 + (budget.num_requests or 0) * 60 + RUN_TIMEOUT_MARGIN_S
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cpu_before, wall_before = _children_cpu_seconds(), time.perf_counter()
    with open(log_path, "wb") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if result.returncode != 0 or not output.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm exited with {result.returncode}; log {log_path}:\n{tail}")
    return replace(read_figures(json.loads(output.read_text())), client_cpu_seconds=_children_cpu_seconds() - cpu_before,
                   client_wall_seconds=time.perf_counter() - wall_before)


def read_figures(report: dict) -> PointFigures:
    """The figures of guidellm's JSON report (one benchmark: one point)."""
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    completed_tokens = metrics["output_token_count"]["successful"]
    errored = benchmark.get("requests", {}).get("errored") or []
    return PointFigures(
        output_tokens_per_second=metrics["output_tokens_per_second"]["total"]["mean"],
        requests_per_second=metrics["requests_per_second"]["successful"]["mean"],
        ttft_p50_ms=_percentile(metrics["time_to_first_token_ms"], "p50"),
        ttft_p99_ms=_percentile(metrics["time_to_first_token_ms"], "p99"),
        itl_p50_ms=_percentile(metrics["inter_token_latency_ms"], "p50"),
        itl_p99_ms=_percentile(metrics["inter_token_latency_ms"], "p99"),
        num_completed=int(totals["successful"]), num_incomplete=int(totals["incomplete"]),
        num_errored=int(totals["errored"]),
        output_tokens_min=completed_tokens["min"] if completed_tokens["count"] else None,
        output_tokens_max=completed_tokens["max"] if completed_tokens["count"] else None,
        seconds=float(benchmark["duration"]),
        first_error=_error_text(errored[0]) if errored else None,
        warnings=[str(warning.get("note") or warning) if isinstance(warning, dict) else str(warning)
                  for warning in benchmark.get("warnings") or []])


def _children_cpu_seconds() -> float:
    """User and system time of this process's ended children (guidellm and its workers, once it exits)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _percentile(summary: dict, name: str) -> float:
    return float(summary["successful"]["percentiles"][name])


def _error_text(request: dict) -> str:
    info = request.get("info") or {}
    return str(info.get("error") or request.get("error") or request)[:500]
