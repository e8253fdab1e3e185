"""Prompt templates of the LPO paper (arXiv 2605.06139, Appendix F "Data Examples").

* Countdown follows Pan et al. (2025, TinyZero), base-model template: a User/Assistant
  conversation that ends in ``<think>`` and asks for the final expression in ``<answer>`` tags.
  The prompt is used as is (no chat template): ``--data.input_key prompt``.
* MATH follows the verl template: the problem, a space, then
  ``Let's think step by step and output the final answer within \\boxed{}.``, sent as the
  user turn of the model's chat template (``--data.apply_chat_template``).

Templates are a registry so a new task adds one entry; ``render(name, **fields)`` fills one.
"""

from __future__ import annotations

from typing import Callable, Dict

COUNTDOWN_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user "
    "with the answer.\n"
    "User: Using the numbers {nums}, create an equation that equals {target}. You can use basic "
    "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
    "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
    "<answer> (1 + 2) / 3 </answer>.\n"
    "Assistant: Let me solve this step by step.\n"
    "<think>"
)

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def countdown_prompt(nums, target) -> str:
    """The Countdown prompt for ``nums`` (rendered as a Python list, e.g. ``[2, 54, 17]``) and ``target``."""
    return COUNTDOWN_TEMPLATE.format(nums=[int(n) for n in nums], target=int(target))


def math_prompt(problem: str) -> str:
    """The user-turn text for a MATH problem (verl template)."""
    return f"{problem} {MATH_INSTRUCTION}"


TEMPLATES: Dict[str, Callable[..., str]] = {
    "countdown": countdown_prompt,
    "math": math_prompt,
}

# Whether the rendered text is a user turn (the chat template is applied by OpenRLHF).
USES_CHAT_TEMPLATE: Dict[str, bool] = {"countdown": False, "math": True}


def render(name: str, **fields) -> str:
    """Fill template ``name`` (``countdown``: nums, target; ``math``: problem)."""
    if name not in TEMPLATES:
        raise ValueError(f"template {name!r} is unknown; choose one of {sorted(TEMPLATES)}")
    return TEMPLATES[name](**fields)
