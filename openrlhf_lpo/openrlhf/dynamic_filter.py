"""DAPO's dynamic sampling with DAPO's criterion: a prompt group trains only when its scores are not all equal.

DAPO (Yu et al. 2025, arXiv 2503.14476, Eq. 11 and Algorithm 1) over-samples and drops the prompts whose K
responses are all correct or all wrong, ``0 < |{correct}| < G``: those groups have zero advantage everywhere
and only shrink the batch. With fractional rewards (the code task scores the fraction of tests passed) the same
condition is "the group's scores are not all equal" (std > 0, verl's DAPO filter). OpenRLHF 0.11.2 keeps a group
when its *mean* score lies strictly inside ``--algo.dynamic_filtering_range``, which for fractional rewards
keeps a group that scores 0.5 on every response: zero variance, zero advantage, no signal.

:class:`InformativeGroups` (a mixin of the project's samples generator) keeps a group when its scores are not
all equal **and** its mean lies inside ``--algo.dynamic_filtering_range`` (for scores in [0, 1] with the recipes'
range (0, 1) that is std > 0 alone), and replaces each dropped prompt with one new prompt, as upstream does: it
runs upstream's generation without upstream's filter, filters, and asks for as many prompts as it dropped,
until the batch is full or the prompts run out.

Public names (stable):
    informative(scores, score_range) -> bool
    InformativeGroups                mixin over openrlhf's SamplesGenerator (0.11.2): ``_generate_vllm``
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = ["informative", "InformativeGroups"]


def informative(scores: Sequence[float], score_range: Tuple[float, float]) -> bool:
    """A group trains: its scores are not all equal and their mean lies strictly inside ``score_range``."""
    lo, hi = score_range
    mean = sum(scores) / len(scores)
    return max(scores) > min(scores) and lo < mean < hi


class InformativeGroups:
    """``_generate_vllm`` with DAPO's group criterion (module doc); without dynamic filtering it is upstream's."""

    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):
        if not dynamic_filtering:
            return super()._generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        K = int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        score_range = tuple(self.args.algo.dynamic_filtering_range)
        accepted: List = []
        consumed, exhausted, want = 0, False, num_prompts
        while want > 0 and not exhausted:
            # upstream's generation without its filter: one prompt's K responses are consecutive
            experiences, n, exhausted = super()._generate_vllm(dataloader_iter, want, False, **generate_kwargs)
            consumed += n
            groups = [experiences[i:i + K] for i in range(0, len(experiences), K)]
            dropped = 0
            for group in groups:
                if all(e.scores is not None for e in group) and \
                        not informative([float(e.scores.reshape(-1)[0]) for e in group], score_range):
                    dropped += 1
                    continue
                accepted.extend(group)
            want = dropped  # one new prompt for each dropped one
        return accepted, consumed, exhausted
