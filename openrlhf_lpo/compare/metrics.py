"""The one table from the metric keys ``lpo-train`` logs to the columns a study reports.

Every metrics row (``lpo-compare``, ``lpo-demo``) is built here from what a job logged: the "Global step N:
{...}" line of the PPO trainer, or the ``train/<key>`` and ``eval/<key>`` scalars of its TensorBoard files.
When a backend renames a key, the only change is in :data:`STEP_COLUMNS` or :data:`EVAL_KEYS` (the first
key present wins, so an old and a new name can stand side by side).

The quantities of the paper's Figure 5 (:data:`FIGURE5`) are what a study tabulates and plots: the sampled
reward, the response entropy, the actor's gradient norm, the response length and the held-out Pass@k of the
in-training evaluation. Each has a per-run summary rule: ``last`` = the mean of the last ``window`` training
steps, ``mean`` = the mean over all training steps, and the held-out columns take the last evaluation.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

# row column -> upstream keys of a training step (``train/<key>`` in TensorBoard), first present wins. The
# names are docs/metrics.md's (issue 42 item 2: every method logs them); the second names read older logs
# (``entropy_loss``: OpenRLHF's own loop logged the entropy only under that name).
STEP_COLUMNS: Dict[str, Tuple[str, ...]] = {
    "reward": ("rollout/reward_mean", "reward"),
    "entropy": ("response_entropy", "entropy_loss"),
    "grad_norm": ("actor_grad_norm",),  # per update: the mean over its optimizer steps
    "response_length": ("rollout/response_length_mean", "response_length"),
    "clip_ratio": ("clip_ratio",),
    "kl_target": ("lpo/kl_end",),
    "kl_start": ("lpo/kl_start",),
    "loss": ("policy_loss",),
    "degenerate_groups": ("lpo/degenerate_frac",),
    "step_s": ("timing/step_total",),
    "rollout_fingerprint": ("rollout_fingerprint",),
}

# held-out columns from OpenRLHF's in-training evaluation (``eval/<key>``; evaluation/training_eval.py):
# the mean accuracy over every data source, and per source ``eval_<ds>_pass<k>`` (unbiased Pass@k)
EVAL_KEYS: Dict[str, Tuple[str, ...]] = {"heldout_pass@1": ("eval_pass1",)}
EVAL_PASS = re.compile(r"^eval_(?P<ds>.+)_pass(?P<k>\d+)$")


@dataclass(frozen=True)
class Quantity:
    """One Figure-5 quantity: its per-run summary key, the row column it summarises, how, and its label."""

    key: str        # the per-run summary's name (also the toy benchmark's)
    column: str     # the metrics-row column
    rule: str       # "last": mean of the last ``window`` training steps; "mean": mean over all training steps
    label: str


FIGURE5: Tuple[Quantity, ...] = (
    Quantity("reward_final", "reward", "last", "sampled reward"),
    Quantity("entropy_final", "entropy", "last", "response entropy (nats/token)"),
    Quantity("grad_norm_mean", "grad_norm", "mean", "gradient norm"),
    Quantity("response_length_final", "response_length", "last", "response length (tokens)"),
)
# more per-run summaries (not in Figure 5): the fraction of groups with unequal rewards
EXTRA_SUMMARIES: Tuple[Quantity, ...] = (
    Quantity("informative_mean", "informative_groups", "mean", "informative groups"),
)


_STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})")
_PAIR = re.compile(r"'([^']+)':\s*(?:np\.float\d+\(|tensor\()?(-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))")


def parse_step_line(line: str) -> Optional[Dict]:
    """``(PPOTrainer pid=..) ... Global step 3: {'policy_loss': 0.1, ...}`` -> ``{"step": 3, ...}`` (the line the
    PPO trainer logs after every step); None for any other line."""
    m = _STEP_LINE.search(line)
    if not m:
        return None
    try:
        raw = ast.literal_eval(m.group(2))
        values = {k: float(v) for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    except (ValueError, SyntaxError):
        values = {k: float(v) for k, v in _PAIR.findall(m.group(2))}
    return {"step": int(m.group(1)), **values}


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def step_row(method: str, upstream: Mapping[str, float], **extra) -> Dict:
    """A metrics row from one training step's upstream values (``{"step": N, key: value, ...}``): the
    :data:`STEP_COLUMNS`, ``informative_groups`` (1 - the degenerate fraction), and every upstream value
    under ``upstream``."""
    row = {"method": method, "step": int(upstream["step"]), **extra}
    for col, keys in STEP_COLUMNS.items():
        for k in keys:
            if k in upstream and _finite(upstream[k]):
                row[col] = upstream[k]
                break
    if "degenerate_groups" in row:
        row["informative_groups"] = 1.0 - row["degenerate_groups"]
    row["upstream"] = {k: v for k, v in upstream.items() if k != "step"}
    return row


def eval_columns(logs: Mapping[str, float]) -> Dict[str, float]:
    """Held-out columns from one in-training evaluation's logs: ``heldout_pass@k`` when one data source
    was evaluated, ``heldout_<ds>_pass@k`` per source when several were (plus the overall Pass@1)."""
    out = {}
    for col, keys in EVAL_KEYS.items():
        for k in keys:
            if k in logs and _finite(logs[k]):
                out[col] = float(logs[k])
                break
    per_source: Dict[str, Dict[int, float]] = {}
    for key, value in logs.items():
        m = EVAL_PASS.match(key)
        if m and _finite(value):
            per_source.setdefault(m["ds"], {})[int(m["k"])] = float(value)
    for ds, by_k in per_source.items():
        prefix = "heldout_" if len(per_source) == 1 else f"heldout_{ds}_"
        out.update({f"{prefix}pass@{k}": v for k, v in by_k.items()})
    return out


def pass_columns(keys) -> list:
    """The held-out Pass@k columns among ``keys``, by source and increasing k."""
    found = [k for k in keys if k.startswith("heldout_") and re.search(r"pass@\d+$", k)]
    return sorted(found, key=lambda k: (k.rsplit("pass@", 1)[0], int(k.rsplit("@", 1)[1])))
