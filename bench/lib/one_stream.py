"""Requests one after another against a server, timed as bench/real_model.py times its one-stream
runs: the requests' own times, the read bandwidth sampled before, between and after them (the
bandwidth that system met), and the rate after each request's first token."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from pagedserve.worker.cpu_share import CHECK_SECONDS

if TYPE_CHECKING:
    from roofline import BandwidthProbe

IDLE_PAUSE = 0.05  # seconds after a request before a bandwidth sample, for the server's threads to stop spinning
QUIET_PAUSE = 3.0 * CHECK_SECONDS + 0.2  # seconds without a request before a sample (sampling())


def timed(traces, probe: BandwidthProbe | None = None, prompt_seconds: float | None = None) -> dict:
    """Output tokens over the time from the first submission to the last token; with a probe (requests
    one after another, the bandwidth sampled between them), over the requests' own times, and the
    mean of the samples as the bandwidth this run met. With prompt_seconds (one stream: the server's
    own time for the requests' prompt phases), also the rate after the first token: every token but
    each request's first over the requests' times less that prompt time."""
    num_tokens = sum(trace.num_tokens for trace in traces)
    if probe is None:
        seconds = max(trace.finished_at for trace in traces) - min(trace.sent_at for trace in traces)
    else:
        seconds = sum(trace.finished_at - trace.sent_at for trace in traces)
    run = {"seconds": seconds, "num_output_tokens": num_tokens, "tokens_per_second": num_tokens / seconds,
           "load_average": os.getloadavg()[0]}
    if probe is not None and prompt_seconds is not None and 0 < prompt_seconds < seconds:
        run["prompt_seconds"] = prompt_seconds
        run["steady_tokens_per_second"] = (num_tokens - len(traces)) / (seconds - prompt_seconds)
    if probe is not None and probe.samples:
        run["read_gb_per_s"] = sum(probe.samples) / len(probe.samples)
        run["read_gb_per_s_samples"] = list(probe.samples)
    return run


def prefill_seconds(records: list) -> float:
    """The scheduler's time for the steps that computed prompt tokens (schedule to processed result)."""
    return sum(record.seconds for record in records if record.num_prefill_tokens > 0)


def sampling(probe: BandwidthProbe, then=lambda: None):
    """A callback for the end of each request of a one-stream run: `then`, a pause for the server's
    threads to go idle, a bandwidth sample, a quiet pause, and another sample right before the
    next request; the probe's samples restart with a quiet pause and one taken now.

    The quiet pause keeps the samples from looking like another tenant to pagedserve's worker,
    which about once a second measures the cores other processes used and drops to one thread
    above half a core (worker/cpu_share.py): a sample's two threads for a tenth of a second did
    so once. A check more than three check intervals after the last one counts nothing."""
    probe.samples.clear()
    time.sleep(QUIET_PAUSE)
    probe.sample()

    def on_done() -> None:
        then()
        time.sleep(IDLE_PAUSE)
        probe.sample()
        time.sleep(QUIET_PAUSE)
        probe.sample()

    return on_done
