"""Preflight check ``prompts``: the prompts as the rollout will see them, and their length in tokens.

* ``--rollout.max_new_tokens`` must leave room for a prompt in ``--data.max_len``;
* every training prompt is rendered with upstream's own ``preprocess_data`` (``--data.input_template``,
  the chat template of ``--data.apply_chat_template``; a vision-language model's processor when it loads
  without running shipped code), so a row the template refuses is named here;
* tokens are counted as OpenRLHF's rollout counts them (``tokenizer(prompt, add_special_tokens=False)``):
  percentiles over all rows, or over an evenly spaced sample of :data:`SAMPLE` rows of a larger dataset;
* rows longer than the prompt may be are counted exactly (datasets above :data:`RENDER_ALL` rows: over an
  evenly spaced subset of that many, said in the summary): the rollout keeps the room
  ``--data.max_len - --rollout.max_new_tokens`` (``--data.max_len - 1`` without it) and cuts a longer
  prompt from the left (its start is lost); an image prompt that long is an error in the engine, so it is
  one here. Only rows whose UTF-8 length could exceed the room are tokenized for this (a token covers at
  least one byte, plus one for a prefix space), unless the tokenizer's normalizer can lengthen text
  (NFD/NFKD/NFKC...): then every row is.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List

from openrlhf_lpo.cli.preflight import PreflightError, register_check
from openrlhf_lpo.cli.preflight.datasets import RowProblems

SAMPLE = 2048            # rows whose tokens give the percentiles
RENDER_ALL = 200_000     # rows rendered and checked for truncation; a larger dataset: an evenly spaced subset
PERCENTILES = (50, 90, 99)
_SAFE_NORMALIZERS = {"NFC", "Lowercase", "Replace", "Prepend", "Strip", "StripAccents", "Sequence"}


def spaced(n: int, k: int) -> List[int]:
    """``range(n)``, or ``k`` evenly spaced indices of it (first and last included) when ``n > k``."""
    return list(range(n)) if n <= k else sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})


def percentile(sorted_values: List[int], p: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(math.ceil(p / 100 * len(sorted_values)) - 1, 0)]


def _byte_bound_holds(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    normalizer = backend.normalizer
    if normalizer is None:
        return True
    names = set(re.findall(r"([A-Za-z]+)\(", repr(normalizer)))
    return names <= _SAFE_NORMALIZERS


def _renderer(ctx):
    """``apply_chat_template`` as upstream calls it (or None without a chat template), or a note why not."""
    if not ctx.args.data.apply_chat_template:
        return None, None
    model = ctx.model
    if model.vlm:
        try:
            from transformers import AutoProcessor

            return AutoProcessor.from_pretrained(model.path, trust_remote_code=False).apply_chat_template, None
        except Exception as e:  # noqa: BLE001 - e.g. a processor shipped as code: not run by preflight
            return False, f"the processor of {model.name} does not load without its own code ({type(e).__name__})"
    return model.tokenizer.apply_chat_template, None


def _count(tokenizer, texts: List[str]) -> List[int]:
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


@register_check("prompts")
def check_prompts(ctx) -> None:
    args = ctx.args
    max_len, max_new = args.data.max_len, args.rollout.max_new_tokens
    if max_new is not None and max_new >= max_len:
        raise PreflightError(f"--rollout.max_new_tokens {max_new} >= --data.max_len {max_len}: no room is left for the "
                             f"prompt (--data.max_len counts prompt + response); raise --data.max_len")
    facts = ctx.datasets.get("train")
    if facts is None or not facts.sources:
        return
    tokenizer = getattr(ctx.model, "tokenizer", None)
    if tokenizer is None:
        ctx.say("prompt tokens: not counted (no tokenizer of the model here)")
        return
    render, why = _renderer(ctx)
    if render is False:
        ctx.say(f"prompt tokens: not counted ({why})")
        return
    from openrlhf.datasets.prompts_dataset import preprocess_data

    data = args.data
    problems = RowProblems(facts)
    values = facts.column(data.input_key)
    rows = spaced(len(values), RENDER_ALL)
    prompts: Dict[int, str] = {}
    for i in rows:
        try:
            prompts[i] = preprocess_data({data.input_key: values[i]}, data.input_template, data.input_key, None,
                                         render)[0]
        except Exception as e:  # noqa: BLE001 - the template's own error, per row
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            problems.add(f"the chat template fails on the prompt ({type(e).__name__}: {first[:160]})", i)
    problems.raise_if_any()
    room = max_len - max_new if max_new is not None else max_len - 1
    sample = [rows[k] for k in spaced(len(rows), SAMPLE)]
    if _byte_bound_holds(tokenizer):
        candidates = [i for i in rows if len(prompts[i].encode("utf-8", "surrogatepass")) + 1 > room]
    else:
        candidates = list(rows)
    todo = sorted(set(sample) | set(candidates))
    counted = dict(zip(todo, _count(tokenizer, [prompts[i] for i in todo])))
    lengths = sorted(counted[i] for i in sample)
    over = [i for i in candidates if counted[i] > room]
    shown = ", ".join(f"p{p} {percentile(lengths, p)}" for p in PERCENTILES)
    label = "all rows" if len(sample) == len(values) else f"a {len(sample)}-row sample of {len(values)}"
    scope = "" if len(rows) == len(values) else f" (of an evenly spaced {len(rows)}-row subset)"
    ctx.say(f"prompt tokens ({facts.flag}, {label}, tokenizer of {ctx.model.name}"
            + (", text only: each image adds its own" if data.max_images_per_prompt > 0 else "")
            + f"): {shown}, max {max(counted.values())}")
    limit = (f"--data.max_len {max_len} - --rollout.max_new_tokens {max_new}" if max_new is not None
             else f"--data.max_len {max_len} - 1")
    if not over:
        ctx.say(f"  truncated prompts: none{scope} (room {room} tokens = {limit})")
        return
    where = facts.locations()
    if data.max_images_per_prompt > 0:
        image_rows = set(i for i, v in enumerate(facts.column(data.image_key)) if v)
        bad = [i for i in over if i in image_rows]
        for i in bad:
            problems.add(f"an image prompt longer than the {room} tokens it may use ({limit}); the engine refuses "
                         "image prompts it would cut: raise --data.max_len or shorten the prompt", i)
        problems.raise_if_any()
    first = where[over[0]]
    ctx.say(f"  truncated prompts: {len(over)} row(s){scope} exceed the room of {room} tokens ({limit}); the rollout cuts "
            f"them from the left, losing their start (first: {first[0].where(first[1])}, {counted[over[0]]} tokens)")
