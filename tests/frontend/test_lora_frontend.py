"""LoRA adapters at the frontend, against a scripted scheduler: model selection over HTTP and gRPC
(the adapter's ref travels to the scheduler), /v1/models with `parent`, runtime load and unload
behind the API key, and the refusals (unknown 404 / NOT_FOUND, bad adapters 400) while serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.checkpoints.tiny_tokenizer import build_tokenizer
from pagedserve.config.flags import ConfigError
from pagedserve.testing.lora_adapters import build_peft_adapter
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc

KEY = "lora-key"
SIZES = dict(architecture="llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=128, max_position_embeddings=128)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-base")
    build_tokenizer(base, vocab_size=512)
    build_tiny_checkpoint(base, seed=5, **SIZES)
    wider = build_tiny_checkpoint(tmp_path_factory.mktemp("wider"), seed=6, **{**SIZES, "hidden_size": 96})
    root = tmp_path_factory.mktemp("adapters")
    return {"base": base, "sql": build_peft_adapter(base, root / "sql", seed=1),
            "chat": build_peft_adapter(base, root / "chat", seed=2),
            "rank16": build_peft_adapter(base, root / "rank16", seed=3, rank=16),
            "wider": build_peft_adapter(wider, root / "wider", seed=4), "empty": root}


def _config(folders, scheduler_server, **lora):
    from pagedserve.frontend.config import FrontendConfig
    from pagedserve.frontend.lora.config import LoraFrontendConfig
    from pagedserve.frontend.openai.config import HttpConfig
    from pagedserve.launch.serve_config import free_port

    options = dict(enable_lora=True, lora_modules=f"sql={folders['sql']}", max_lora_rank=8,
                   allow_runtime_lora_updating=True)
    return FrontendConfig(model_path=str(folders["base"]), scheduler_address=scheduler_server.address,
                          host="127.0.0.1", port=0, http=HttpConfig(port=free_port(), api_key=KEY),
                          lora=LoraFrontendConfig(**{**options, **lora}))


@pytest.fixture(scope="module")
def lora_frontend(folders, scheduler_server):
    from pagedserve.frontend.server import serve_frontend

    server = serve_frontend(_config(folders, scheduler_server), health_poll_interval_s=0.1)
    yield server
    server.stop(grace_s=1.0)


def _http(frontend, method: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{frontend.http_port}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _complete(frontend, model: str) -> tuple[int, dict]:
    return _http(frontend, "POST", "/v1/completions", {"model": model, "prompt": "the lamp", "max_tokens": 4})


def test_models_lists_adapters_with_their_parent(lora_frontend, folders):
    status, body = _http(lora_frontend, "GET", "/v1/models")
    assert status == 200
    base, sql = body["data"]
    assert base["id"] == folders["base"].name and "parent" not in base
    assert sql["id"] == "sql" and sql["parent"] == base["id"] and sql["root"] == str(folders["sql"].resolve())
    assert _http(lora_frontend, "GET", "/v1/models/sql")[1]["parent"] == base["id"]


def test_http_model_selects_the_adapter_and_the_scheduler_gets_its_digest(lora_frontend, fake, folders):
    from pagedserve.adapters.peft_folder import folder_digest

    status, body = _complete(lora_frontend, "sql")
    assert status == 200 and body["model"] == "sql"
    adapter = fake.submits[-1].adapter
    assert (adapter.name, adapter.path, adapter.digest) == ("sql", str(folders["sql"].resolve()),
                                                           folder_digest(folders["sql"]))
    status, body = _complete(lora_frontend, folders["base"].name)
    assert status == 200 and not fake.submits[-1].HasField("adapter")
    status, body = _complete(lora_frontend, "nope")
    assert status == 404 and body["error"]["code"] == "model_not_found" and "sql" in body["error"]["message"]


def test_grpc_adapter_field(lora_frontend, fake):
    with grpc.insecure_channel(f"127.0.0.1:{lora_frontend.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        metadata = (("authorization", f"Bearer {KEY}"),)
        request = pb.GenerateRequest(prompt="the lamp", params=pb.SamplingParams(max_tokens=3), adapter="sql")
        stub.Generate(request, metadata=metadata, timeout=20)
        assert fake.submits[-1].adapter.name == "sql"
        stub.Generate(pb.GenerateRequest(prompt="the lamp", params=pb.SamplingParams(max_tokens=3)),
                      metadata=metadata, timeout=20)
        assert not fake.submits[-1].HasField("adapter")
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(prompt="x", adapter="nope"), metadata=metadata, timeout=20)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()


def test_runtime_load_and_unload(lora_frontend, fake, folders):
    load = {"lora_name": "chat", "lora_path": str(folders["chat"])}
    assert _http(lora_frontend, "POST", "/v1/load_lora_adapter", load, key=None)[0] == 401
    assert _complete(lora_frontend, "chat")[0] == 404
    status, body = _http(lora_frontend, "POST", "/v1/load_lora_adapter", load)
    assert status == 200 and body["rank"] == 8 and len(body["digest"]) == 64
    assert [card["id"] for card in _http(lora_frontend, "GET", "/v1/models")[1]["data"]][1:] == ["sql", "chat"]
    assert _complete(lora_frontend, "chat")[0] == 200 and fake.submits[-1].adapter.name == "chat"
    status, body = _http(lora_frontend, "POST", "/v1/load_lora_adapter", load)
    assert status == 400 and "already loaded" in body["error"]["message"]
    assert _http(lora_frontend, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})[0] == 200
    assert _complete(lora_frontend, "chat")[0] == 404
    status, body = _http(lora_frontend, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and body["error"]["code"] == "lora_adapter_not_found"


@pytest.mark.parametrize("folder, reason", [
    ("rank16", "above --max-lora-rank 8"), ("wider", "the base model needs"), ("empty", "is missing")])
def test_bad_adapters_are_refused_and_the_server_keeps_serving(lora_frontend, folders, folder, reason):
    status, body = _http(lora_frontend, "POST", "/v1/load_lora_adapter",
                         {"lora_name": folder, "lora_path": str(folders[folder])})
    assert status == 400 and reason in body["error"]["message"] and body["error"]["code"] == "invalid_lora_adapter"
    assert _complete(lora_frontend, folder)[0] == 404
    assert _complete(lora_frontend, "sql")[0] == 200


def test_start_refusals(folders, scheduler_server):
    from pagedserve.frontend.server import FrontendStartError, serve_frontend

    with pytest.raises(FrontendStartError, match="above --max-lora-rank 8"):
        serve_frontend(_config(folders, scheduler_server, lora_modules=f"big={folders['rank16']}"))
    config = _config(folders, scheduler_server)
    keyless = type(config.http)(port=config.http.port)
    from dataclasses import replace
    with pytest.raises(FrontendStartError, match="needs an API key"):
        serve_frontend(replace(config, http=keyless))
    with pytest.raises(ConfigError, match="needs --enable-lora"):
        _config(folders, scheduler_server, enable_lora=False, allow_runtime_lora_updating=False)
    with pytest.raises(ConfigError, match="NAME=PATH"):
        _config(folders, scheduler_server, lora_modules="just-a-path")


def test_without_runtime_updating_the_endpoints_do_not_exist(folders, scheduler_server):
    from pagedserve.frontend.server import serve_frontend

    server = serve_frontend(_config(folders, scheduler_server, allow_runtime_lora_updating=False),
                            health_poll_interval_s=0.1)
    try:
        status, body = _http(server, "POST", "/v1/load_lora_adapter",
                             {"lora_name": "chat", "lora_path": str(folders["chat"])})
        assert status == 404 and body["error"]["code"] == "unknown_url"
    finally:
        server.stop(grace_s=1.0)
