"""Preflight check ``labels``: every label of the training and eval rows parses for its task.

Runs when ``--reward.remote_url`` is this package's reward file (``ctx.reward_is_ours``, found by the
``reward`` check): each label goes through :func:`openrlhf_lpo.rewards.reward_func.check_label`, the
task registry and the label parsers the reward itself reads labels with (Countdown ``nums`` /
``target``, code ``tests``, a non-empty math ``answer``, geometry ``answer`` / ``choices``); an unknown
task lists the registered ones. Another reward file reads labels its own way: only the
``--data.label_key`` column is checked (by ``datasets``).
"""

from __future__ import annotations

import re
from collections import Counter

from openrlhf_lpo.cli.preflight import PreflightError, register_check
from openrlhf_lpo.cli.preflight.datasets import RowProblems

_VALUE = re.compile(r",? \(?got .*$")


def _kind(label) -> str:
    if isinstance(label, dict):
        return "object"
    if isinstance(label, str) and label.lstrip().startswith("{"):
        return "JSON"
    return "bare answer"


@register_check("labels")
def check_labels(ctx) -> None:
    if not ctx.reward_is_ours:
        return
    from openrlhf_lpo.rewards.reward_func import check_label

    key = ctx.args.data.label_key
    errors = []
    for name in ("train", "eval"):
        facts = ctx.datasets.get(name)
        if facts is None or not facts.sources:
            continue
        if not key:
            raise PreflightError("--data.label_key is not set, so every label is empty and openrlhf_lpo's reward has "
                                 "nothing to grade against: pass --data.label_key label (the key the prepared "
                                 "files use)")
        problems = RowProblems(facts)
        tasks, kinds = Counter(), Counter()
        for i, label in enumerate(facts.column(key)):
            if label is None:
                problems.add(f"the label is missing (null) (--data.label_key {key})", i)
                continue
            try:
                tasks[check_label(label)] += 1
            except ValueError as e:
                problems.add(f"the label does not parse for its task: {_VALUE.sub('', str(e))}", i, str(e))
                continue
            kinds[_kind(label)] += 1
        try:
            problems.raise_if_any()
        except PreflightError as e:
            errors.append(str(e))
            continue
        ctx.say(f"  labels ({facts.flag}): " + ", ".join(f"{t} {n}" for t, n in sorted(tasks.items()))
                + " (" + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + ")")
    if errors:
        raise PreflightError("\n".join(errors))
