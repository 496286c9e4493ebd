"""Tool calling: do forced calls parse and validate, and what does forcing cost.

    python bench/tool_calling.py [--requests 50] [--max-tokens 160] [--concurrency 4]
                                 [--parallel-tool-calls true|false]

Starts `serve --model smollm2 --tool-call-parser smollm2 --enable-auto-tool-choice` and sends
--requests chat requests through the official `openai` client at temperature 1 (seed = request
number), alternating tool_choice "required" over three tools and a named function, over six
questions (parallel_tool_calls as given: false forces exactly one call). A request counts as valid when it finishes with `tool_calls` and every call names a
given tool (the named one for a named choice) with arguments that validate against the tool's
`parameters` (jsonschema). Also counted: what tool_choice "auto" does on the same questions (calls,
content, or malformed calls returned as content). Prints the counts and the latency, and writes
bench/results/tool-calling-<time>.json with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from lib.machine_info import machine  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 40},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search_flights", "description": "Flights between two airports",
                                      "parameters": {"type": "object", "properties": {
                                          "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                          "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                          "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                                          "required": ["origin", "destination", "passengers"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount",
                                      "parameters": {"type": "object", "properties": {
                                          "amount": {"type": "number", "exclusiveMinimum": 0},
                                          "from": {"type": "string", "maxLength": 3},
                                          "to": {"type": "string", "maxLength": 3}},
                                          "required": ["amount", "from", "to"]}}},
]
QUESTIONS = ["What's the weather like in Lisbon?", "Find me a flight from Paris CDG to New York JFK for two.",
             "How much is 120 euros in dollars?", "Is it raining in Tokyo right now?",
             "I need to fly from LHR to SFO alone.", "Convert 15.5 GBP to JPY please."]


def run(client, number: int, max_tokens: int, tool_choice, parallel: bool = True) -> dict:
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    started = time.perf_counter()
    response = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]}], tools=TOOLS,
        tool_choice=tool_choice, parallel_tool_calls=parallel, max_tokens=max_tokens, temperature=1.0, seed=number)
    seconds = time.perf_counter() - started
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    valid = choice.finish_reason == "tool_calls" and bool(calls)
    problems = []
    for call in calls:
        if isinstance(tool_choice, dict) and call.function.name != tool_choice["function"]["name"]:
            valid = False
            problems.append(f"named {call.function.name}")
        try:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        except Exception as exc:  # KeyError, ValueError, ValidationError: counted as invalid
            valid = False
            problems.append(f"{type(exc).__name__}: {exc}"[:200])
    return {"number": number, "tool_choice": tool_choice if isinstance(tool_choice, str) else "named",
            "finish_reason": choice.finish_reason, "num_calls": len(calls), "valid": valid, "seconds": seconds,
            "completion_tokens": response.usage.completion_tokens, "problems": problems,
            "has_content": bool(choice.message.content)}


def main() -> int:
    from openai import OpenAI

    from pagedserve.launch.serve_process import ServeProcess

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--parallel-tool-calls", choices=["true", "false"], default="true")
    args = parser.parse_args()
    report = {"machine": machine(), "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
              "args": vars(args)}
    with tempfile.TemporaryDirectory() as folder:
        server = ServeProcess("smollm2", Path(folder) / "serve.log", [
            "--num-kv-blocks", "1024", "--tool-call-parser", "smollm2", "--enable-auto-tool-choice"], http_port=True)
        server.wait_ready()
        try:
            client = OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0, timeout=600)
            choices = [("required" if i % 2 == 0 else {"type": "function", "function": {
                "name": TOOLS[(i // 2) % len(TOOLS)]["function"]["name"]}}) for i in range(args.requests)]
            with ThreadPoolExecutor(args.concurrency) as pool:
                parallel = args.parallel_tool_calls == "true"
                forced = list(pool.map(lambda i: run(client, i, args.max_tokens, choices[i], parallel),
                                       range(args.requests)))
                auto = list(pool.map(lambda i: run(client, i, args.max_tokens, "auto"), range(len(QUESTIONS))))
        finally:
            server.stop()
    report["forced"], report["auto"] = forced, auto
    print(f"parallel_tool_calls {args.parallel_tool_calls}, max_tokens {args.max_tokens}, temperature 1")
    report["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    num_valid = sum(row["valid"] for row in forced)
    latencies = [row["seconds"] for row in forced]
    print(f"forced: {num_valid} of {len(forced)} parse and validate "
          f"(required {sum(r['valid'] for r in forced if r['tool_choice'] == 'required')}/"
          f"{sum(r['tool_choice'] == 'required' for r in forced)}, named "
          f"{sum(r['valid'] for r in forced if r['tool_choice'] == 'named')}/"
          f"{sum(r['tool_choice'] == 'named' for r in forced)}); finish reasons "
          f"{ {r: sum(row['finish_reason'] == r for row in forced) for r in {row['finish_reason'] for row in forced}} }")
    print(f"forced latency s: median {statistics.median(latencies):.2f}, max {max(latencies):.2f}; completion "
          f"tokens median {statistics.median(row['completion_tokens'] for row in forced)}")
    for row in forced:
        if not row["valid"]:
            print("  invalid:", row)
    print(f"auto on {len(auto)} questions: {sum(row['num_calls'] > 0 for row in auto)} answered with calls, "
          f"{sum(row['valid'] for row in auto)} of them valid; {sum(row['has_content'] for row in auto)} with content")
    out = REPO / "bench" / "results" / f"tool-calling-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{report['machine']['cpu']}; load {' '.join(report['loadavg_before'])} -> "
          f"{' '.join(report['loadavg_after'])}; {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
