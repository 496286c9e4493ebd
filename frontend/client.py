"""`pagedserve generate [--address HOST:PORT] [--chat] PROMPT`: streams a completion's text to the terminal."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

import grpc

from pagedserve.config.flags import option
from pagedserve.config.shared_options import DEFAULT_HOST, DEFAULT_PORT
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

_FINISH_NAMES = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
}


@dataclass(kw_only=True, slots=True)
class GenerateOptions:
    prompt: str = option(flag="prompt", help="the prompt text")
    address: str = option(f"{DEFAULT_HOST}:{DEFAULT_PORT}", metavar="HOST:PORT",
                          help="a frontend's public gRPC address")
    max_tokens: int = option(64, metavar="N", help="tokens to generate at most (0: the server's default)")
    temperature: float = option(0.0, help="sampling temperature (0: greedy)")
    seed: int | None = option(None, help="seed of the sampling, for a repeatable completion")
    chat: bool = option(False, help="send the prompt as a user's chat message: the server applies the "
                                    "model's chat template and the answer is the assistant's reply")

    def request(self) -> generation_pb2.GenerateRequest:
        params = generation_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature)
        if self.seed is not None:
            params.seed = self.seed
        if self.chat:
            messages = generation_pb2.ChatMessages(
                messages=[generation_pb2.ChatMessage(role="user", content=self.prompt)])
            return generation_pb2.GenerateRequest(messages=messages, params=params)
        return generation_pb2.GenerateRequest(prompt=self.prompt, params=params)


def generate_cli(options: GenerateOptions, *, timeout: float | None = None,
                 out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Streams the text of one completion to `out` as it arrives; a summary line goes to `err`.
    Returns the exit code: 0, 1 on an RPC error, 2 on invalid arguments."""
    out = out or sys.stdout
    err = err or sys.stderr
    request = options.request()
    finish_reason = generation_pb2.FINISH_REASON_UNSPECIFIED
    usage = None
    with grpc.insecure_channel(options.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for message in stub.GenerateStream(request, timeout=timeout, wait_for_ready=False):
                for completion in message.completions:
                    if completion.text:
                        out.write(completion.text)
                        out.flush()
                    if completion.finish_reason:
                        finish_reason = completion.finish_reason
                if message.HasField("usage"):
                    usage = message.usage
        except grpc.RpcError as exc:
            out.write("\n")
            err.write(f"pagedserve generate: {exc.code().name}: {exc.details()}\n")
            return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    out.write("\n")
    out.flush()
    summary = f"[finish_reason={_FINISH_NAMES.get(finish_reason, 'unspecified')}"
    if usage is not None:
        summary += f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
    err.write(summary + "]\n")
    return 0
