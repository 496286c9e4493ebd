"""Writes block files and removes evicted ones on a thread of its own, so a step never waits for
the disk.

The queue is bounded (MAX_QUEUED items): when the disk cannot keep up, further writes are
dropped and counted; the scheduler's index then names a file that does not exist, whose fetch
fails and is forgotten (scheduler/kv/tiers). Writes and removals run in the order the steps
asked for them, so a block evicted from the disk tier and written again ends up on disk. A write
that fails (a full or read-only disk) is logged once per kind of error and dropped the same way.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

from pagedserve.log import get_logger
from pagedserve.worker.kv_tiers import block_file

MAX_QUEUED = 4096


class DiskWriter:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self.num_written = 0
        self.num_dropped = 0
        self.num_failed = 0
        self._errors_logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def write(self, path: str, encode: Callable[[], bytes]) -> None:
        """Queues a file; encode (header, checksum) runs on the writer's thread."""
        self._put(("write", path, encode))

    def remove(self, path: str) -> None:
        self._put(("remove", path, None))

    def flush(self, timeout: float = 30.0) -> None:
        """Waits until everything queued so far is done (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(("flush", "", done), timeout=timeout)
        done.wait(timeout)

    def _put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.num_dropped += 1

    def _run(self) -> None:
        while True:
            kind, path, data = self._queue.get()
            if kind == "flush":
                data.set()
            elif kind == "remove":
                block_file.remove(path)
            else:
                try:
                    block_file.write_atomically(path, data())
                    self.num_written += 1
                except OSError as exc:
                    self.num_failed += 1
                    reason = type(exc).__name__ + str(exc.errno)
                    if reason not in self._errors_logged:
                        self._errors_logged.add(reason)
                        get_logger(component="kv_disk_writer").warning(
                            "block_file_write_failed", path=path, error=str(exc))
