"""The Responses endpoint's cost against chat completions, and what the model's sampling defaults
change for a client that leaves temperature out.

    python bench/responses_api.py [--rounds 8] [--max-tokens 48]

overhead  `serve --model smollm2` (default flags, --generation-config auto): the same greedy
          question through `chat.completions.create` and `responses.create` (official client),
          alternated --rounds times after one warm-up each; median latency of each, and whether
          the texts are equal.
defaults  the same question without temperature, --rounds times, on that server (the model's
          defaults: temperature 0.2, top_p 0.9) and on one started with --generation-config vllm
          (temperature 1.0): how many answers name Paris, and the mean output tokens.

Tables to stdout, everything to bench/results/responses-api-<time>.json with the CPU and load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from lib.machine_info import machine  # noqa: E402

QUESTION = "What is the capital of France?"


def _timed(call):
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def _overhead(client, rounds: int, max_tokens: int) -> dict:
    messages = [{"role": "user", "content": QUESTION}]

    def chat():
        return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens,
                                              temperature=0).choices[0].message.content

    def responses():
        return client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=max_tokens,
                                       temperature=0).output_text

    chat(), responses()  # warm-up
    chat_s, responses_s, equal = [], [], True
    for _ in range(rounds):
        chat_text, seconds = _timed(chat)
        chat_s.append(seconds)
        responses_text, seconds = _timed(responses)
        responses_s.append(seconds)
        equal = equal and chat_text == responses_text
    return {"chat_median_s": statistics.median(chat_s), "responses_median_s": statistics.median(responses_s),
            "texts_equal": equal}


def _defaults(client, rounds: int, max_tokens: int) -> dict:
    answers = [client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=max_tokens)
               for _ in range(rounds)]
    return {"temperature": answers[0].temperature, "top_p": answers[0].top_p,
            "naming_paris": sum("Paris" in answer.output_text for answer in answers), "rounds": rounds,
            "mean_output_tokens": statistics.mean(answer.usage.output_tokens for answer in answers)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    from openai import OpenAI

    from pagedserve.launch.serve_process import ServeProcess

    results = {"machine": machine("openai"), "load_before": os.getloadavg(), "args": vars(args)}
    log_dir = Path(tempfile.mkdtemp(prefix="responses-bench-"))
    for mode in ("auto", "vllm"):
        server = ServeProcess("smollm2", log_dir / f"serve-{mode}.log", ["--generation-config", mode], http_port=True)
        try:
            server.wait_ready()
            client = OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0, timeout=600)
            if mode == "auto":
                results["overhead"] = _overhead(client, args.rounds, args.max_tokens)
            results[f"defaults_{mode}"] = _defaults(client, args.rounds, args.max_tokens)
        finally:
            server.stop()
    results["load_after"] = os.getloadavg()
    print(f"CPU {results['machine']['cpu']}, load before {results['load_before']}, after {results['load_after']}")
    overhead = results["overhead"]
    print(f"greedy, {args.max_tokens} tokens at most, median of {args.rounds}: chat {overhead['chat_median_s']:.3f} s,"
          f" responses {overhead['responses_median_s']:.3f} s, same text: {overhead['texts_equal']}")
    for mode in ("auto", "vllm"):
        d = results[f"defaults_{mode}"]
        print(f"--generation-config {mode}: temperature {d['temperature']}, top_p {d['top_p']}: "
              f"{d['naming_paris']}/{d['rounds']} answers name Paris, {d['mean_output_tokens']:.1f} output tokens")
    out = REPO / "bench" / "results" / f"responses-api-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
