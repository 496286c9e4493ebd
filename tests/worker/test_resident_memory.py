"""Resident memory readings of this process (worker/resident_memory.py), on Linux /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pagedserve.worker import resident_memory

MIB = 2**20


_GROWTH_CHILD = """
import json
import numpy as np
from pagedserve.worker import resident_memory
MIB = 2**20
with resident_memory.growth() as kept:
    held = np.ones(64 * MIB // 8)  # written, so resident
with resident_memory.growth() as freed:
    transient = np.ones(64 * MIB // 8)
    del transient  # gone again before the block ends: only the peak sees it
print(json.dumps({"kept": kept, "freed": freed}))
"""


def test_growth_counts_memory_written_inside_the_block_and_its_peak():
    # In a fresh process: in a long one (the test run) the allocator may hand back memory that an
    # earlier test freed but the process kept resident, which no growth reading can see.
    result = subprocess.run([sys.executable, "-c", _GROWTH_CHILD], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    readings = json.loads(result.stdout)
    kept, freed = readings["kept"], readings["freed"]
    assert kept["num_anon_rss_load_bytes"] >= 60 * MIB
    assert kept["num_rss_load_bytes"] >= 60 * MIB
    assert freed["num_anon_rss_load_bytes"] < 16 * MIB
    assert freed["num_peak_rss_load_bytes"] >= 60 * MIB


def test_status_of_another_process_and_unreadable_fields():
    fields = resident_memory.status_bytes("VmRSS", "NoSuchField", pid=os.getppid())
    assert fields["VmRSS"] > 0 and fields["NoSuchField"] is None
    assert resident_memory.status_bytes("VmRSS", pid=2**30)["VmRSS"] is None
