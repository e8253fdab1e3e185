"""Prompt templates give exact strings."""

import pytest

from evaluation.templates import TEMPLATES, render_prompt

Q = "What is $1+1$?"
MATH_I = "Please reason step by step, and put your final answer within \\boxed{}."


def test_qwen_boxed_and_cot_exact():
    assert render_prompt("qwen-boxed", Q, "math") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is $1+1$?\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_prompt("qwen25-math-cot", Q, "math") == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\nWhat is $1+1$?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_prompt("none", Q, "math") == Q + "\n" + MATH_I + "\n"
    assert render_prompt("qwen-boxed", "Pick one.\nA) x\nB) y", "choice").endswith(
        "B) y\nPlease reason step by step, and put the letter of your final answer choice within \\boxed{} "
        "(e.g. \\boxed{A}).<|im_end|>\n<|im_start|>assistant\n"
    )
    r1 = render_prompt("r1", Q, "math")
    assert r1.startswith("A conversation between User and Assistant.") and r1.endswith(
        "\nUser: What is $1+1$?\n" + MATH_I + "\nAssistant: <think>"
    )


def test_chat_templates_use_the_tokenizer(tmp_path):
    from openrlhf_lpo.testing.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    assert render_prompt("chat", Q, "math", tok) == f"<|im_start|>user\n{Q}\n{MATH_I}<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("verl-math", Q, "math", tok) == (
        f"<|im_start|>user\n{Q} Let's think step by step and output the final answer within \\boxed{{}}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="chat_template"):
        render_prompt("chat", Q, "math", None)
    with pytest.raises(ValueError, match="unknown --template"):
        render_prompt("qwen", Q, "math")
    import evaluation.benchmarks  # noqa: F401  (registers the vision benchmark's template)

    assert set(TEMPLATES) == {"qwen-boxed", "qwen25-math-cot", "verl-math", "r1", "chat", "chat-plain", "none", "prime",
                              "verl-geo3k"}  # vision
    assert render_prompt("chat-plain", "12+34", "math", tok) == "<|im_start|>user\n12+34<|im_end|>\n<|im_start|>assistant\n"


def test_system_prompt_and_chat_template_kwargs(tmp_path):
    from openrlhf_lpo.testing.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    assert render_prompt("qwen-boxed", Q, "math", system_prompt="Be brief.").startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert render_prompt("chat", Q, "math", tok, system_prompt="Be brief.") == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{Q}\n{MATH_I}<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="--system-prompt: template 'r1' has no system message"):
        render_prompt("r1", Q, "math", system_prompt="x")
    with pytest.raises(ValueError, match="--chat-template-kwargs: template 'qwen-boxed' does not use the chat template"):
        render_prompt("qwen-boxed", Q, "math", chat_template_kwargs={"enable_thinking": False})
    # a Qwen3-style template that reads enable_thinking: the kwarg reaches it
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                         "<think>\n\n</think>\n\n{% endif %}")
    off = render_prompt("chat-plain", "hi", "math", tok, chat_template_kwargs={"enable_thinking": False})
    on = render_prompt("chat-plain", "hi", "math", tok)
    assert off == on + "<think>\n\n</think>\n\n"


def test_default_stop_strings(tmp_path):
    from openrlhf_lpo.testing.tiny import build_tokenizer

    from evaluation.templates import default_stop

    tok = build_tokenizer(tmp_path)  # specials <|endoftext|>, <|im_start|>, <|im_end|>; eos <|im_end|>
    assert default_stop("qwen-boxed", None) == ["<|im_end|>"]
    assert default_stop("none", tok) == ["<|im_end|>", "<|endoftext|>"]
    assert default_stop("qwen-boxed", tok) == ["<|im_end|>", "<|endoftext|>"]
