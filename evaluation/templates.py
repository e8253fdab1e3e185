"""Prompt templates by name (registry). A template maps (question, kind, context) to the prompt text.

* ``qwen-boxed``: Qwen2.5-Math's base-model prompt (ChatML written out, system "You are a helpful
  assistant.", the step-by-step ``\\boxed{}`` instruction after the question). SimpleRL-Zoo and most
  zero-RL work evaluate base models with it.
* ``qwen25-math-cot``: the instruction as the system prompt (Qwen2.5-Math-Instruct).
* ``verl-math``: the paper's training prompt (verl-style MATH preprocessing: the question followed by
  "Let's think step by step and output the final answer within \\boxed{}."), through the model's chat
  template.
* ``r1``: the DeepSeek-R1-Zero plain-text prompt with ``<think>`` reasoning (graded after ``</think>``).
* ``chat``: question + boxed instruction through the tokenizer's chat template.
* ``chat-plain``: the question alone through the chat template (custom tasks whose questions carry
  their own instructions).
* ``none``: question + boxed instruction, no chat markup.
* ``prime``: the paper's PRIME training prompt (Eurus-2-RL-Data): PRIME's system prompt, then the
  question, a blank line and the kind's instruction (PRIME's own ``\boxed{}`` wording for math),
  through the tokenizer's chat template, or as ChatML when the tokenizer has none.

The instruction comes from the problem kind (:data:`INSTRUCTIONS`): multiple-choice benchmarks get the
option-letter instruction instead of the math one, code benchmarks the code-block instruction
(registered by :mod:`evaluation.code_benchmarks`).

Context (:class:`PromptContext`): the tokenizer, ``--system-prompt`` (a system message for the
templates that have one: it replaces qwen-boxed's "You are a helpful assistant." and is added to the
chat templates) and ``--chat-template-kwargs`` (passed to ``apply_chat_template``, e.g.
``enable_thinking=False`` for Qwen3). A template that cannot honour one of them raises a ValueError
naming the flag.

Stop strings: :func:`default_stop` is the template's end-of-turn markup plus the end-of-turn special
tokens the tokenizer knows (``<|im_end|>``, ``<|endoftext|>``, ``</s>``, ``<|eot_id|>``, ...), so a
base checkpoint whose config lists only ``<|endoftext|>`` as eos still stops at the end of its turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from openrlhf_lpo.data.templates import PRIME_SYSTEM_PROMPT, VERL_MATH_INSTRUCTION
from openrlhf_lpo.registry import register_unique

QWEN_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."  # Qwen2.5-Math CoT
CHOICE_INSTRUCTION = (
    "Please reason step by step, and put the letter of your final answer choice within \\boxed{} (e.g. \\boxed{A})."
)
VERL_CHOICE_INSTRUCTION = "Let's think step by step and output the letter of the final answer choice within \\boxed{}."
QWEN_SYSTEM = "You are a helpful assistant."
PRIME_MATH_INSTRUCTION = "Present the answer in LaTex format: \\boxed{Your answer}"  # Eurus-2-RL-Data's math rows

R1_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
    "the answer. The reasoning process is enclosed within <think> </think> tags, followed by the final "
    "answer, i.e., <think> reasoning process here </think> final answer here.\nUser: {question}\n{instruction}\n"
    "Assistant: <think>"
)

# End-of-turn / end-of-text special tokens of common chat formats (Qwen/ChatML, Llama 2/3, Mistral,
# DeepSeek, Gemma, Phi). default_stop keeps those the tokenizer actually has.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
    "<｜end▁of▁sentence｜>", "<end_of_turn>", "<|end|>",
)


@dataclass(frozen=True)
class PromptContext:
    """What a template may use besides the question: tokenizer, system prompt, chat-template arguments."""

    tokenizer: Any = None
    system_prompt: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Template:
    """A registered template. ``stop``: end-of-turn strings its own markup uses."""

    name: str
    render: Callable[[str, str, PromptContext], str]
    uses_chat_template: bool = False
    system_prompt: bool = False  # accepts --system-prompt
    stop: tuple[str, ...] = ()


def _chatml(system: str | None, user: str) -> str:
    out = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return out + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


# Per problem kind: (instruction after the question, the verl-style instruction). A new kind registers its
# pair here (code: evaluation.code_benchmarks).
INSTRUCTIONS: dict[str, tuple[str, str]] = {
    "math": (QWEN_MATH_INSTRUCTION, VERL_MATH_INSTRUCTION),
    "choice": (CHOICE_INSTRUCTION, VERL_CHOICE_INSTRUCTION),
}


def _instruction(kind: str) -> str:
    return INSTRUCTIONS[kind][0]


def apply_chat(ctx: PromptContext, user: str | list, template_name: str) -> str:
    """``user`` (text, or a content list with image items) as the user turn through the tokenizer's chat
    template, after ``--system-prompt`` if given, with ``--chat-template-kwargs``."""
    tok = ctx.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError(
            f"--template {template_name} needs a tokenizer with a chat_template; use --template qwen-boxed or none "
            "for base models without one"
        )
    messages = ([{"role": "system", "content": ctx.system_prompt}] if ctx.system_prompt is not None else []) + [
        {"role": "user", "content": user}
    ]
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **ctx.chat_template_kwargs)
    except TypeError as e:
        raise ValueError(f"--chat-template-kwargs {ctx.chat_template_kwargs}: rejected by the chat template ({e})") from None


TEMPLATES: dict[str, Template] = {}


def register_template(name: str, *, uses_chat_template: bool = False, system_prompt: bool = False,
                      stop: tuple[str, ...] = ()):
    """Register ``fn(question, kind, ctx) -> prompt`` as template ``name``."""

    def deco(fn: Callable[[str, str, PromptContext], str]):
        register_unique(TEMPLATES, "template", name, Template(name, fn, uses_chat_template, system_prompt, tuple(stop)))
        return fn

    return deco


@register_template("qwen-boxed", system_prompt=True, stop=("<|im_end|>",))
def _qwen_boxed(question: str, kind: str, ctx: PromptContext) -> str:
    system = QWEN_SYSTEM if ctx.system_prompt is None else ctx.system_prompt
    return _chatml(system, f"{question}\n{_instruction(kind)}")


@register_template("qwen25-math-cot", stop=("<|im_end|>",))
def _qwen25_math_cot(question: str, kind: str, ctx: PromptContext) -> str:
    return _chatml(_instruction(kind), question)


@register_template("verl-math", uses_chat_template=True, system_prompt=True)
def _verl_math(question: str, kind: str, ctx: PromptContext) -> str:
    return apply_chat(ctx, f"{question} {INSTRUCTIONS[kind][1]}", "verl-math")


@register_template("r1")
def _r1(question: str, kind: str, ctx: PromptContext) -> str:
    return R1_TEMPLATE.format(question=question, instruction=_instruction(kind))


@register_template("chat", uses_chat_template=True, system_prompt=True)
def _chat(question: str, kind: str, ctx: PromptContext) -> str:
    return apply_chat(ctx, f"{question}\n{_instruction(kind)}", "chat")


@register_template("chat-plain", uses_chat_template=True, system_prompt=True)
def _chat_plain(question: str, kind: str, ctx: PromptContext) -> str:
    return apply_chat(ctx, question, "chat-plain")


@register_template("none")
def _none(question: str, kind: str, ctx: PromptContext) -> str:
    return f"{question}\n{_instruction(kind)}\n"


@register_template("prime", uses_chat_template=True, system_prompt=True, stop=("<|im_end|>",))
def _prime(question: str, kind: str, ctx: PromptContext) -> str:
    instr = {"math": PRIME_MATH_INSTRUCTION}.get(kind) or _instruction(kind)
    ctx = replace(ctx, system_prompt=PRIME_SYSTEM_PROMPT if ctx.system_prompt is None else ctx.system_prompt)
    user = f"{question.rstrip()}\n\n{instr}"
    if ctx.tokenizer is not None and getattr(ctx.tokenizer, "chat_template", None):
        return apply_chat(ctx, user, "prime")
    if ctx.chat_template_kwargs:
        raise ValueError("--chat-template-kwargs: the tokenizer has no chat template, so --template prime writes ChatML "
                         "itself and cannot pass them")
    return _chatml(ctx.system_prompt, user)


def get_template(name: str) -> Template:
    if name not in TEMPLATES:
        raise ValueError(f"unknown --template {name!r}; choose from {', '.join(TEMPLATES)}")
    return TEMPLATES[name]


def check_context(template: str, system_prompt: str | None, chat_template_kwargs: dict | None) -> None:
    """ValueError naming the flag when ``template`` cannot honour ``--system-prompt`` / ``--chat-template-kwargs``."""
    t = get_template(template)
    if system_prompt is not None and not t.system_prompt:
        with_system = ", ".join(n for n, x in TEMPLATES.items() if x.system_prompt)
        raise ValueError(f"--system-prompt: template {template!r} has no system message; use one of {with_system}")
    if chat_template_kwargs and not t.uses_chat_template:
        chat = ", ".join(n for n, x in TEMPLATES.items() if x.uses_chat_template)
        raise ValueError(f"--chat-template-kwargs: template {template!r} does not use the chat template; use one of {chat}")


def render_prompt(template: str, question: str, kind: str, tokenizer: Any = None, system_prompt: str | None = None,
                  chat_template_kwargs: dict | None = None) -> str:
    """The prompt for ``question`` under ``template`` (``kind``: a key of :data:`INSTRUCTIONS`)."""
    t = get_template(template)
    if kind not in INSTRUCTIONS:
        raise ValueError(f"kind must be one of {', '.join(INSTRUCTIONS)}, got {kind!r}")
    check_context(template, system_prompt, chat_template_kwargs)
    return t.render(question, kind, PromptContext(tokenizer, system_prompt, dict(chat_template_kwargs or {})))


def template_needs_tokenizer(template: str) -> bool:
    return get_template(template).uses_chat_template


def tokenizer_special_tokens(tokenizer: Any) -> set[str]:
    """Strings the tokenizer encodes as one special/added token."""
    if tokenizer is None:
        return set()
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    try:
        out |= set(tokenizer.get_added_vocab())
    except Exception:
        pass
    return out


def default_stop(template: str, tokenizer: Any = None) -> list[str]:
    """The template's end-of-turn strings + the tokenizer's end-of-turn special tokens + its eos."""
    specials = tokenizer_special_tokens(tokenizer)
    out = list(get_template(template).stop)
    out += [t for t in END_OF_TURN_TOKENS if t in specials]
    eos = getattr(tokenizer, "eos_token", None) if tokenizer is not None else None
    if eos:
        out.append(eos)
    return list(dict.fromkeys(out))
