"""docs/performance-tables.md is made from the kept result files (bench/perf_tables.py): each table
names its CPU and run dates, a figure over several runs is their median (not the best run), and
bench/results/kept/ is tracked by git while the rest of bench/results/ is not."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _perf_tables():
    spec = importlib.util.spec_from_file_location("perf_tables", ROOT / "bench" / "perf_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _limits(date: str, cpu: str, read: float, gemm32: float) -> dict:
    return {"date": date, "machine": {"cpu": cpu}, "load_average_start": [1.5, 1.0, 1.0], "num_threads": 2,
            "read_gb_per_s": read, "gemm_gflops": {"bfloat16": {"1": 10.0, "32": gemm32, "512": 300.0}}}


def _real_model(date: str, cpu: str, ours: float, theirs: float,
                config: str = "serve --model m --dtype bfloat16; unary Generate (whole answers)") -> dict:
    return {"date": date, "machine": {"cpu": cpu}, "load_average_start": [2.0, 1.0, 1.0], "serve_args": [],
            "dtypes": {"bfloat16": {"token_limits": {"1": 100.0},
                                    "configs": {"pagedserve": config},
                                    "systems": {"pagedserve": {"1": {"tokens_per_second": ours}},
                                                "llama.cpp": {"1": {"tokens_per_second": theirs}}}}}}


def test_tables_name_the_cpu_and_dates_and_take_medians(tmp_path):
    tables = _perf_tables()
    for report in (_limits("20261101T000000Z", "CPU A", 20.0, 100.0), _limits("20261102T000000Z", "CPU A", 30.0, 300.0),
                   _limits("20261103T000000Z", "CPU A", 26.0, 200.0), _limits("20261104T000000Z", "CPU B", 50.0, 900.0)):
        tables.save_kept("limits", report, tmp_path)
    for report in (_real_model("20261101T010000Z", "CPU A", 40.0, 80.0), _real_model("20261102T010000Z", "CPU A", 60.0, 70.0),
                   _real_model("20261103T010000Z", "CPU A", 50.0, 90.0)):
        tables.save_kept("real_model", report, tmp_path)
    assert len(list(tmp_path.glob("limits-*-cpu-a.json"))) == 3
    page = tables.render(tables.load_kept(tmp_path))
    assert "### Limits: CPU A" in page and "### Limits: CPU B" in page
    assert "3 run(s) on 2026-11-01, 2026-11-02, 2026-11-03" in page
    assert "| read bandwidth (GB/s) | 26.0 |" in page  # the median of 20, 30, 26, not the best
    assert "| GEMM bfloat16, 32 rows (GFLOP/s) | 200.0 |" in page
    assert "| read bandwidth (GB/s) | 50.0 |" in page  # CPU B on its own
    assert "| bfloat16 | 1 | 50.0 (50 %) | 80.0 (80 %) |" in page  # medians and their share of the limit
    # the flags each figure ran with
    assert "- bfloat16, pagedserve: serve --model m --dtype bfloat16; unary Generate (whole answers)" in page


def test_real_model_runs_kept_before_whole_answers_count_as_streamed(tmp_path):
    tables = _perf_tables()
    tables.save_kept("real_model", _real_model("20261101T010000Z", "CPU A", 40.0, 80.0, config="serve --model m"),
                     tmp_path)
    tables.save_kept("real_model", _real_model("20261102T010000Z", "CPU A", 60.0, 70.0), tmp_path)
    page = tables.render(tables.load_kept(tmp_path))
    assert "| dtype | streams | pagedserve | pagedserve-stream | llama.cpp |" in page
    assert "| bfloat16 | 1 | 60.0 (60 %) | 40.0 (40 %) | 75.0 (75 %) |" in page
    assert "- bfloat16, pagedserve-stream: serve --model m" in page


def test_a_one_stream_share_takes_the_bandwidth_sampled_between_its_own_requests(tmp_path):
    """A run that kept the bandwidth sampled between a system's requests is judged against it: the
    host's bandwidth changes within seconds, so the start's limit need not be what that system met."""
    tables = _perf_tables()
    report = _real_model("20261101T010000Z", "CPU A", 40.0, 80.0)
    entry = report["dtypes"]["bfloat16"]
    entry["weight_bytes_per_token"] = 1e9  # 1 GB per token: N GB/s allows N tokens/s
    entry["systems"]["pagedserve"]["1"]["read_gb_per_s"] = 50.0
    entry["systems"]["llama.cpp"]["1"]["read_gb_per_s"] = 160.0
    tables.save_kept("real_model", report, tmp_path)
    page = tables.render(tables.load_kept(tmp_path))
    assert "| bfloat16 | 1 | 40.0 (80 %) | 80.0 (50 %) |" in page  # not 40 % and 80 % of the start's 100


def _guidellm_chat(date: str, ours: float, theirs: float) -> dict:
    figures = {"output_tokens_per_second": ours, "ttft_p50_ms": 100.0, "itl_p50_ms": 10.0}
    return {"date": date, "machine": {"cpu": "CPU A"}, "load_average_start": [1.0, 1.0, 1.0],
            "guidellm_version": "0.8.1", "budget": {"seconds": 60.0, "num_requests": None},
            "commands": {"pagedserve": f"/venv/bin/python -m pagedserve.cli serve --model smollm2 --port {int(ours)} "
                                       f"--scheduler-port 2 --device cpu --http-port 3",
                         "llama.cpp": f"/x/llama-server -m /cache/m.gguf --host 127.0.0.1 --port {int(theirs)} -t 2"},
            "points": [{"prompt_tokens": 256, "output_tokens": 64, "concurrency": 8,
                        "systems": {"pagedserve": figures, "llama.cpp": {**figures, "output_tokens_per_second": theirs}},
                        "ratios": {"output_tokens_per_second": ours / theirs}}]}


def test_guidellm_table_takes_medians_of_figures_and_ratios(tmp_path):
    tables = _perf_tables()
    for report in (_guidellm_chat("20261101T000000Z", 100.0, 50.0), _guidellm_chat("20261102T000000Z", 300.0, 100.0),
                   _guidellm_chat("20261103T000000Z", 200.0, 200.0)):
        tables.save_kept("guidellm_chat", report, tmp_path)
    page = tables.render(tables.load_kept(tmp_path))
    assert "### guidellm chat against llama.cpp, SmolLM2-135M-Instruct: CPU A" in page
    assert "3 run(s) on 2026-11-01, 2026-11-02, 2026-11-03" in page
    # medians of tokens/s (200, 100) and of each run's ratio (2, 3, 1), not the ratio of medians
    assert "| 256x64 | 8 | 200.0 | 100.0 | 2.00x | 100 / 100 | 10.0 / 10.0 |" in page
    # one line per server command, its ports and folders left out
    assert page.count("- pagedserve: python -m pagedserve.cli serve --model smollm2 --device cpu") == 1
    assert page.count("- llama.cpp: llama-server -m m.gguf -t 2") == 1


def test_guidellm_table_leaves_out_a_server_that_completed_nothing(tmp_path):
    """guidellm gives zeros for the times of a point where no request completed: those are no
    figures, and the point has no ratio; the table says which server and how often."""
    tables = _perf_tables()
    for date, completed in (("20261101T000000Z", 4), ("20261102T000000Z", 0)):
        report = _guidellm_chat(date, 100.0, 50.0 if completed else 1.0)
        point = report["points"][0]
        point["systems"]["llama.cpp"].update(num_completed=completed, ttft_p50_ms=0.0 if not completed else 100.0)
        point["ratios"]["output_tokens_per_second"] = 100.0 / point["systems"]["llama.cpp"]["output_tokens_per_second"]
        tables.save_kept("guidellm_chat", report, tmp_path)
    page = tables.render(tables.load_kept(tmp_path))
    assert "| 256x64 | 8 | 100.0 | 50.0 | 2.00x | 100 / 100 | 10.0 / 10.0 |" in page  # the 0 and 100x left out
    assert "- llama.cpp at 256x64, 8 streams: no request completed within the point in 1 of the runs" in page


def test_kept_results_are_tracked_and_the_others_ignored():
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0

    assert ignored("bench/results/real_model-20261101T000000Z.json")
    assert not ignored("bench/results/kept/real_model-20261101T000000Z-amd-epyc.json")


def test_runs_started_on_a_busy_machine_are_left_out_and_named(tmp_path):
    tables = _perf_tables()
    for date, load, bandwidth in (("20261101T000000Z", 0.5, 30.0), ("20261102T000000Z", 14.0, 4.0),
                                  ("20261103T000000Z", 1.5, 34.0)):
        report = _limits(date, "CPU A", bandwidth, 100.0)
        report["machine"]["num_cores"] = 2
        report["load_average_start"] = [load, load, load]
        tables.save_kept("limits", report, tmp_path)
    page = tables.render(tables.load_kept(tmp_path))
    assert "| read bandwidth (GB/s) | 32.0 |" in page  # the median of 30 and 34; the busy run's 4 is not in it
    assert "Left out, started on a busy machine (load average above the core count): 20261102T000000Z." in page
    busy = _limits("20261104T000000Z", "CPU B", 9.0, 100.0)
    busy["machine"]["num_cores"], busy["load_average_start"] = 2, [8.0, 8.0, 8.0]
    tables.save_kept("limits", busy, tmp_path)
    page = tables.render(tables.load_kept(tmp_path))
    assert "| read bandwidth (GB/s) | 9.0 |" in page  # all of CPU B's runs were busy: shown, with their load


def test_the_newest_code_has_its_own_table_of_ratios_within_runs(tmp_path):
    tables = _perf_tables()
    runs = (("20261101T010000Z", "aaaaaaa", 40.0, 80.0), ("20261102T010000Z", "bbbbbbb", 60.0, 50.0),
            ("20261103T010000Z", "bbbbbbb", 90.0, 100.0), ("20261104T010000Z", "bbbbbbb", 70.0, 35.0))
    for date, commit, ours, theirs in runs:
        report = _real_model(date, "CPU A", ours, theirs)
        report["machine"]["commit"] = commit
        report["dtypes"]["bfloat16"]["systems"]["llama.cpp-poll0"] = {"1": {"tokens_per_second": theirs / 2}}
        tables.save_kept("real_model", report, tmp_path)
    page = tables.render(tables.load_kept(tmp_path))
    assert "### The newest code measured (bbbbbbb): pagedserve whole answers against llama.cpp, CPU A" in page
    # the three runs of bbbbbbb only; the ratio is the median of each run's ratio to llama.cpp's better config
    # (1.2, 0.9, 2.0), not the ratio of the medians (70 / 50)
    assert "| bfloat16 | 1 | 70.0 (70 %) | 50.0 | 1.20x | 1.20, 0.90, 2.00 | 3 |" in page


def test_the_newest_code_gives_one_stream_after_the_first_token_against_the_bandwidth_met(tmp_path):
    tables = _perf_tables()
    for date, ours, theirs, read in (("20261101T010000Z", 90.0, 60.0, 100.0), ("20261102T010000Z", 80.0, 80.0, 100.0),
                                     ("20261103T010000Z", 85.0, 50.0, 50.0)):
        report = _real_model(date, "CPU A", ours - 5, theirs - 5)
        report["machine"]["commit"] = "ccccccc"
        entry = report["dtypes"]["bfloat16"]
        entry["weight_bytes_per_token"] = 1e9
        for system, rate in (("pagedserve", ours), ("llama.cpp", theirs)):
            entry["systems"][system]["1"].update(steady_tokens_per_second=rate, read_gb_per_s=read)
        entry["systems"]["llama.cpp-poll0"] = {"1": {"tokens_per_second": 1.0, "steady_tokens_per_second": 1.0}}
        tables.save_kept("real_model", report, tmp_path)
    page = tables.render(tables.load_kept(tmp_path))
    # medians of the runs (85, 60) and of the shares of each run's own bandwidth (90, 80, 170 %; 60, 80, 100 %),
    # the ratio the median of each run's (1.5, 1.0, 1.7), llama.cpp's better config in each run
    assert "| bfloat16 | 1 | 85.0 (90 %) | 60.0 (80 %) | 1.50x | 1.50, 1.00, 1.70 | 3 |" in page
