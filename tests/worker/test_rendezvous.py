"""The tensor-parallel rendezvous listens on the address the ranks use, not on every interface:
two real ranks (processes) join a gloo group through the worker's init_distributed while the test
reads rank 0's listening socket from /proc/net/tcp{,6}."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.launch.serve_config import free_port
from pagedserve.worker.rendezvous import RendezvousAddressError, parse_rendezvous

RANK = """
import sys
from pathlib import Path
import torch, torch.distributed as dist
from pagedserve.worker.config import WorkerConfig
from pagedserve.worker.process import init_distributed
rank, port = int(sys.argv[1]), int(sys.argv[2])
config = WorkerConfig(model_path="unused", rank=rank, world_size=2, dist_init_address=f"tcp://127.0.0.1:{port}",
                      dist_timeout_s=60)
keep = init_distributed(config, "cpu")
total = torch.ones(1)
dist.all_reduce(total)
if rank == 0:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "0A":  # LISTEN
                print("listening", local.rsplit(":", 1)[0], flush=True)
dist.barrier()
print("sum", int(total.item()), flush=True)
dist.destroy_process_group()  # a rank that exits with the group alive can abort in gloo's teardown
"""


def test_rank_zero_listens_on_the_rendezvous_host_only():
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (1, 0)]
    outputs = [rank.communicate(timeout=180)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    rank1, rank0 = outputs
    assert "sum 2" in rank0 and "sum 2" in rank1  # the group works
    listening = [line.split()[1] for line in rank0.splitlines() if line.startswith("listening")]
    assert listening == ["0100007F"], rank0  # 127.0.0.1, not 0.0.0.0 or ::


def test_the_rendezvous_address_is_tcp_host_port():
    assert parse_rendezvous("tcp://worker-0:29500") == ("worker-0", 29500)
    for address in ("worker-0:29500", "env://", "tcp://:29500", "tcp://host"):
        with pytest.raises(RendezvousAddressError):
            parse_rendezvous(address)
