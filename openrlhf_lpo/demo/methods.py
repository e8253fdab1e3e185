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
==============  ===============================  ==========
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

# PG estimator of openrlhf_lpo.listwise -> the name lpo-train knows it by (group_norm is OpenRLHF's GRPO)
_PIPELINE_ESTIMATOR = {"grpo": "group_norm", "dr_grpo": "dr_grpo", "maxrl": "maxrl"}


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    estimator: str               # "lpo" or a PG estimator of openrlhf_lpo.listwise (grpo, dr_grpo, maxrl)
    divergence: Optional[str]    # for LPO: key of openrlhf_lpo.listwise.DIVERGENCES
    temperature: str = "std"     # LPO temperature / the PG baseline's implicit temperature
    color: str = "C0"
    linestyle: str = "-"

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
            return ["--algo.advantage.estimator", "lpo", "--lpo.divergence", self.divergence] + metrics
        return ["--algo.advantage.estimator", _PIPELINE_ESTIMATOR[self.estimator]] + metrics


METHODS: Dict[str, Method] = {}


def register_method(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


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


def parse_methods(text: str) -> List[Method]:
    """``"lpo-fwd,grpo"`` -> methods; unknown or repeated names raise ValueError naming --methods."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--methods is empty; give a comma-separated list, e.g. lpo-fwd,grpo")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {sorted(METHODS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--methods lists a method twice: {names}")
    return [METHODS[n] for n in names]
