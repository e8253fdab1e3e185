"""A reward every random tiny model earns in part: the fraction of vowels in the response.

Used by the end-to-end runs through lpo-train (``--reward.remote_url tests/pipeline/toy_reward.py``):
rewards are continuous in [0, 1], so a prompt's K responses almost never tie and every group carries
a listwise signal (non-zero coefficients, a non-zero gradient), while a run's policy can be watched
moving towards vowels. Same calling convention as openrlhf_lpo/rewards/reward_func.py.
"""

VOWELS = set("aeiouAEIOU")


def vowel_fraction(query: str, prompt: str) -> float:
    response = query[len(prompt):] if query.startswith(prompt) else query
    letters = [c for c in response if not c.isspace()]
    return sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0


def reward_func(queries, prompts, labels, **_):
    """The vowel fraction; a label ``const:<x>`` scores every response of its prompt x (a zero-variance group with a
    fractional score, for DAPO's dynamic sampling)."""
    import torch

    rewards = torch.tensor([float(str(l)[6:]) if str(l).startswith("const:") else vowel_fraction(q, p)
                            for q, p, l in zip(queries, prompts, labels)], dtype=torch.float32)
    return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {}}
