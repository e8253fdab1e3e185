"""The metric-key contract (docs/metrics.md) as the end-to-end runs check it: the keys a run's actor logged
(``train/<key>`` in its TensorBoard scalars, less the driver's) are exactly ``core.metrics.expected_keys`` plus the
per-sample values of the task's experiences (the reward function's extra logs), on either backend. Imported by the
e2e modules of tests/pipeline, tests/demo, tests/code and tests/megatron (``tests/`` is on ``sys.path``)."""

from typing import Dict, Iterable, Set

from openrlhf_lpo.core.metrics import expected_keys

# what the driver (OpenRLHF's trainer and ours) adds to the actor's status: the same code on both backends
DRIVER_PREFIXES = ("rollout/", "timing/", "lpo/replay_")
DRIVER_KEYS = {"dynamic_filtering_pass_rate", "lpo/divergence_switched_at", "lpo/skipped_groups", "generated_samples"}
# per-sample values every task's experiences carry besides core.metrics.EXPERIENCE_KEYS: the reward's score, the
# reward-error flag of the runtime guard (openrlhf_lpo/openrlhf/reward_guard.py) and OpenRLHF's truncation flag
TASK_INFO = {"score", "reward/error_frac", "response_clip_ratio"}
# the reward functions' extra logs (per sample): openrlhf_lpo/rewards/reward_func.py, the demo's reward
PROJECT_REWARD_INFO = ("answer_found", "grader_timeout")
DEMO_REWARD_INFO = ("answer_length", "rollout_fingerprint")


def actor_keys(tb: Dict[str, dict]) -> Set[str]:
    keys = {k[len("train/"):] for k in tb if k.startswith("train/")}
    return {k for k in keys if not k.startswith(DRIVER_PREFIXES) and k not in DRIVER_KEYS}


def check_metric_contract(tb: Dict[str, dict], *, listwise: bool, end_kl: bool = False, correction: bool = False,
                          info: Iterable[str] = ()) -> Set[str]:
    """Assert the run's actor keys are the contract's: no key missing, no key extra. ``info``: the task's extra
    per-sample keys beyond TASK_INFO. Returns the keys (for a cross-backend comparison)."""
    got = actor_keys(tb)
    want = expected_keys(listwise, end_kl, correction) | TASK_INFO | set(info)
    missing, extra = sorted(want - got), sorted(got - want)
    assert not missing and not extra, f"metric contract: missing {missing}, extra {extra}"
    return got


def check_run(tb: Dict[str, dict], argv, info: Iterable[str] = ()) -> Set[str]:
    """:func:`check_metric_contract` with the contract's switches read off the run's own flags (``argv``)."""
    argv = list(argv)

    def value(flag, default=None):  # the last occurrence wins, as argparse reads it
        at = [i for i, a in enumerate(argv) if a == flag]
        return argv[at[-1] + 1] if at else default

    return check_metric_contract(
        tb, listwise=value("--algo.advantage.estimator") == "lpo", end_kl="--lpo.end_kl" in argv,
        correction=value("--algo.advantage.is_correction_level", "off") != "off", info=info)
