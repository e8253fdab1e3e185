"""The methods the demo and the toy benchmark compare, by name, and how each maps to ``lpo-train`` flags.

Every method projects the policy onto the same kind of listwise Gibbs target ``w* = softmax(R/tau)``
(Eq. 8); what differs is the temperature and the projection. A policy-gradient baseline fits its
target to first order (Prop. 1): GRPO with ``tau`` = group std, Dr.GRPO with ``tau = 1``, MaxRL with
``tau`` = group mean (success rate). LPO projects exactly with a divergence (Eq. 10 forward KL, Eq. 11
reverse KL) and inherits the temperature of the baseline it is paired with, so that in each pair only
the projection differs:

==============  ===============================  ==========
temperature     LPO methods                      baseline
==============  ===============================  ==========
std (GRPO)      ``lpo-fwd``, ``lpo-rev``, ``lpo-js``   ``grpo``
one (Dr.GRPO)   ``lpo-fwd@one``, ``lpo-rev@one``    ``dr-grpo``
mean (MaxRL)    ``lpo-fwd@mean``, ``lpo-rev@mean``  ``maxrl``
loo (RLOO)      ``lpo-fwd@loo``, ``lpo-rev@loo``    ``rloo``
batch_std       ``lpo-fwd@batch_std``,             ``reinforce-pp``
(REINFORCE++)   ``lpo-rev@batch_std``
==============  ===============================  ==========

The 2025 baselines that only change the advantage fit the toy's PG loop (the same PPO-clipped surrogate,
sequence-mean aggregation, for every baseline): RLOO (``loo``: tau = (K-1)/K, A = K/(K-1)(R - mean)) and
REINFORCE++-baseline (``batch_std``: A = (R - group mean)/std over the step's whole batch). DAPO, GSPO and
CISPO change the policy loss (clip-higher with token-level aggregation and dynamic sampling; a sequence
ratio; a detached clipped IS weight), which the in-process loop does not implement (its loss is fixed,
``demo/loop.py``); their advantage is GRPO's, so their LPO pair is ``lpo-fwd`` / ``lpo-rev`` (tau = group
std) and the toy's ``grpo`` stands for them. Run them through ``lpo-train`` (``configs/methods/``).

The research agenda (issue 25; ``benchmarks/toy_sample_efficiency.py --suite research``) adds LPO
methods that differ from ``lpo-fwd`` in one respect each: the divergence (``lpo-hellinger``,
``lpo-tv``, ``lpo-alpha0.5``, ``lpo-alpha2``), a divergence schedule (``lpo-fwd2rev-step``: forward KL
for 20 updates, then reverse; ``lpo-fwd2rev-entropy``: forward until the 3-step mean response entropy
falls below a threshold), the temperature scale (``lpo-fwd-tau0.5``, ``lpo-fwd-tau2``) and listwise
replay (``lpo-fwd-replay``: the last 2 rollout batches, one replayed group per fresh group, groups
with |s_t| > 0.5 dropped). Any divergence name also works ad hoc: ``lpo:<divergence>``
(``lpo:alpha:0.7``, temperature std).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from openrlhf_lpo.registry import register_unique

# PG estimator of openrlhf_lpo.listwise -> the name lpo-train knows it by (group_norm is OpenRLHF's GRPO)
_PIPELINE_ESTIMATOR = {"grpo": "group_norm", "dr_grpo": "dr_grpo", "maxrl": "maxrl", "rloo": "rloo",
                       "reinforce_pp": "reinforce_baseline"}


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    estimator: str               # "lpo" or a PG estimator of openrlhf_lpo.listwise (grpo, dr_grpo, maxrl, rloo,
    #                              reinforce_pp)
    divergence: Optional[str]    # for LPO: key of openrlhf_lpo.listwise.DIVERGENCES
    temperature: str = "std"     # LPO temperature / the PG baseline's implicit temperature
    color: str = "C0"
    linestyle: str = "-"
    temperature_scale: float = 1.0           # --lpo.temperature_scale
    schedule: Optional[str] = None           # --lpo.divergence_schedule (then ``divergence`` is its first stage)
    switch_entropy: Optional[float] = None   # --lpo.divergence_switch_entropy
    switch_window: int = 3                   # --lpo.divergence_switch_window
    replay_batches: int = 0                  # --lpo.replay_batches
    replay_ratio: float = 1.0                # --lpo.replay_ratio
    replay_max_abs_s: Optional[float] = None  # --lpo.replay_max_abs_s

    def __post_init__(self):
        if not self.is_lpo and (self.schedule or self.replay_batches or self.temperature_scale != 1.0):
            raise ValueError(f"method {self.name!r}: schedules, replay and the temperature scale are LPO options")
        if self.is_lpo and self.divergence is not None:
            from openrlhf_lpo.listwise import parse_divergence

            parse_divergence(self.divergence)

    def divergence_schedule(self):
        """The method's :class:`openrlhf_lpo.core.divergence_schedule.DivergenceSchedule` (a constant one without a schedule)."""
        from openrlhf_lpo.core.divergence_schedule import DivergenceSchedule, parse_schedule

        if self.schedule:
            return DivergenceSchedule(parse_schedule(self.schedule), self.switch_entropy, self.switch_window)
        return DivergenceSchedule.constant(self.divergence)

    @property
    def is_lpo(self) -> bool:
        return self.estimator == "lpo"

    @property
    def baseline(self) -> "Method":
        """The policy-gradient method with this method's temperature (itself for a baseline)."""
        if not self.is_lpo:
            return self
        return next(m for m in METHODS.values() if not m.is_lpo and m.temperature == self.temperature)

    def pipeline_flags(self) -> List[str]:
        """``lpo-train`` flags selecting this method; every method logs KL(w*||P) after its update
        against its own (paired) target (``--lpo.end_kl``)."""
        metrics = ["--lpo.temperature", self.temperature, "--lpo.end_kl"]
        if self.is_lpo:
            flags = ["--algo.advantage.estimator", "lpo"]
            if self.schedule:
                flags += ["--lpo.divergence_schedule", self.schedule]
                if self.switch_entropy is not None:
                    flags += ["--lpo.divergence_switch_entropy", str(self.switch_entropy),
                              "--lpo.divergence_switch_window", str(self.switch_window)]
            else:
                flags += ["--lpo.divergence", self.divergence]
            if self.temperature_scale != 1.0:
                flags += ["--lpo.temperature_scale", str(self.temperature_scale)]
            if self.replay_batches:
                flags += ["--lpo.replay_batches", str(self.replay_batches), "--lpo.replay_ratio", str(self.replay_ratio)]
                if self.replay_max_abs_s is not None:
                    flags += ["--lpo.replay_max_abs_s", str(self.replay_max_abs_s)]
            return flags + metrics
        return ["--algo.advantage.estimator", _PIPELINE_ESTIMATOR[self.estimator]] + metrics


METHODS: Dict[str, Method] = {}


def register_method(method: Method) -> Method:
    return register_unique(METHODS, "method", method.name, method)


register_method(Method("lpo-fwd", "LPO-fwd (KL(w*||P))", "lpo", "fwd", color="C0"))
register_method(Method("lpo-rev", "LPO-rev (KL(P||w*))", "lpo", "rev", color="C2"))
register_method(Method("lpo-js", "LPO-JS", "lpo", "js", color="C4"))
register_method(Method("grpo", "GRPO (group_norm)", "grpo", None, color="C3"))
register_method(Method("lpo-fwd@one", "LPO-fwd, tau=1", "lpo", "fwd", "one", color="C0", linestyle="--"))
register_method(Method("lpo-rev@one", "LPO-rev, tau=1", "lpo", "rev", "one", color="C2", linestyle="--"))
register_method(Method("dr-grpo", "Dr.GRPO", "dr_grpo", None, "one", color="C1", linestyle="--"))
register_method(Method("lpo-fwd@mean", "LPO-fwd, tau=mean", "lpo", "fwd", "mean", color="C0", linestyle=":"))
register_method(Method("lpo-rev@mean", "LPO-rev, tau=mean", "lpo", "rev", "mean", color="C2", linestyle=":"))
register_method(Method("maxrl", "MaxRL", "maxrl", None, "mean", color="C5", linestyle=":"))
# 2025 baselines whose advantage fits the toy (module docstring) and their LPO pairs
register_method(Method("lpo-fwd@loo", "LPO-fwd, tau=(K-1)/K", "lpo", "fwd", "loo", color="C0", linestyle="-."))
register_method(Method("lpo-rev@loo", "LPO-rev, tau=(K-1)/K", "lpo", "rev", "loo", color="C2", linestyle="-."))
register_method(Method("rloo", "RLOO", "rloo", None, "loo", color="C8", linestyle="-."))
register_method(Method("lpo-fwd@batch_std", "LPO-fwd, tau=batch std", "lpo", "fwd", "batch_std", color="C0",
                       linestyle="--"))
register_method(Method("lpo-rev@batch_std", "LPO-rev, tau=batch std", "lpo", "rev", "batch_std", color="C2",
                       linestyle="--"))
register_method(Method("reinforce-pp", "REINFORCE++-baseline", "reinforce_pp", None, "batch_std", color="C9",
                       linestyle="--"))
# the research agenda (module docstring): each differs from lpo-fwd in one respect
register_method(Method("lpo-hellinger", "LPO-Hellinger", "lpo", "hellinger", color="C6"))
register_method(Method("lpo-tv", "LPO-TV", "lpo", "tv", color="C7"))
register_method(Method("lpo-alpha0.5", "LPO-alpha 0.5", "lpo", "alpha:0.5", color="C8"))
register_method(Method("lpo-alpha2", "LPO-alpha 2", "lpo", "alpha:2", color="C9"))
SCHEDULE_SWITCH_STEP = 20
# LPO-fwd's response entropy on tripsum falls from ~0.70 to ~0.65 nats/token in 40 steps at lr 1e-4, K=8 (a
# pilot): a threshold in between fires mid-run; the benchmark measures its own (auto_switch_entropy)
SCHEDULE_SWITCH_ENTROPY = 0.67
register_method(Method("lpo-fwd2rev-step", f"LPO fwd->rev at step {SCHEDULE_SWITCH_STEP}", "lpo", "fwd", color="C1",
                       schedule=f"fwd@0,rev@{SCHEDULE_SWITCH_STEP}"))
register_method(Method("lpo-fwd2rev-entropy", f"LPO fwd->rev at entropy < {SCHEDULE_SWITCH_ENTROPY}", "lpo", "fwd",
                       color="C5", schedule="fwd@0,rev", switch_entropy=SCHEDULE_SWITCH_ENTROPY, switch_window=3))
register_method(Method("lpo-fwd-tau0.5", "LPO-fwd, tau x 0.5", "lpo", "fwd", color="C0", linestyle="--",
                       temperature_scale=0.5))
register_method(Method("lpo-fwd-tau2", "LPO-fwd, tau x 2", "lpo", "fwd", color="C0", linestyle=":",
                       temperature_scale=2.0))
register_method(Method("lpo-fwd-replay", "LPO-fwd + replay (2 batches, 1:1)", "lpo", "fwd", color="C4",
                       replay_batches=2, replay_ratio=1.0, replay_max_abs_s=0.5))


def adhoc_method(name: str) -> Method:
    """``lpo:<divergence>``: LPO with any divergence name (``lpo:alpha:0.7``), temperature std."""
    div = name.split(":", 1)[1]
    return Method(name, f"LPO-{div}", "lpo", div, color="C9", linestyle="-.")


def parse_methods(text: str) -> List[Method]:
    """``"lpo-fwd,grpo"`` -> methods; unknown or repeated names raise ValueError naming --methods."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--methods is empty; give a comma-separated list, e.g. lpo-fwd,grpo")
    unknown = [n for n in names if n not in METHODS and not n.startswith("lpo:")]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {sorted(METHODS)} or lpo:<divergence>")
    if len(set(names)) != len(names):
        raise ValueError(f"--methods lists a method twice: {names}")
    out = []
    for n in names:
        try:
            out.append(METHODS[n] if n in METHODS else adhoc_method(n))
        except ValueError as e:
            raise ValueError(f"--methods {n}: {e}") from None
    return out
