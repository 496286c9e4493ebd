"""Sampling defaults from the model (--generation-config): what reaches the scheduler when a
request leaves a field out, over HTTP and gRPC, against a scripted scheduler."""

from __future__ import annotations

import json
import shutil
import urllib.request

import grpc
import pytest
from openai import OpenAI

from pagedserve.checkpoints.generation_defaults import (
    KNOWN_MODELS, NEUTRAL, GenerationConfigError, load_sampling_defaults,
)
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}


@pytest.fixture(scope="module")
def model_folder(tokenizer_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("with-defaults") / "model"
    shutil.copytree(tokenizer_folder, folder)
    (folder / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    return folder


def _start(model_folder, scheduler_server, mode: str):
    from pagedserve.frontend.config import FrontendConfig
    from pagedserve.frontend.openai.config import HttpConfig
    from pagedserve.frontend.server import serve_frontend
    from pagedserve.launch.serve_config import free_port

    config = FrontendConfig(model_path=str(model_folder), scheduler_address=scheduler_server.address,
                            host="127.0.0.1", port=0, http=HttpConfig(port=free_port()), generation_config=mode)
    return serve_frontend(config, health_poll_interval_s=0.1)


def _sent(fake, submit) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) of the request that `submit` makes reach the scheduler."""
    before = len(fake.submits)
    submit()
    sampling = fake.submits[before].sampling
    return round(sampling.temperature, 4), round(sampling.top_p, 4), sampling.top_k


def _both_protocols(server, fake):
    client = OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="-", max_retries=0, timeout=20)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        grpc_default = _sent(fake, lambda: stub.Generate(generation_pb2.GenerateRequest(
            prompt="hello", params=generation_pb2.SamplingParams(max_tokens=4)), timeout=20))
        grpc_greedy = _sent(fake, lambda: stub.Generate(generation_pb2.GenerateRequest(
            prompt="hello", params=generation_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=20))
    http_default = _sent(fake, lambda: client.completions.create(model="model", prompt="hello", max_tokens=4))
    http_set = _sent(fake, lambda: client.completions.create(model="model", prompt="hello", max_tokens=4,
                                                             temperature=0.0, top_p=0.5, extra_body={"top_k": -1}))
    card = json.load(urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v1/models", timeout=10))
    return grpc_default, grpc_greedy, http_default, http_set, card["data"][0]["sampling_defaults"]


def test_a_request_without_temperature_uses_the_models_default(model_folder, scheduler_server, fake):
    server = _start(model_folder, scheduler_server, "auto")
    try:
        grpc_default, grpc_greedy, http_default, http_set, shown = _both_protocols(server, fake)
    finally:
        server.stop(grace_s=1.0)
    assert grpc_default == http_default == (0.6, 0.95, 20)
    assert grpc_greedy == (0.0, 0.95, 20)  # a value set, 0 included, is the request's
    assert http_set == (0.0, 0.5, 0)
    assert shown == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                     "source": str(model_folder / "generation_config.json")}


def test_generation_config_vllm_keeps_the_neutral_defaults(model_folder, scheduler_server, fake):
    server = _start(model_folder, scheduler_server, "vllm")
    try:
        grpc_default, grpc_greedy, http_default, http_set, shown = _both_protocols(server, fake)
    finally:
        server.stop(grace_s=1.0)
    assert grpc_default == grpc_greedy == (0.0, 1.0, 0)  # proto3 zeros: greedy
    assert http_default == (1.0, 1.0, 0)  # OpenAI's
    assert http_set == (0.0, 0.5, 0)
    assert shown == {"source": NEUTRAL.source}


def test_generation_config_folder_and_known_models(tokenizer_folder, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "repetition_penalty": 1.1,
                                                              "top_k": -1}))
    defaults = load_sampling_defaults(str(other), tokenizer_folder)
    assert defaults.fields() == {"temperature": 0.3, "repetition_penalty": 1.1, "top_k": 0}
    # a folder without sampling fields: neutral, unless the served name is a known model's
    assert load_sampling_defaults("auto", tokenizer_folder) == NEUTRAL
    assert load_sampling_defaults("auto", tokenizer_folder, "smollm2") == KNOWN_MODELS["smollm2"]
    assert KNOWN_MODELS["smollm2"].fields() == {"temperature": 0.2, "top_p": 0.9}
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        load_sampling_defaults(str(tmp_path / "missing"), tokenizer_folder)
    (other / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(GenerationConfigError, match="top_p 1.5 is out of range"):
        load_sampling_defaults(str(other), tokenizer_folder)


def test_beam_search_takes_no_sampling_defaults():
    from pagedserve.frontend.grpc.validation import sampling_params_from_proto
    from pagedserve.frontend.openai.protocol import CompletionBody, generation_plan

    defaults = KNOWN_MODELS["smollm2"]
    params = sampling_params_from_proto(generation_pb2.SamplingParams(beam_width=2), defaults)
    assert (params.temperature, params.top_p) == (0.0, 1.0)
    plan = generation_plan(CompletionBody(prompt="x", use_beam_search=True, n=2), defaults)
    assert (plan.params.temperature, plan.params.top_p) == (0.0, 1.0)
    plan = generation_plan(CompletionBody(prompt="x"), defaults)
    assert (plan.params.temperature, plan.params.top_p) == (0.2, 0.9)


def test_a_gguf_files_sampling_metadata(tmp_path):
    from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
    from pagedserve.testing.tiny_gguf import write_gguf

    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", architecture="llama", vocab_size=64, hidden_size=32,
                                       num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=48)
    plain = write_gguf(checkpoint, tmp_path / "plain.gguf")
    assert load_sampling_defaults("auto", plain) == NEUTRAL
    sampled = write_gguf(checkpoint, tmp_path / "sampled.gguf", extra_metadata={
        "general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.penalty_repeat": 1.25})
    defaults = load_sampling_defaults("auto", sampled, "smollm2")  # the file's own win over a known model's
    assert defaults.fields() == {"temperature": pytest.approx(0.7), "top_k": 40, "repetition_penalty": 1.25}
    assert load_sampling_defaults("vllm", sampled) == NEUTRAL
