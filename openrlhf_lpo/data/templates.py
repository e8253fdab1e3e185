"""Prompt templates of the LPO paper (arXiv 2605.06139, Appendix F "Data Examples").

* Countdown follows Pan et al. (2025, TinyZero), base-model template: a User/Assistant
  conversation that ends in ``<think>`` and asks for the final expression in ``<answer>`` tags.
  The prompt is used as is (no chat template): ``--data.input_key prompt``.
* MATH follows the verl template: the problem, a space, then
  ``Let's think step by step and output the final answer within \\boxed{}.``, sent as the
  user turn of the model's chat template (``--data.apply_chat_template``).
* PRIME code follows Cui et al. (2025, Eurus-2-RL-Data): PRIME's action-based system prompt
  ([ASSESS] ... [OUTPUT]) and, as the user turn, the problem followed by
  ``\n\nWrite Python code to solve the problem. Present the code in \n```python\nYour code\n```\nat the end.``;
  the rows hold the two chat messages (``--data.apply_chat_template``).
* Geometry3k follows verl's ``geo3k`` preprocessing (the paper uses verl's official templates): the
  problem (which starts with ``<image>``), a space, then the instruction to think inside
  ``<think> </think>`` and put the final answer in ``\\boxed{}``; options, when a problem has them,
  follow the problem as ``Choices: A. .. B. ..``. ``geometry-short`` is a short instruction for
  tiny CPU models (the full one is ~215 character tokens).

Templates are a registry so a new task adds one entry; ``render(name, **fields)`` fills one.
"""

from __future__ import annotations

from typing import Callable, Dict, List

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

# verl's math instruction (its MATH/GSM8K preprocessing); lpo-eval's verl-style templates use it too
VERL_MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

# PRIME (Eurus-2-RL-Data) system prompt and code instruction, verbatim (whitespace included).
PRIME_SYSTEM_PROMPT = (
    "\nWhen tackling complex reasoning tasks, you have access to the following actions. Use them as needed "
    "to progress through your thought process.\n\n[ASSESS]\n\n[ADVANCE]\n\n[VERIFY]\n\n[SIMPLIFY]\n\n"
    "[SYNTHESIZE]\n\n[PIVOT]\n\n[OUTPUT]\n\nYou should strictly follow the format below:\n\n[ACTION NAME]\n\n"
    "# Your action step 1\n\n# Your action step 2\n\n# Your action step 3\n\n...\n\n"
    "Next action: [NEXT ACTION NAME]\n\n"
)
CODE_INSTRUCTION = "\n\nWrite Python code to solve the problem. Present the code in \n```python\nYour code\n```\nat the end."


GEOMETRY_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
GEOMETRY_SHORT_INSTRUCTION = "Answer in \\boxed{}."


def _with_choices(problem: str, choices=None) -> str:
    if not choices:
        return problem
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return problem + " Choices: " + " ".join(f"{letters[i]}. {c}" for i, c in enumerate(choices))


def _with_image(problem: str) -> str:
    """Geometry3k problems start with ``<image>`` (OpenRLHF's image placeholder); add it if missing."""
    return problem if "<image>" in problem else "<image>" + problem


def geometry_prompt(problem: str, choices=None) -> str:
    """The user-turn text for a Geometry3k problem (verl geo3k template)."""
    return f"{_with_choices(_with_image(problem), choices)} {GEOMETRY_INSTRUCTION}"


def geometry_short_prompt(problem: str, choices=None) -> str:
    """Geometry prompt with a short instruction (tiny CPU models)."""
    return f"{_with_choices(_with_image(problem), choices)} {GEOMETRY_SHORT_INSTRUCTION}"


def countdown_prompt(nums, target) -> str:
    """The Countdown prompt for ``nums`` (rendered as a Python list, e.g. ``[2, 54, 17]``) and ``target``."""
    return COUNTDOWN_TEMPLATE.format(nums=[int(n) for n in nums], target=int(target))


def math_prompt(problem: str) -> str:
    """The user-turn text for a MATH problem (verl template)."""
    return f"{problem} {VERL_MATH_INSTRUCTION}"


def code_prompt(problem: str) -> str:
    """The user-turn text for a code problem (PRIME template); the instruction is not repeated."""
    problem = problem.rstrip()
    if problem.endswith(CODE_INSTRUCTION.strip()):
        return problem[: -len(CODE_INSTRUCTION.strip())].rstrip() + CODE_INSTRUCTION
    return problem + CODE_INSTRUCTION


def code_messages(problem: str) -> List[Dict[str, str]]:
    """The chat messages of a code problem: PRIME's system prompt and :func:`code_prompt`."""
    return [{"role": "system", "content": PRIME_SYSTEM_PROMPT}, {"role": "user", "content": code_prompt(problem)}]


TEMPLATES: Dict[str, Callable[..., str]] = {
    "countdown": countdown_prompt,
    "math": math_prompt,
    "code": code_prompt,
    "geometry": geometry_prompt,
    "geometry-short": geometry_short_prompt,
}

# Whether the rendered text is a user turn (the chat template is applied by OpenRLHF).
USES_CHAT_TEMPLATE: Dict[str, bool] = {"countdown": False, "math": True, "code": True, "geometry": True,
                                       "geometry-short": True}


def render(name: str, **fields) -> str:
    """Fill template ``name`` (``countdown``: nums, target; ``math`` / ``code``: problem; ``geometry*``:
    problem, choices)."""
    if name not in TEMPLATES:
        raise ValueError(f"template {name!r} is unknown; choose one of {sorted(TEMPLATES)}")
    return TEMPLATES[name](**fields)
