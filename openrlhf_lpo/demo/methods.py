"""The methods the demo compares, by name, and how each maps to ``lpo-train`` flags.

A method is a projection of the same listwise Gibbs target (``w* = softmax(R/tau)`` with the group
std as ``tau``, Eq. 8): GRPO fits it to first order through the policy gradient (Prop. 1), LPO
projects onto it exactly with a divergence (Eq. 10 forward KL, Eq. 11 reverse KL). Matching the
temperature keeps the comparison strict: only the projection differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    estimator: str               # "lpo" or a policy-gradient estimator of openrlhf_lpo.listwise
    divergence: Optional[str]    # for LPO: key of openrlhf_lpo.listwise.DIVERGENCES
    temperature: str = "std"     # LPO temperature / the PG baseline's implicit temperature
    color: str = "C0"

    @property
    def is_lpo(self) -> bool:
        return self.estimator == "lpo"

    def pipeline_flags(self) -> List[str]:
        """``lpo-train`` flags selecting this method (OpenRLHF's ``group_norm`` is GRPO); every
        method logs KL(w*||P) after its update against the same target (``--lpo.end_kl``)."""
        metrics = ["--lpo.temperature", self.temperature, "--lpo.end_kl"]
        if self.is_lpo:
            return ["--algo.advantage.estimator", "lpo", "--lpo.divergence", self.divergence] + metrics
        upstream = {"grpo": "group_norm", "dr_grpo": "dr_grpo"}[self.estimator]
        return ["--algo.advantage.estimator", upstream] + metrics


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
