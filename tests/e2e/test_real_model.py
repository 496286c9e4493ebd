"""The real model end to end: `pagedserve serve --model smollm2` takes the frontend's tokenizer, the
scheduler's model info and the worker's weights from one GGUF file, and answers a chat question.

A gRPC client that applies the model's chat template itself (its tokenizer from the resolved model)
and sends the prompt as text, one that sends chat messages for the server to render, the
`pagedserve generate --chat` console script, and the official `openai` client over the
OpenAI-compatible HTTP API all get the same answer. serve runs with its default precision and
weights (what a user gets: bfloat16 on CPUs that compute it natively), not the float32 of the
HF-equality tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from openai import OpenAI

from pagedserve.checkpoints.resolve import resolve_model
from pagedserve.frontend.tokenization.tokenizer import load_tokenizer
from pagedserve.v1 import generation_pb2
from pagedserve.launch.serve_process import ServeProcess
from tests.e2e.harness import text_request

QUESTION = "What is the capital of France?"


def test_smollm2_answers_a_chat_question(tmp_path):
    tokenizer = load_tokenizer(resolve_model("smollm2"))  # fetched once and cached, as serve does
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    server = ServeProcess("smollm2", tmp_path / "serve.log", ["--num-kv-blocks", "512"], http_port=True)
    # the default weights: the GGUF's Q4_1 blocks kept exactly (--quantization auto)
    try:
        server.wait_ready()
        info = server.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
        assert (info.model_name, info.vocab_size, info.max_model_len) == ("SmolLM2-135M-Instruct.Q4_1", 49152, 8192)
        assert list(info.eos_token_ids) == list(tokenizer.eos_token_ids)
        tokens = server.stub.Tokenize(generation_pb2.TokenizeRequest(text=prompt), timeout=10).token_ids
        assert list(tokens) == tokenizer.encode(prompt)
        response = server.stub.Generate(text_request(prompt, max_tokens=20, temperature=0), timeout=120)
        completion = response.completions[0]
        assert "Paris" in completion.text, completion.text
        assert completion.finish_reason == generation_pb2.FINISH_REASON_STOP
        assert response.usage.prompt_tokens == len(tokens)

        messages = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content=QUESTION)])
        rendered = server.stub.Generate(generation_pb2.GenerateRequest(
            messages=messages, params=generation_pb2.SamplingParams(max_tokens=20, temperature=0)), timeout=120)
        assert rendered.completions[0].text == completion.text
        assert rendered.usage.prompt_tokens == len(tokens)

        cli = Path(sys.executable).with_name("pagedserve")
        command = [str(cli)] if cli.exists() else [sys.executable, "-m", "pagedserve.cli"]
        result = subprocess.run([*command, "generate", "--address", server.address, "--chat", QUESTION],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "Paris" in result.stdout and result.stdout.strip().startswith(completion.text.strip()), result.stdout

        client = OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=20, temperature=0)
        assert chat.choices[0].message.content == completion.text
        assert chat.choices[0].finish_reason == "stop"
        assert chat.usage.prompt_tokens == len(tokens)
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
