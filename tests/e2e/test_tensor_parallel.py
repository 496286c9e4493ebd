"""Tensor parallelism through the real processes: `serve --tensor-parallel-size 2` on CPU (gloo).

    sharded     Llama, 8 query / 4 KV heads: every projection split in two (about 65 MB of weights,
                so each rank's memory can be measured against the whole)
    replicated  Qwen2 (QKV bias, tied embeddings), 4 query heads / 1 KV head: the KV head is
                replicated on both ranks

Each checkpoint is served with one rank and with two; the greedy tokens of both must equal Hugging
Face transformers `generate`. A rank killed mid-stream must turn into UNAVAILABLE for the client
and NOT_SERVING for readiness, with nothing left hanging.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.launch.serve_config import free_port
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from pagedserve.security.zmq_curve import curve_env_for, new_curve_env
from tests.e2e.conftest import VOCAB_SIZE, build_checkpoint, start_server
from tests.e2e.harness import READY_SERVICE, is_running, token_request, wait_for

PROMPT_LENGTHS = [1, 17, 40, 130]
MAX_NEW_TOKENS = 16
MIB = 2**20
RSS_MARGIN = 1.15  # a rank's anonymous load RSS may exceed half the single rank's by this factor
UNAVAILABLE_WITHIN_S = 15.0  # the scheduler's heartbeat timeout (10 s) and a margin
HEARTBEAT_TIMEOUT_S = 3.0  # of the scheduler started one by one
SERVE_ARGS = ["--num-kv-blocks", "128", "--max-num-batched-tokens", "256"]


@dataclass
class Run:
    """What one `serve` run of a checkpoint produced."""

    tokens: list[list[int]]
    tensor_parallel_size: int
    loaded: list[dict]  # each rank's model_loaded log event, by rank
    exit_code: int


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {
        "sharded": build_checkpoint(tmp_path_factory.mktemp("tp-sharded"), "llama", hidden_size=512,
                                    num_layers=4, num_heads=8, num_kv_heads=4,
                                    intermediate_size=2048, max_position_embeddings=1024,
                                    tie_word_embeddings=False),
        "replicated": build_checkpoint(tmp_path_factory.mktemp("tp-replicated"), "qwen2",
                                       hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
                                       intermediate_size=128, max_position_embeddings=1024,
                                       tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """(checkpoint name, tensor-parallel size) -> Run; each server is started, asked, stopped."""
    done: dict[tuple[str, int], Run] = {}

    def get(name: str, tp: int) -> Run:
        if (name, tp) not in done:
            server = start_server(checkpoints[name], tmp_path_factory, f"{name}-tp{tp}",
                                  "--tensor-parallel-size", str(tp), *SERVE_ARGS)
            try:
                info = server.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
                with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
                    responses = list(pool.map(lambda ids: server.stub.Generate(
                        token_request(ids, max_tokens=MAX_NEW_TOKENS), timeout=120), _prompts()))
            finally:
                exit_code = server.stop()
            loaded = sorted((event for event in server.log_events()
                             if event.get("event") == "model_loaded"), key=lambda e: e["rank"])
            done[name, tp] = Run([list(r.completions[0].token_ids) for r in responses],
                                 info.tensor_parallel_size, loaded, exit_code)
        return done[name, tp]

    return get


@pytest.mark.parametrize("name", ["sharded", "replicated"])
def test_two_ranks_match_one_rank_and_hf(name, runs, checkpoints, hf_reference):
    expected = [hf_reference(checkpoints[name], prompt, MAX_NEW_TOKENS) for prompt in _prompts()]
    single, double = runs(name, 1), runs(name, 2)
    assert (single.tensor_parallel_size, double.tensor_parallel_size) == (1, 2)
    assert [event["rank"] for event in double.loaded] == [0, 1]
    assert single.exit_code == 0 and double.exit_code == 0
    for length, want, got_one, got_two in zip(PROMPT_LENGTHS, expected, single.tokens, double.tokens):
        assert got_one == want, f"one rank, prompt of {length} tokens"
        assert got_two == want, f"two ranks, prompt of {length} tokens"


def _shard_bytes(checkpoint: Path, world_size: int, replicated: tuple[str, ...]) -> int:
    """Bytes one rank must hold: every tensor split world_size ways, except the norm weights and
    those whose names contain one of `replicated`, which every rank holds whole."""
    from safetensors import safe_open

    total = 0
    with safe_open(checkpoint / "model.safetensors", framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            num_bytes = tensor.numel() * tensor.element_size()
            is_whole = "norm" in name or any(part in name for part in replicated)
            total += num_bytes if is_whole else num_bytes // world_size
    return total


@pytest.mark.parametrize("name, replicated", [("sharded", ()),
                                              ("replicated", ("k_proj", "v_proj"))])
def test_each_rank_reads_and_holds_only_its_shard(name, replicated, runs, checkpoints):
    whole = _shard_bytes(checkpoints[name], 1, ())
    assert runs(name, 1).loaded[0]["num_weight_bytes"] == whole
    expected = _shard_bytes(checkpoints[name], 2, replicated)
    for rank in runs(name, 2).loaded:
        assert rank["num_weight_bytes"] == expected, f"rank {rank['rank']}"
        assert rank["num_checkpoint_bytes_read"] == expected, f"rank {rank['rank']}"


def test_rank_memory_after_load_is_half(runs):
    """Anonymous resident memory each process gained loading its weights (what it allocated; the
    file pages it maps are left out, as their count depends on the page cache): at least the
    rank's weights, and for a rank of two about half of what one rank alone gained."""
    (whole,) = runs("sharded", 1).loaded
    assert whole["num_anon_rss_load_bytes"] >= whole["num_weight_bytes"]
    for rank in runs("sharded", 2).loaded:
        assert rank["num_weight_bytes"] <= 0.5 * whole["num_weight_bytes"] * 1.01
        assert rank["num_anon_rss_load_bytes"] >= rank["num_weight_bytes"]
        assert rank["num_anon_rss_load_bytes"] <= 0.5 * whole["num_anon_rss_load_bytes"] * RSS_MARGIN, (
            f"rank {rank['rank']} grew by {rank['num_anon_rss_load_bytes'] / MIB:.1f} MiB loading "
            f"{rank['num_weight_bytes'] / MIB:.1f} MiB of weights, one rank alone by "
            f"{whole['num_anon_rss_load_bytes'] / MIB:.1f} MiB loading "
            f"{whole['num_weight_bytes'] / MIB:.1f} MiB")


def test_killed_rank_gives_unavailable_and_not_ready(checkpoints, tmp_path_factory):
    server = start_server(checkpoints["replicated"], tmp_path_factory, "replicated-kill",
                          "--tensor-parallel-size", "2", "--max-worker-restarts", "0", *SERVE_ARGS)
    try:
        pids = server.child_pids()
        stream = server.stub.GenerateStream(
            token_request(_prompts()[1], max_tokens=900, ignore_eos=True), timeout=120)
        for _ in range(3):
            next(stream)
        os.kill(pids["worker-1"], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            for _ in stream:
                pass
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value.details()
        assert time.monotonic() - killed_at < UNAVAILABLE_WITHIN_S

        assert wait_for(lambda: server.health() == health_pb2.HealthCheckResponse.NOT_SERVING,
                        timeout=UNAVAILABLE_WITHIN_S)
        assert server.health("") == health_pb2.HealthCheckResponse.SERVING  # the frontend lives on
        with pytest.raises(grpc.RpcError) as refused:
            server.stub.Generate(token_request([5, 6, 7], max_tokens=2), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # The surviving rank cannot run alone: it is stopped, not left blocked in a collective.
        assert wait_for(lambda: not is_running(pids["worker-0"]), timeout=UNAVAILABLE_WITHIN_S)
        # serve logs an exit when its watch loop next reaps the child, not when the rank dies
        assert wait_for(lambda: any(e.get("event") == "child_exited" and e.get("child") == "worker-1"
                                    and e.get("exit_code") == -signal.SIGKILL for e in server.log_events()),
                        timeout=UNAVAILABLE_WITHIN_S), server.logs()[-3000:]
        assert any(e.get("event") == "workers_lost" and e.get("process") == "scheduler" for e in server.log_events())
    finally:
        started = time.monotonic()
        exit_code = server.stop()
    assert exit_code == 1, server.logs()[-3000:]  # serve reports that a worker had died
    assert time.monotonic() - started < 30


class _Processes:
    """`pagedserve scheduler | worker | frontend` started one by one, as compose.yaml does."""

    def __init__(self, log_path: Path) -> None:
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.procs: list[subprocess.Popen] = []
        self.curve_env = {**os.environ, **new_curve_env()}  # the CURVE keys of the tcp:// ZeroMQ link

    def start(self, *args: str) -> subprocess.Popen:
        env = curve_env_for(args[0], self.curve_env)  # each process only the keys of its role
        proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], stdout=self._log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.procs.append(proc)
        return proc

    def stop(self) -> list[int]:
        """Stops them the way `serve` does: frontend, scheduler (which tells the workers to exit),
        then the workers; returns the exit codes in start order."""
        roles = ["frontend", "scheduler", "worker"]
        for role in roles:
            for proc in self.procs:
                if proc.args[3] == role and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    self._wait(proc)
        self._log.close()
        return [proc.returncode for proc in self.procs]

    @staticmethod
    def _wait(proc: subprocess.Popen) -> None:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_ranks_started_one_by_one_recover_after_a_restart(checkpoints, tmp_path):
    """Separate scheduler, worker and frontend processes (the compose layout, on localhost): a
    rank killed while idle is noticed by its missing heartbeats, the scheduler tells the other
    rank to exit, and starting both ranks again serves the same tokens in a new epoch."""
    model = str(checkpoints["replicated"])
    port, scheduler_port, plan_port, result_port, dist_port = (free_port() for _ in range(5))

    def worker(rank: int) -> subprocess.Popen:
        return processes.start(
            "worker", "--model", model, "--rank", str(rank), "--tensor-parallel-size", "2",
            "--plan-address", f"tcp://127.0.0.1:{plan_port}",
            "--result-address", f"tcp://127.0.0.1:{result_port}",
            "--dist-init-address", f"tcp://127.0.0.1:{dist_port}",
            "--device", "cpu", "--dtype", "float32", "--num-threads", "1", "--swap-space", "0.1")

    processes = _Processes(tmp_path / "processes.log")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = generation_pb2_grpc.GenerationStub(channel)
    health = health_pb2_grpc.HealthStub(channel)

    def is_ready() -> bool:
        try:
            return health.Check(health_pb2.HealthCheckRequest(service=READY_SERVICE),
                                timeout=2).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    prompt = _prompts()[2]
    try:
        processes.start("scheduler", "--model", model, "--host", "127.0.0.1",
                        "--port", str(scheduler_port), "--plan-address", f"tcp://*:{plan_port}",
                        "--result-address", f"tcp://*:{result_port}", "--tensor-parallel-size", "2",
                        "--num-kv-blocks", "64", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
        ranks = [worker(0), worker(1)]
        processes.start("frontend", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--http-port", "0",
                        "--scheduler-address", f"127.0.0.1:{scheduler_port}")
        assert wait_for(is_ready, timeout=180), processes.log_path.read_text()[-3000:]
        before = stub.Generate(token_request(prompt, max_tokens=MAX_NEW_TOKENS), timeout=60)

        ranks[1].kill()
        assert wait_for(lambda: not is_ready(), timeout=HEARTBEAT_TIMEOUT_S + 5)
        assert wait_for(lambda: ranks[0].poll() is not None, timeout=HEARTBEAT_TIMEOUT_S + 5)
        assert ranks[0].returncode == 0  # told to exit by the scheduler, not failed

        ranks += [worker(0), worker(1)]
        assert wait_for(is_ready, timeout=180), processes.log_path.read_text()[-3000:]
        after = stub.Generate(token_request(prompt, max_tokens=MAX_NEW_TOKENS), timeout=60)
        assert list(after.completions[0].token_ids) == list(before.completions[0].token_ids)
    finally:
        channel.close()
        exit_codes = processes.stop()
    # scheduler, frontend, the new ranks
    assert exit_codes[0] == 0 and exit_codes[-3:] == [0, 0, 0], (exit_codes, processes.log_path.read_text()[-4000:])
    lost = [json.loads(line) for line in processes.log_path.read_text().splitlines()
            if '"workers_lost"' in line]
    assert len(lost) == 1 and "worker rank 1" in lost[0]["reason"], processes.log_path.read_text()[-4000:]
