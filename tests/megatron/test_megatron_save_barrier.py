"""The waits around checkpoint writes outlast the training groups' timeout (megatron/checkpoint.py).

Two gloo processes whose default group times out after 1 s: one rank is 2.5 s late to
``checkpoint.save_barrier`` (as a rank still writing a 70B shard is late), and the barrier holds; the same
lateness at the default group's barrier (what the save used before) raises.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = r"""
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist
from openrlhf_lpo.megatron.checkpoint import save_barrier

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=1))
out = {}
if rank == 1:
    time.sleep(2.5)
t = time.time()
save_barrier(1.0)
out["save_barrier_waited"] = time.time() - t
if rank == 1:
    time.sleep(2.5)
try:
    dist.barrier()
    out["default_barrier"] = "held"
except Exception as e:  # noqa: BLE001 - the negative control: gloo's timeout
    out["default_barrier"] = type(e).__name__
print(json.dumps(out), flush=True)
os._exit(0)
"""


def test_save_barrier_outlasts_the_training_groups_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["save_barrier_waited"] > 2.0  # rank 0 waited for the late rank, past the 1 s timeout
    assert results[0]["default_barrier"] != "held"  # the training group's barrier gives up on it
