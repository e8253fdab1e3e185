"""This rank's place in the gloo world and its record.

``join`` is the first thing a rank does (before megatron is imported: the CPU redirect must be in place);
the check modules read ``RANK``, ``WORLD`` and ``OUT`` from here at call time.
"""

import json
import os
import time

RANK: int = -1
WORLD: int = 0
OUT: str = ""
T0 = time.time()
# the record this rank writes to OUT/rank{RANK}.json: the checks' numbers (``checks``), their outcome
# (``status``), and the run's end (``seconds``; ``world_broken`` when the barrier after a check failed)
RECORD: dict = {"rank": RANK, "checks": {}, "status": {}}
# the runner's own gloo group for the barrier after each check (runner.main makes it): its messages cannot
# meet those of a collective that a check left unfinished on the world group
BARRIER_GROUP = None


def join(rank: int, world: int, port: str, out: str) -> None:
    """Apply the CPU redirect of megatron and join the gloo world of ``world`` ranks on 127.0.0.1:``port``."""
    global RANK, WORLD, OUT
    import torch

    torch.set_num_threads(1)
    RANK, WORLD, OUT = rank, world, out
    RECORD["rank"] = rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    from openrlhf_lpo.cpu import megatron_redirect as cpu_megatron

    cpu_megatron.apply()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)


def log(msg: str) -> None:
    print(f"[rank {RANK} {time.time() - T0:.0f}s] {msg}", flush=True)


def write_record(record: dict = RECORD) -> None:
    """Write the record atomically (a reader sees the previous version or this one, never half of one)."""
    tmp = os.path.join(OUT, f"rank{RANK}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(OUT, f"rank{RANK}.json"))


def step_metrics(actor, out: dict) -> dict:
    """The global token means of one ``MegatronActor.train_step`` (its sums are this replica's: summed here over
    the data-parallel ranks, as core.update does at the end of an update)."""
    import torch
    import torch.distributed as dist

    keys = sorted(out["sums"])
    t = torch.tensor([out["sums"][k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=actor.ps.get_data_parallel_group())
    sums = dict(zip(keys, t.tolist()))
    tokens = max(sums["tokens"], 1.0)
    return {"entropy": sums["entropy_sum"] / tokens, "clip_ratio": sums["out_of_band"] / tokens,
            "ppo_kl": sums["ppo_kl_sum"] / tokens, "kl": sums["kl_loss_sum"] / tokens, "tokens": sums["tokens"]}
