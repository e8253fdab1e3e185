"""Weight-sync parity: after a sync, the rollout engines must score a probe sequence as the actor does.

Neutral ground for every trainer backend (the DeepSpeed CPU mode in :mod:`openrlhf_lpo.cpu`, the
Megatron actor in :mod:`openrlhf_lpo.megatron.ray_actor`, the GPU check script): nothing here names
a device or imports a backend.

Public names (stable):
    PROBE_TEXT, probe_sequence(tokenizer, length=48) -> token ids
    check_engine_parity(engines, ids, actor_log_probs, temperature, **record) -> max |diff|
        engines expose ``log_probs_of.remote(ids, temperature)`` (the CPU rollout engines do);
        tolerance ``LPO_CPU_PARITY_TOL`` (default 1e-4), a failure raises; one JSON line per check
        is appended to ``LPO_CPU_PARITY_LOG`` when set.
"""

from __future__ import annotations

import json
import os
import time
from typing import List

PROBE_TEXT = "Using the numbers [3, 5, 7], make 22: <answer> 3 * 5 + 7 </answer>"


def probe_sequence(tokenizer, length: int = 48) -> List[int]:
    """A fixed token sequence on which the actor and the engines must agree after a sync."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    return list(ids)[:length]


def check_engine_parity(engines, ids: List[int], actor_log_probs, temperature: float, **record) -> float:
    """After a weight sync: every engine's log-probs of the probe sequence ``ids`` must equal the
    actor's (max |diff| <= ``LPO_CPU_PARITY_TOL``, default 1e-4; a failure raises). The result
    is appended as one JSON line to ``LPO_CPU_PARITY_LOG`` when set. Returns the max |diff|."""
    import ray
    import torch

    engine_lps = ray.get([engine.log_probs_of.remote(ids, temperature) for engine in engines])
    tol = float(os.environ.get("LPO_CPU_PARITY_TOL", "1e-4"))
    diffs = [float((torch.tensor(lp, dtype=torch.float64) - actor_log_probs).abs().max()) for lp in engine_lps]
    log_path = os.environ.get("LPO_CPU_PARITY_LOG")
    if log_path:
        entry = {"time": time.time(), "max_abs_diff": max(diffs), "per_engine": diffs, "tol": tol,
                 "num_tokens": len(ids) - 1, **record, "probe_ids": ids,
                 "actor_log_probs": actor_log_probs.tolist(), "engine_log_probs": engine_lps[0]}
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    if max(diffs) > tol:
        raise RuntimeError(
            f"CPU rollout engine log-probs differ from the actor's after the weight sync: max |diff| "
            f"{max(diffs):.3g} > LPO_CPU_PARITY_TOL={tol:g} (engine {os.environ.get('LPO_CPU_ENGINE', 'hf')}, "
            f"{record.get('backend', 'deepspeed')} actor)"
        )
    return max(diffs)
