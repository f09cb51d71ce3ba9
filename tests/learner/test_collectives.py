"""learner/collectives.py between two real gloo processes: rank 0's values and episode groups reach rank 1 as
they were, every rank's arrays reach all, and nothing is pickled; a learner of one process listens on no
address other machines can reach."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common.processes.placement import free_port

REPO = Path(__file__).resolve().parents[2]

TWO_RANKS = r"""
import hashlib, json
import numpy as np
import torch.distributed as dist
from common.stream.codec import encode_group
from learner.collectives import all_gather_arrays, broadcast, broadcast_groups
from tests.support.stream_factory import make_group

def digest(groups):
    return hashlib.sha256(b"".join(bytes(v) for g in groups for _, v in sorted(encode_group(g).items()))).hexdigest()

dist.init_process_group("gloo")
rank = dist.get_rank()
value = broadcast({"pushed": 7, "need": True, "none": None, "nested": [1.5, "x"]} if rank == 0 else None)
sent = [make_group("g-a", num_traj=2, num_steps=3), make_group("g-b", num_traj=3, num_steps=2)]
groups = broadcast_groups(sent if rank == 0 else None)
nothing = broadcast_groups(None)
same = digest(groups if rank else sent)      # rank 0: what it sent; rank 1: what it received
merged = all_gather_arrays({rank * 10 + i: np.full(i + 1, rank + 0.5, dtype=np.float32) for i in range(2)})
print(json.dumps({"rank": rank, "value": value, "ids": [g.group_id for g in groups], "same": same,
                  "nothing": nothing, "merged": {str(k): v.tolist() for k, v in sorted(merged.items())}}))
dist.destroy_process_group()
"""


def test_rank0s_values_groups_and_every_ranks_arrays_reach_all_without_pickle():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for out in outs:
        assert out["value"] == {"pushed": 7, "need": True, "none": None, "nested": [1.5, "x"]}
        assert out["ids"] == ["g-a", "g-b"] and out["nothing"] is None
        assert out["merged"] == {"0": [0.5], "1": [0.5, 0.5], "10": [1.5], "11": [1.5, 1.5]}
    assert outs[0]["same"] == outs[1]["same"]          # the groups' bytes, as rank 0 encoded them
    learner_code = "\n".join(p.read_text() for p in (REPO / "learner").glob("*.py"))
    for unpickling in ("broadcast_object_list(", "all_gather_object(", "gather_object(", "scatter_object_list("):
        assert f"dist.{unpickling}" not in learner_code


LISTENING = r"""
import json, psutil
import torch, torch.distributed as dist
from learner.trainer import setup_distributed
world = setup_distributed()
total = torch.ones(1)
dist.all_reduce(total)
print(json.dumps({"world": world, "sum": total.item(), "listening": sorted(
    c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN)}))
"""


def test_a_learner_of_one_process_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", LISTENING], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**env, "PYTHONPATH": str(REPO)}, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["world"] == [0, 1] and out["sum"] == 1
    # (gloo's own pair listener, on loopback; before, torch's TCPStore listened on every interface: "::")
    assert all(ip.startswith("127.") or ip == "::1" for ip in out["listening"]), out["listening"]


def test_a_learner_of_two_processes_listens_on_the_rendezvous_address_alone(free_port):
    """Rank 0's TCPStore serves the group's unauthenticated keys: it listens on MASTER_ADDR, not on every
    interface as torch's own does (gloo's pairs on the interface GLOO_SOCKET_IFNAME names, as the learner's
    actor sets it)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-c", LISTENING], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(rank)}) for rank in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [out["world"] for out in outs] == [[0, 2], [1, 2]] and [out["sum"] for out in outs] == [2, 2]
    assert outs[0]["listening"] and all(ip.startswith("127.") for out in outs for ip in out["listening"]), outs
