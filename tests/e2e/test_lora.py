"""LoRA adapters through `serve`: three PEFT adapters and the base model mixed with --max-loras 2.

Each request's greedy tokens must equal transformers + peft `merge_and_unload()` of its adapter
(float32); adapters are evicted from slots and reloaded (counted in the scheduler's metrics); a
prompt served with one adapter is never a prefix-cache hit for another or for the base; two ranks
give the tokens of one; and loading and unloading adapters at runtime changes nothing that streams
already running return.
"""

from __future__ import annotations

import json
import random
import re
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagedserve.testing.lora_adapters import build_peft_adapter, greedy, merged_model
from tests.e2e.conftest import VOCAB_SIZE, build_checkpoint, start_server
from tests.e2e.harness import token_request

MAX_NEW_TOKENS = 12
KEY = "lora-e2e-key"
NAMES = ["a0", "a1", "a2"]


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = build_checkpoint(tmp_path_factory.mktemp("lora-base"), "llama", hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=128, max_position_embeddings=1024,
                            tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("lora-adapters")
    adapters = {name: build_peft_adapter(base, root / name, seed=300 + i) for i, name in enumerate(NAMES)}
    adapters["late"] = build_peft_adapter(base, root / "late", seed=399)
    models = {name: merged_model(base, adapters.get(name)) for name in [None, *NAMES, "late"]}
    return base, adapters, models


def _args(adapters, *extra: str) -> list[str]:
    modules = [f"{name}={adapters[name]}" for name in NAMES]
    return ["--enable-lora", "--lora-modules", *modules, "--max-loras", "2", "--max-lora-rank", "8",
            "--num-kv-blocks", "256", "--max-num-batched-tokens", "256", "--api-key", KEY, *extra]


def _generate(server, prompt: list[int], adapter: str | None, max_tokens: int = MAX_NEW_TOKENS):
    request = token_request(prompt, max_tokens=max_tokens, ignore_eos=True)
    if adapter:
        request.adapter = adapter
    return server.stub.Generate(request, timeout=240)


def _mixed_batch(server, prompts) -> dict[tuple[int, str | None], list[int]]:
    """Every prompt with the base model and each adapter, all at once."""
    jobs = [(index, adapter) for index in range(len(prompts)) for adapter in [None, *NAMES]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = pool.map(lambda job: _generate(server, prompts[job[0]], job[1]), jobs)
        return {job: list(response.completions[0].token_ids) for job, response in zip(jobs, responses)}


def _scheduler_counter(server, name: str) -> float:
    match = re.search(rf"^{name}_total (\S+)$", server.metrics("scheduler"), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def tp1(setup, tmp_path_factory):
    base, adapters, _ = setup
    server = start_server(base, tmp_path_factory, "lora-tp1", *_args(adapters), metrics=True, api_key=KEY)
    yield server
    assert server.stop() == 0, server.logs()[-3000:]


def test_mixed_batch_equals_merged_references_and_slots_are_reloaded(setup, tp1):
    _, _, models = setup
    prompts = _prompts(1, (5, 23, 40))
    tokens = _mixed_batch(tp1, prompts)
    for (index, adapter), generated in tokens.items():
        assert generated == greedy(models[adapter], prompts[index], MAX_NEW_TOKENS), (index, adapter)
    assert len({tuple(generated) for generated in tokens.values()}) == len(tokens)  # adapters matter
    # three adapters in two slots: at least one had to leave its slot for another
    assert _scheduler_counter(tp1, "pagedserve_lora_adapter_evictions") >= 1
    assert _scheduler_counter(tp1, "pagedserve_lora_adapter_loads") >= 3


def test_no_prefix_cache_hit_across_adapters(setup, tp1):
    prompt = _prompts(2, (70,))[0]  # four full blocks of 16
    cached = [_generate(tp1, prompt, adapter, max_tokens=2).usage.cached_prompt_tokens
              for adapter in ("a0", "a1", None, "a0", None)]
    assert cached[:3] == [0, 0, 0] and cached[3] == 64 and cached[4] == 64


def test_unknown_adapter_is_not_found(tp1):
    with pytest.raises(grpc.RpcError) as info:
        _generate(tp1, [5, 6, 7], "nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_two_ranks_equal_one(setup, tp1, tmp_path_factory):
    base, adapters, _ = setup
    prompts = _prompts(3, (9, 33))
    one = _mixed_batch(tp1, prompts)
    server = start_server(base, tmp_path_factory, "lora-tp2", *_args(adapters, "--tensor-parallel-size", "2"),
                          api_key=KEY)
    try:
        assert _mixed_batch(server, prompts) == one
    finally:
        assert server.stop() == 0


def _http(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.http_url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_runtime_load_and_unload_leave_running_streams_alone(setup, tmp_path_factory):
    base, adapters, models = setup
    server = start_server(base, tmp_path_factory, "lora-runtime", *_args(adapters, "--allow-runtime-lora-updating"),
                          api_key=KEY, http_port=True)
    try:
        prompts = _prompts(4, (11, 30, 18))
        streams = [(prompts[0], "a0"), (prompts[1], None), (prompts[2], "a1")]
        received: list[list[int]] = [[] for _ in streams]
        started = threading.Barrier(len(streams) + 1)
        go_on = threading.Event()  # the streams take no more messages until the adapters changed
        errors: list[Exception] = []

        def stream(index: int) -> None:
            prompt, adapter = streams[index]
            request = token_request(prompt, max_tokens=40, ignore_eos=True)
            request.adapter = adapter or ""
            try:
                for number, message in enumerate(server.stub.GenerateStream(request, timeout=240)):
                    received[index].extend(message.completions[0].token_ids if message.completions else [])
                    if number == 0:
                        started.wait(120)
                        go_on.wait(120)
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(streams))]
        for thread in threads:
            thread.start()
        started.wait(120)  # every stream has its first tokens
        assert _http(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})[0] == 200
        assert _http(server, "/v1/unload_lora_adapter", {"lora_name": "a0"})[0] == 200
        late = _generate(server, prompts[0], "late")  # a new adapter served beside the running streams
        go_on.set()
        for thread in threads:
            thread.join(240)
        assert not errors
        for (prompt, adapter), generated in zip(streams, received):
            assert generated == greedy(models[adapter], prompt, 40), adapter
        assert list(late.completions[0].token_ids) == greedy(models["late"], prompts[0], MAX_NEW_TOKENS)
        with pytest.raises(grpc.RpcError) as info:
            _generate(server, prompts[0], "a0")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        status, body = _http(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(base)})
        assert status == 400 and "missing" in body["error"]["message"]
        assert list(_generate(server, prompts[1], None).completions[0].token_ids) == \
            greedy(models[None], prompts[1], MAX_NEW_TOKENS)
    finally:
        assert server.stop() == 0
