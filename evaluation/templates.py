"""Prompt templates by name (registry). A template maps (question, kind, tokenizer) to the prompt text.

* ``qwen-boxed``: Qwen2.5-Math's base-model prompt (ChatML written out, system "You are a helpful
  assistant.", the step-by-step ``\\boxed{}`` instruction after the question). SimpleRL-Zoo and most
  zero-RL work evaluate base models with it.
* ``qwen25-math-cot``: the instruction as the system prompt (Qwen2.5-Math-Instruct).
* ``verl-math``: the paper's training prompt (verl-style MATH preprocessing: the question followed by
  "Let's think step by step and output the final answer within \\boxed{}."), through the model's chat
  template.
* ``r1``: the DeepSeek-R1-Zero plain-text prompt with ``<think>`` reasoning (graded after ``</think>``).
* ``chat``: question + boxed instruction through the tokenizer's chat template.
* ``none``: question + boxed instruction, no chat markup.

Multiple-choice benchmarks get the option-letter instruction instead of the math one.
"""

from __future__ import annotations

from typing import Any, Callable

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = (
    "Please reason step by step, and put the letter of your final answer choice within \\boxed{} (e.g. \\boxed{A})."
)
VERL_MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
VERL_CHOICE_INSTRUCTION = "Let's think step by step and output the letter of the final answer choice within \\boxed{}."
# the instruction per problem kind; evaluation.code_benchmarks adds "code"
INSTRUCTIONS: dict[str, str] = {"math": MATH_INSTRUCTION, "choice": CHOICE_INSTRUCTION}

R1_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
    "the answer. The reasoning process is enclosed within <think> </think> tags, followed by the final "
    "answer, i.e., <think> reasoning process here </think> final answer here.\nUser: {question}\n{instruction}\n"
    "Assistant: <think>"
)


def _chatml(system: str | None, user: str) -> str:
    out = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return out + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _instruction(kind: str) -> str:
    return INSTRUCTIONS[kind]


def _apply_chat(tokenizer: Any, user: str, template_name: str) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--template {template_name} needs a tokenizer with a chat_template; use --template qwen-boxed or none "
            "for base models without one"
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )


TEMPLATES: dict[str, Callable[[str, str, Any], str]] = {}


def register_template(name: str):
    def deco(fn: Callable[[str, str, Any], str]):
        if name in TEMPLATES:
            raise ValueError(f"template {name!r} is already registered")
        TEMPLATES[name] = fn
        return fn

    return deco


@register_template("qwen-boxed")
def _qwen_boxed(question: str, kind: str, tokenizer: Any = None) -> str:
    return _chatml("You are a helpful assistant.", f"{question}\n{_instruction(kind)}")


@register_template("qwen25-math-cot")
def _qwen25_math_cot(question: str, kind: str, tokenizer: Any = None) -> str:
    return _chatml(_instruction(kind), question)


@register_template("verl-math")
def _verl_math(question: str, kind: str, tokenizer: Any = None) -> str:
    instr = {"choice": VERL_CHOICE_INSTRUCTION, "math": VERL_MATH_INSTRUCTION}.get(kind) or _instruction(kind)
    return _apply_chat(tokenizer, f"{question} {instr}", "verl-math")


@register_template("r1")
def _r1(question: str, kind: str, tokenizer: Any = None) -> str:
    return R1_TEMPLATE.format(question=question, instruction=_instruction(kind))


@register_template("chat")
def _chat(question: str, kind: str, tokenizer: Any = None) -> str:
    return _apply_chat(tokenizer, f"{question}\n{_instruction(kind)}", "chat")


@register_template("none")
def _none(question: str, kind: str, tokenizer: Any = None) -> str:
    return f"{question}\n{_instruction(kind)}\n"


def render_prompt(template: str, question: str, kind: str, tokenizer: Any = None) -> str:
    """The prompt for ``question`` under ``template`` (``kind``: "math" or "choice")."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown --template {template!r}; choose from {', '.join(TEMPLATES)}")
    if kind not in INSTRUCTIONS:
        raise ValueError(f"kind must be one of {sorted(INSTRUCTIONS)}, got {kind!r}")
    return TEMPLATES[template](question, kind, tokenizer)


def template_needs_tokenizer(template: str) -> bool:
    return template in ("chat", "verl-math")
