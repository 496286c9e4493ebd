"""Checkpoints built by the tests (no model hub) and served by real `pagedserve serve` processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.harness import PAUSE_ARGS, ServeProcess

VOCAB_SIZE = 512
# A plain chat template (the tiny tokenizer has none): BOS, one turn per message ended by EOS,
# and the assistant's header with add_generation_prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
OPENAI_API_KEY = "test-key"


def build_checkpoint(folder: Path, architecture: str, **sizes) -> Path:
    from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
    from pagedserve.checkpoints.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tokenizer

    build_tokenizer(folder, vocab_size=VOCAB_SIZE)
    build_tiny_checkpoint(folder, architecture=architecture, vocab_size=VOCAB_SIZE,
                          bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, seed=1, **sizes)
    return folder


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory) -> Path:
    """Llama with grouped-query attention (4 query heads, 2 KV heads), untied embeddings."""
    return build_checkpoint(tmp_path_factory.mktemp("llama-gqa"), "llama", hidden_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            max_position_embeddings=1024, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    """The Llama checkpoint of llama_checkpoint, its tokenizer_config.json with CHAT_TEMPLATE."""
    folder = build_checkpoint(tmp_path_factory.mktemp("llama-chat"), "llama", hidden_size=64,
                              num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                              max_position_embeddings=1024, tie_word_embeddings=False)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="session")
def qwen2_checkpoint(tmp_path_factory) -> Path:
    """Qwen2 with QKV bias and tied embeddings."""
    return build_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", hidden_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            max_position_embeddings=1024, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def hf_reference():
    """Greedy token ids from Hugging Face transformers `generate`, cached per checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict[Path, object] = {}

    def generate(checkpoint: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        if checkpoint not in models:
            models[checkpoint] = AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=torch.float32).eval()
        model = models[checkpoint]
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, attention_mask=torch.ones(1, len(prompt_ids),
                                                                            dtype=torch.long))
        generated = out[0, len(prompt_ids):].tolist()
        eos = set(model.generation_config.eos_token_id if isinstance(
            model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])
        for i, token in enumerate(generated):
            if token in eos:
                return generated[:i + 1]
        return generated

    return generate


def start_server(checkpoint: Path, tmp_path_factory, name: str, *args: str, **options) -> ServeProcess:
    """A ready `serve` of checkpoint; options go to ServeProcess (credentials, metrics)."""
    log_path = tmp_path_factory.mktemp("logs") / f"{name}.log"
    server = ServeProcess(checkpoint, log_path, list(args), **options)
    try:
        server.wait_ready()
    except Exception:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def llama_server(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "llama", "--num-kv-blocks", "256",
                          "--max-num-batched-tokens", "512", *PAUSE_ARGS, metrics=True)
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


@pytest.fixture(scope="session")
def service_server(llama_checkpoint, tmp_path_factory):
    """One `serve` shared by the service-surface tests (cancellation, validation, fuzz,
    observability): metrics on both processes, a pool small enough that a leak shows, workers that
    a test may pause (harness.ServeProcess.workers_paused)."""
    server = start_server(llama_checkpoint, tmp_path_factory, "service", "--num-kv-blocks", "192",
                          "--max-num-batched-tokens", "512", *PAUSE_ARGS, metrics=True)
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


@pytest.fixture(scope="session")
def openai_server(chat_checkpoint, tmp_path_factory):
    """One `serve` with the OpenAI-compatible HTTP port, shared by the HTTP tests: an API key,
    metrics (the key also guards its gRPC port: the harness's channel sends it), and room for 4 running sequences and 2 waiting requests (so a flood gets 429)."""
    server = start_server(chat_checkpoint, tmp_path_factory, "openai", "--num-kv-blocks", "192",
                          "--max-num-batched-tokens", "512", "--max-num-seqs", "4",
                          "--max-waiting-requests", "2", "--served-model-name", "tiny-chat",
                          "--api-key", OPENAI_API_KEY, *PAUSE_ARGS, metrics=True, http_port=True, api_key=OPENAI_API_KEY)
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


@pytest.fixture(scope="session")
def smollm2_http(tmp_path_factory):
    """One `serve --model smollm2` with its HTTP port, shared by the modules that only send it
    requests (test_responses_api, test_structured_output): each start loads and checks the real
    model for about ten seconds of the suite's run."""
    server = start_server("smollm2", tmp_path_factory, "smollm2-http", "--num-kv-blocks", "512", http_port=True)
    yield server
    assert server.stop() == 0, server.logs()[-3000:]


@pytest.fixture(scope="session")
def smollm2_tools(tmp_path_factory):
    """The same with SmolLM2's tool-call parser and automatic tool choice, shared by
    test_responses_tools and test_tool_calling."""
    server = start_server("smollm2", tmp_path_factory, "smollm2-tools", "--num-kv-blocks", "512",
                          "--tool-call-parser", "smollm2", "--enable-auto-tool-choice", http_port=True)
    yield server
    assert server.stop() == 0, server.logs()[-3000:]
