"""Resident memory readings of this process (worker/resident_memory.py), on Linux /proc."""

from __future__ import annotations

import os

import numpy as np

from pagedserve.worker import resident_memory

MIB = 2**20


def test_growth_counts_memory_written_inside_the_block_and_its_peak():
    with resident_memory.growth() as kept:
        held = np.ones(64 * MIB // 8)  # written, so resident
    with resident_memory.growth() as freed:
        transient = np.ones(64 * MIB // 8)
        del transient  # gone again before the block ends: only the peak sees it
    assert kept["num_anon_rss_load_bytes"] >= 60 * MIB
    assert kept["num_rss_load_bytes"] >= 60 * MIB
    assert freed["num_anon_rss_load_bytes"] < 16 * MIB
    assert freed["num_peak_rss_load_bytes"] >= 60 * MIB
    del held


def test_status_of_another_process_and_unreadable_fields():
    fields = resident_memory.status_bytes("VmRSS", "NoSuchField", pid=os.getppid())
    assert fields["VmRSS"] > 0 and fields["NoSuchField"] is None
    assert resident_memory.status_bytes("VmRSS", pid=2**30)["VmRSS"] is None
