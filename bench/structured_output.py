"""Structured output: what a constraint costs, and whether sampled outputs validate.

    python bench/structured_output.py [--parts masks,tokens,validity] [--schemas PATH]
                                      [--max-schemas 50] [--samples 5] [--max-tokens 128]

masks     llguidance alone on SmolLM2-135M's vocabulary (49,152 tokens, read from the GGUF file
          as the scheduler reads it): per schema, compile time, then the compact JSON of a valid
          instance tokenized by the model's tokenizer and fed token by token, timing the mask of
          every step (one constrained sequence: what the scheduler computes per sequence and step).
tokens    `serve --model smollm2` (default flags) over gRPC: time per output token of streams at
          batch 1 and 16, all requests constrained (a JSON array of at least 60 short strings, so
          no stream can finish before max_tokens) against none, same server, same run; greedy,
          EOS ignored, --max-tokens tokens each.
validity  the same server through the official `openai` client: --max-schemas schemas x
          --samples samples at temperature 1 (response_format json_schema, strict); every output
          finished with `stop` must validate with `jsonschema`.

--schemas: a JSON file of {"schema", "valid": [...], "invalid": [...]} entries (default:
tests/data/structured_output/schemas.json), or a folder of JSONSchemaBench maskbench files
({"schema", "tests": [{"valid", "data"}]}). Tables to stdout, everything to
bench/results/structured-output-<time>.json, with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from lib.machine_info import machine  # noqa: E402

DEFAULT_SCHEMAS = REPO / "tests" / "data" / "structured_output" / "schemas.json"
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 60}


def load_schemas(path: Path, limit: int) -> list[dict]:
    """[{"name", "schema", "valid": [...]}] with at least one valid instance, at most limit."""
    entries = []
    if path.is_dir():
        for file in sorted(path.glob("*.json")):
            data = json.loads(file.read_text())
            valid = [test["data"] for test in data.get("tests", []) if test.get("valid")]
            if valid:
                entries.append({"name": file.stem, "schema": data["schema"], "valid": valid})
    else:
        for index, entry in enumerate(json.loads(path.read_text())):
            if entry.get("valid"):
                entries.append({"name": entry.get("name", str(index)), "schema": entry["schema"],
                                "valid": entry["valid"]})
    return entries[:limit]


def part_masks(schemas: list[dict]) -> dict:
    import llguidance
    import numpy as np

    from pagedserve.checkpoints.resolve import resolve_model
    from pagedserve.checkpoints.gguf_config import read_gguf_config
    from pagedserve.contracts.constraint import Constraint, ConstraintKind
    from pagedserve.frontend.tokenization.tokenizer import load_tokenizer
    from pagedserve.scheduler.structured_output.bitmask import num_words
    from pagedserve.scheduler.structured_output.compiler import GrammarCompiler
    from pagedserve.scheduler.structured_output.vocabulary import load_vocabulary

    path = resolve_model("smollm2")
    eos = list(read_gguf_config(path).eos_token_ids)
    started = time.perf_counter()
    vocabulary = load_vocabulary(path, 49152, eos)
    vocabulary_seconds = time.perf_counter() - started
    tokenizer = load_tokenizer(path)
    compiler = GrammarCompiler(lambda: vocabulary)
    row = np.empty((1, num_words(49152)), dtype=np.int32)
    compile_ms, mask_us, refused = [], [], []
    for entry in schemas:
        constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(entry["schema"]))
        started = time.perf_counter()
        try:
            template = compiler.template(constraint)
        except ValueError as exc:
            refused.append({"name": entry["name"], "error": str(exc)[:200]})
            continue
        compile_ms.append((time.perf_counter() - started) * 1e3)
        matcher = template.deep_copy()
        text = json.dumps(entry["valid"][0], separators=(",", ":"), ensure_ascii=False)
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            mask_us.append((time.perf_counter() - started) * 1e6)
            if not matcher.consume_token(token_id):
                break  # the canonical tokenization left the grammar (a lexeme split differently)
    ordered = sorted(mask_us)
    return {"vocabulary_seconds": vocabulary_seconds, "num_schemas": len(schemas), "num_refused": len(refused),
            "refused": refused, "compile_ms_median": statistics.median(compile_ms),
            "compile_ms_max": max(compile_ms), "num_masks": len(mask_us),
            "mask_us_mean": statistics.fmean(mask_us), "mask_us_p50": ordered[len(ordered) // 2],
            "mask_us_p99": ordered[int(len(ordered) * 0.99)], "mask_us_max": ordered[-1],
            "llguidance": llguidance.__version__}


def start_server(log_dir: Path):
    from pagedserve.launch.serve_process import ServeProcess

    server = ServeProcess("smollm2", log_dir / "serve.log", ["--num-kv-blocks", "1024"], http_port=True)
    server.wait_ready()
    return server


def _stream_seconds_per_token(server, prompt: str, params: dict, batch: int, max_tokens: int) -> float:
    from pagedserve.v1 import generation_pb2

    results: list[float] = []
    errors: list[Exception] = []

    def one() -> None:
        request = generation_pb2.GenerateRequest(prompt=prompt, params=generation_pb2.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, **params))
        try:
            started, num_tokens, first = time.perf_counter(), 0, None
            for message in server.stub.GenerateStream(request, timeout=900):
                for completion in message.completions:
                    num_tokens += len(completion.token_ids)
                    if first is None and num_tokens:
                        first = time.perf_counter()
            results.append((time.perf_counter() - first) / max(1, num_tokens - 1))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(batch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return statistics.fmean(results)


def part_tokens(server, max_tokens: int) -> dict:
    prompt = "List sixty fruit names as a JSON array of strings:"
    constrained = {"json_schema": json.dumps(LONG_SCHEMA)}
    _stream_seconds_per_token(server, prompt, constrained, 1, 8)  # compile and warm up
    table = {}
    for batch in (1, 16):
        plain = _stream_seconds_per_token(server, prompt, {}, batch, max_tokens)
        masked = _stream_seconds_per_token(server, prompt, constrained, batch, max_tokens)
        plain_again = _stream_seconds_per_token(server, prompt, {}, batch, max_tokens)
        table[batch] = {"none_ms": 1e3 * (plain + plain_again) / 2, "constrained_ms": 1e3 * masked,
                        "ratio": masked / ((plain + plain_again) / 2)}
    return table


def part_validity(server, schemas: list[dict], samples: int, max_tokens: int) -> dict:
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0, timeout=900)
    counts = {"stop": 0, "length": 0, "valid": 0, "invalid": 0, "refused": 0}
    failures = []

    def run(entry: dict) -> None:
        try:
            response = client.chat.completions.create(
                model="smollm2", max_tokens=max_tokens, temperature=1.0, n=samples,
                messages=[{"role": "user", "content": "Give an example JSON value for this JSON schema:\n"
                                                      + json.dumps(entry["schema"])[:2000]}],
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": entry["schema"],
                                                                        "strict": True}})
        except Exception as exc:
            counts["refused"] += 1
            failures.append({"name": entry["name"], "refused": str(exc)[:200]})
            return
        for choice in response.choices:
            counts[choice.finish_reason if choice.finish_reason in ("stop", "length") else "length"] += 1
            if choice.finish_reason != "stop":
                continue
            try:
                jsonschema.validate(json.loads(choice.message.content), entry["schema"])
                counts["valid"] += 1
            except Exception as exc:
                counts["invalid"] += 1
                failures.append({"name": entry["name"], "text": choice.message.content[:300], "error": str(exc)[:200]})

    threads = []
    for entry in schemas:
        threads.append(threading.Thread(target=run, args=(entry,)))
        threads[-1].start()
        if len(threads) % 8 == 0:
            for thread in threads[-8:]:
                thread.join()
    for thread in threads:
        thread.join()
    return {"counts": counts, "failures": failures[:20]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="masks,tokens,validity")
    parser.add_argument("--schemas", type=Path, default=DEFAULT_SCHEMAS)
    parser.add_argument("--max-schemas", type=int, default=50)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    schemas = load_schemas(args.schemas, args.max_schemas)
    report = {"machine": machine(), "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
              "args": {k: str(v) for k, v in vars(args).items()}}
    if "masks" in parts:
        masks = report["masks"] = part_masks(schemas)
        print("| schemas | refused | compile ms (median / max) | masks | mask us mean / p50 / p99 / max |")
        print("|---|---|---|---|---|")
        print(f"| {masks['num_schemas']} | {masks['num_refused']} | {masks['compile_ms_median']:.2f} / "
              f"{masks['compile_ms_max']:.1f} | {masks['num_masks']} | {masks['mask_us_mean']:.1f} / "
              f"{masks['mask_us_p50']:.1f} / {masks['mask_us_p99']:.1f} / {masks['mask_us_max']:.1f} |", flush=True)
    if parts & {"tokens", "validity"}:
        with tempfile.TemporaryDirectory() as folder:
            server = start_server(Path(folder))
            try:
                if "tokens" in parts:
                    tokens = report["tokens"] = part_tokens(server, args.max_tokens)
                    print("\n| batch | ms/token none | ms/token constrained | ratio |\n|---|---|---|---|")
                    for batch, row in tokens.items():
                        print(f"| {batch} | {row['none_ms']:.1f} | {row['constrained_ms']:.1f} | {row['ratio']:.3f} |",
                              flush=True)
                if "validity" in parts:
                    validity = report["validity"] = part_validity(server, schemas, args.samples, args.max_tokens)
                    print(f"\nvalidity: {validity['counts']}", flush=True)
            finally:
                server.stop()
    report["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    out = REPO / "bench" / "results" / f"structured-output-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\n{report['machine']['cpu']}; load {' '.join(report['loadavg_before'])} -> "
          f"{' '.join(report['loadavg_after'])}; {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
