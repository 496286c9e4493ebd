"""Fixtures of the frontend tests: the tiny tokenizer, a scripted scheduler and a real frontend."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from fake_scheduler import FakeSchedulerServer

from pagedserve.checkpoints.tiny_tokenizer import build_tokenizer
from pagedserve.v1 import generation_pb2_grpc

VOCAB_SIZE = 512


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"), vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_folder):
    from pagedserve.frontend.tokenization.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_folder)


@pytest.fixture(scope="module")
def scheduler_server():
    server = FakeSchedulerServer()
    yield server
    server.stop()


@pytest.fixture()
def fake(scheduler_server):
    scheduler_server.fake.reset()
    return scheduler_server.fake


@pytest.fixture(scope="module")
def frontend(tokenizer_folder, scheduler_server):
    from pagedserve.frontend.config import FrontendConfig
    from pagedserve.frontend.openai.config import HttpConfig
    from pagedserve.frontend.server import serve_frontend
    from pagedserve.launch.serve_config import free_port

    config = FrontendConfig(model_path=str(tokenizer_folder), scheduler_address=scheduler_server.address,
                            host="127.0.0.1", port=0, metrics_port=0, http=HttpConfig(port=free_port()))
    server = serve_frontend(config, health_poll_interval_s=0.1)
    yield server
    server.stop(grace_s=1.0)


@pytest.fixture()
def channel(frontend):
    """A channel to the module's `frontend` fixture (any object with a port)."""
    with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as chan:
        yield chan


@pytest.fixture()
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)
