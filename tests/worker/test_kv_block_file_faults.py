"""Faults of the disk tier's files: a writer killed mid-write leaves no file a reader accepts with
the wrong content (only whole renamed files, and temporary ones the scheduler's scan removes); a
disk that fills (here a file size limit: writes fail with EFBIG) makes writes fail and get counted,
never raise into a step, and leaves no partial file behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from pagedserve.contracts.tier_ops import parse_block_file_name
from pagedserve.scheduler.kv.tiers.disk_index import DiskIndex
from pagedserve.worker.kv_tiers import block_file

PAYLOAD_BYTES = 1 << 16

_WRITER = textwrap.dedent("""
    import os, resource, signal, sys
    from functools import partial
    from pagedserve.worker.kv_tiers import block_file
    from pagedserve.worker.kv_tiers.disk_writer import DiskWriter
    folder, limit = sys.argv[1], int(sys.argv[2])
    if limit:  # a disk that fills: writes past the limit fail with EFBIG instead of killing us
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    writer = DiskWriter(folder)
    for index in range(int(sys.argv[3])):
        key = index.to_bytes(16, "little")
        payload = bytes([index % 251]) * PAYLOAD_BYTES
        writer.write(os.path.join(folder, f"{key.hex()}.r0.kvb"),
                     partial(block_file.encode, payload, key=key, rank=0, layout_id="L", layout={}))
        if index % 64 == 63:
            writer.flush()
    writer.flush()
    print(writer.num_written, writer.num_failed, flush=True)
""").replace("PAYLOAD_BYTES", str(PAYLOAD_BYTES))


def _start(folder, limit: int, count: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(folder), str(limit), str(count)],
                            stdout=subprocess.PIPE, text=True)


def _check_files(folder) -> int:
    """Every block file in folder decodes to the payload its key implies; returns how many."""
    num_files = 0
    for name in os.listdir(folder):
        parsed = parse_block_file_name(name)
        if parsed is None:
            continue
        key, rank = parsed
        payload = block_file.read(os.path.join(folder, name), key=key, rank=rank, layout_id="L",
                                  payload_bytes=PAYLOAD_BYTES)
        assert payload == bytes([int.from_bytes(key, "little") % 251]) * PAYLOAD_BYTES
        num_files += 1
    return num_files


def test_a_writer_killed_mid_write_leaves_only_whole_files(tmp_path) -> None:
    process = _start(tmp_path, 0, 100_000)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(os.listdir(tmp_path)) < 20:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    assert _check_files(tmp_path) >= 1
    # the scan keeps whole files and removes stale temporary ones
    index = DiskIndex(1_000_000)
    index.load(str(tmp_path), world_size=1, now=time.time() + 3600)
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]
    assert len(index) == _check_files(tmp_path)


def test_a_full_disk_fails_writes_without_raising_or_half_files(tmp_path) -> None:
    process = _start(tmp_path, PAYLOAD_BYTES // 2, 10)  # the disk takes half a file, then EFBIG
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    num_written, num_failed = map(int, out.strip().splitlines()[-1].split())  # after the logged warning
    assert (num_written, num_failed) == (0, 10)
    assert os.listdir(tmp_path) == []
