"""A reward that cannot be computed scores 0 with status error and is counted; the run stops only when
errors persist over a window (openrlhf_lpo/rewards/reward_errors.py, rewards/reward_func.py, openrlhf/reward_guard.py).
The end-to-end runs through lpo-train are in test_e2e_reward_errors.py."""

import errno
import json

import pytest
import torch

from openrlhf_lpo.data.countdown import countdown_label
from openrlhf_lpo.data.templates import countdown_prompt
from openrlhf_lpo.rewards.reward_errors import ERROR_KEY, ErrorWindow, RewardErrorsPersist, stop_message
from openrlhf_lpo.rewards import reward_func as rf

KEYS = {"answer_found", "grader_timeout", ERROR_KEY}


# ----------------------------------------------------------------------------- the window


def _brute_force_trips(flags, window, frac):
    """Index of the first sample after which the last ``window`` flags hold more than frac*window errors."""
    for i in range(window - 1, len(flags)):
        if sum(flags[i - window + 1:i + 1]) > frac * window:
            return i
    return None


@pytest.mark.parametrize("pattern", ["single", "burst", "late_persistent", "half", "just_over", "random"])
def test_window_stops_exactly_where_the_last_window_holds_too_many_errors(pattern):
    window, frac = 64, 0.5
    g = torch.Generator().manual_seed(3)
    flags = {
        "single": [i == 10 for i in range(500)],  # one failure: never
        "burst": [10 <= i < 40 for i in range(500)],  # 30 of 64: never
        "late_persistent": [i >= 300 for i in range(500)],  # a fault from sample 300 on: stops at 300 + 32
        "half": [i % 2 == 0 for i in range(500)],  # exactly 50%: never (more than frac stops)
        "just_over": [i % 2 == 0 or i == 201 for i in range(500)],
        "random": (torch.rand(500, generator=g) < 0.45).tolist(),
    }[pattern]
    expected = _brute_force_trips(flags, window, frac)
    w, stopped_at, batch = ErrorWindow(window, frac), None, 8
    for lo in range(0, len(flags), batch):  # batches as train_step sees them
        try:
            part = flags[lo:lo + batch]
            assert w.add(part) == pytest.approx(sum(part) / len(part))
        except RewardErrorsPersist as e:
            stopped_at = lo
            assert f"of the last {window} samples" in str(e)
            break
    if expected is None:
        assert stopped_at is None
    else:  # the batch holding the tripping sample is the one that stops the run
        assert stopped_at == expected // batch * batch
    if pattern in ("single", "burst", "half"):
        assert expected is None
    if pattern == "late_persistent":  # errors from sample 300 on: 33 of the last 64 at sample 332
        assert expected == 332


def test_a_window_that_is_not_full_never_stops_and_zero_never_stops():
    w = ErrorWindow(256, 0.5)
    assert w.add([True] * 255) == 1.0  # 255 failures, but fewer samples than the window
    with pytest.raises(RewardErrorsPersist):
        w.add([True])
    off = ErrorWindow(0, 0.5)
    for _ in range(10):
        assert off.add([True] * 100) == 1.0
    assert ErrorWindow(4, 1.0).add([True] * 100) == 1.0  # frac 1 never stops
    for bad in ((-1, 0.5), (8, 0.0), (8, 1.5)):
        with pytest.raises(ValueError):
            ErrorWindow(*bad)


def test_the_stop_message_names_the_causes_and_the_fix():
    msg = stop_message(200, 256, 0.5, [(180, "code", "OSError: [Errno 11] Resource temporarily unavailable"),
                                       (20, "math", "RuntimeError: zygote did not fork a worker within 60 s")])
    assert "200 of the last 256 samples (78% > --reward.error_stop_frac 0.5)" in msg
    assert "180 x task code: OSError: [Errno 11] Resource temporarily unavailable" in msg
    assert "--reward.error_window 0" in msg and "--ckpt.load_enable" in msg
    assert "SingleTurnExecutor" in stop_message(3, 4, 0.5, [])  # no cause reported: where to look


# ----------------------------------------------------------------------------- the reward file


@pytest.fixture
def failing_tasks():
    """Tasks whose reward raises as a loaded node's would (registered for the test, removed after)."""
    calls = {"n": 0}

    def spawn_fails(response, label):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    def fails_once(response, label):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("grader worker exited right after its fork")
        return 1.0, "ok"

    def sandbox_error(response, label):
        return 0.0, "error"  # what the code task reports when the sandbox died

    added = {"spawn_fails": spawn_fails, "fails_once": fails_once, "sandbox_error": sandbox_error}
    for name, fn in added.items():
        rf.register_reward(name)(fn)
    yield
    for name in added:
        rf.REWARDS.pop(name)


def test_a_failed_reward_scores_zero_with_status_error_and_the_batch_still_scores(failing_tasks, capsys):
    prompt = countdown_prompt([2, 54, 17], 35)
    good = prompt + " </think> <answer>54 - 17 - 2</answer>"
    labels = [countdown_label([2, 54, 17], 35), json.dumps({"task": "chess"}), json.dumps({"task": "spawn_fails"}),
              json.dumps({"task": "sandbox_error"}), countdown_label([2, 54, 17], 35)]
    out = rf.reward_func([good] * 5, [prompt] * 5, labels)
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert out["extra_logs"][ERROR_KEY].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert set(out["extra_logs"]) == KEYS
    err = capsys.readouterr().err  # each cause is reported once, with the task and the exception
    assert "(task chess)" in err and "ValueError: label task 'chess' is unknown" in err
    assert "(task spawn_fails)" in err and "Error: [Errno 11] Resource temporarily unavailable" in err
    assert "(task sandbox_error)" in err and "status 'error'" in err
    # the same keys for a batch without errors, so OpenRLHF's per-sample infos concatenate
    clean = rf.reward_func([good], [prompt], [labels[0]])
    assert set(clean["extra_logs"]) == KEYS and clean["extra_logs"][ERROR_KEY].tolist() == [0.0]


def test_a_reward_that_raises_once_costs_one_sample(failing_tasks):
    label = json.dumps({"task": "fails_once"})
    results = [rf.reward_func(["q"], ["p"], [label]) for _ in range(3)]
    assert [r["rewards"].tolist()[0] for r in results] == [0.0, 1.0, 1.0]
    assert [r["extra_logs"][ERROR_KEY].tolist()[0] for r in results] == [1.0, 0.0, 0.0]


def test_openrlhf_executor_gets_a_reward_for_a_failing_sample(tiny_model_dir):
    """Through the stock single-turn executor (which loads the file by path): before the per-sample
    catch the exception became reward=None there, which crashed the run later in padding code."""
    import asyncio
    from types import SimpleNamespace

    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    class Engine:
        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            completion = SimpleNamespace(token_ids=tok("an answer", add_special_tokens=False)["input_ids"],
                                         finish_reason="stop", logprobs=None)
            return SimpleNamespace(outputs=[completion])

    executor = SingleTurnAgentExecutor([rf.__file__])
    out = asyncio.run(executor.execute("p", json.dumps({"task": "chess"}), SimpleNamespace(max_tokens=8, logprobs=None),
                                       256, tok, Engine()))
    assert out["reward"] is not None and float(torch.as_tensor(out["reward"]).flatten()[0]) == 0.0
    assert float(out["extra_logs"][ERROR_KEY].flatten()[0]) == 1.0


# ----------------------------------------------------------------------------- the trainer's repair


def test_samples_without_a_reward_are_repaired_so_the_batch_concatenates(tiny_model_dir):
    """A reward file that raises outright gives reward=None and no extra_logs (upstream executor);
    Experience.concat_experiences then fails (F2). The trainer scores it 0 and counts it."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    from openrlhf_lpo.openrlhf.reward_guard import repair_samples

    def sample(reward):
        info = {"response_clip_ratio": torch.tensor([False])}
        if reward is not None:
            info.update(reward=torch.tensor([reward]), score=torch.tensor([reward]),
                        answer_found=torch.tensor([1.0]), **{ERROR_KEY: torch.tensor([0.0])})
        return Experience(sequences=torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                          action_mask=torch.tensor([[0, 1]]), rewards=None if reward is None else torch.tensor([reward]),
                          scores=None if reward is None else torch.tensor([reward]), info=info)

    broken = [sample(0.5), sample(None), sample(1.0)]
    with pytest.raises(Exception):
        Experience.concat_experiences([sample(0.5), sample(None)], 0)  # what upstream does with it
    assert repair_samples(broken) == [False, True, False]
    batch = Experience.concat_experiences(broken, 0)
    assert batch.rewards.tolist() == [0.5, 0.0, 1.0]
    assert batch.info[ERROR_KEY].tolist() == [0.0, 1.0, 0.0] and batch.info["answer_found"].tolist() == [1.0, 0.0, 1.0]
    assert batch.info["reward"].tolist() == [0.5, 0.0, 1.0]
