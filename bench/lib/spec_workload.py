"""The speculative-decoding workload shared by spec_speedup, spec_sweep, cpu_waits and
draft_acceptance: grounded prompts (the answer copies its input) and open-ended chat prompts, a
chat request, a server started for them, and the scheduler's speculation counters.
"""

from __future__ import annotations

import re
import urllib.request

from pagedserve.launch.serve_process import ServeProcess
from pagedserve.v1 import generation_pb2 as pb
from lib.workload import RESULTS_DIR

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
    "keeper climbed the spiral stairs, trimmed the wick and polished the great lens, so that ships "
    "passing the rocks below could find their way home. When the electric lamp arrived, the keeper was "
    "no longer needed, but he stayed in the cottage beside the tower and still climbed the stairs each "
    "evening to watch the light come on by itself.")
CODE = '''def average(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def largest(values):
    best = values[0]
    for value in values:
        if value > best:
            best = value
    return best
'''
GROUNDED = [
    f"Rewrite the following paragraph, keeping every sentence but replacing 'keeper' with 'guardian':\n\n{PASSAGE}",
    f"Summarize this paragraph in three sentences, reusing its own words:\n\n{PASSAGE}",
    f"Correct the spelling in this text and return the full corrected text:\n\nThe old lighthouse stood at the "
    f"edge of the clif for more then a hundred years. Every nigt its keeper climbed the spiral stairs, trimed "
    f"the wick and polished the great lens, so that ships passing the rocks below could find there way home.",
    f"Rename the variable 'values' to 'numbers' in this Python code and return the whole code:\n\n{CODE}",
    f"Add a docstring to each function of this Python code and return the whole code:\n\n{CODE}",
    f"Make this code return 0 for an empty list and return the whole code:\n\n{CODE}",
]
CHAT = [
    "Write a short story about a dragon who learns to bake bread.",
    "What are the main benefits of regular exercise? Explain in a few paragraphs.",
    "Give me some ideas for a birthday party for a ten year old.",
    "Explain how a rainbow forms.",
    "Describe a day in the life of a medieval blacksmith.",
    "Why is the sky blue? Answer for a curious child.",
]


def chat_request(text: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)]),
                              params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))


def spec_counters(server: ServeProcess) -> dict:
    url = f"http://127.0.0.1:{server.scheduler_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))
    return {"drafts": total("pagedserve_spec_decode_num_drafts_total"),
            "proposed": total("pagedserve_spec_decode_draft_tokens_total"),
            "accepted": total("pagedserve_spec_decode_accepted_tokens_total")}


def finish(total: dict, before: dict, after: dict, num_requests: int) -> dict:
    delta = {key: after[key] - before[key] for key in after}
    return {"num_requests": num_requests, "num_output_tokens": total["num_output_tokens"],
            "seconds": total["seconds"], "tokens_per_second": total["num_output_tokens"] / total["seconds"],
            "acceptance_rate": delta["accepted"] / delta["proposed"] if delta["proposed"] else None,
            "mean_accepted_length": (delta["accepted"] + delta["drafts"]) / delta["drafts"] if delta["drafts"] else None,
            "outputs": total["outputs"]}


def serve(args, log_name: str, extra: list[str]) -> ServeProcess:
    server = ServeProcess(args.model, RESULTS_DIR / "logs" / f"speculative-{log_name}.log",
                          ["--max-num-seqs", "64", *args.serve_args, *extra], metrics=True,
                          num_threads=args.threads)
    server.wait_ready()
    server.stub.Generate(chat_request(GROUNDED[0], 8), timeout=600)  # warm-up
    return server
