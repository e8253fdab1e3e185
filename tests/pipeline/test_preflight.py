"""lpo-train's preflight: every bad input stops ``lpo-train`` and ``lpo-train --dry-run`` with exit 2 and a
message naming the file, line or field, before Ray or any model starts; good inputs get a summary in the plan.

Runs ``main`` in this process on real files: the tiny offline Qwen3 (character tokenizer: a prompt's tokens
are its characters, which the tests use as the independent count), OpenRLHF's own dataset loader, the
project's reward file in a real subprocess. A real launch that got past the preflight would start Ray: the
tests replace the first step after the preflight (``enter_before_train``) with a tripwire.
"""

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from openrlhf_lpo.cli import flags as cli_flags
from openrlhf_lpo.cli.train_ppo_ray import main

REPO = Path(__file__).resolve().parents[2]
REWARD = str(REPO / "openrlhf_lpo" / "rewards" / "reward_func.py")


class Started(Exception):
    """The run went past the preflight."""


@pytest.fixture(autouse=True)
def tripwire(monkeypatch):
    def started(stack, args):
        raise Started

    monkeypatch.setattr(cli_flags, "enter_before_train", started)


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def rows(n, label="1", prefix="problem"):
    return [{"prompt": f"{prefix} {i}", "label": label} for i in range(n)]


def argv_for(tmp_path, data, model, *extra, dry=True, reward=REWARD):
    base = {
        "--actor.model_name_or_path": str(model), "--data.prompt_dataset": str(data), "--data.input_key": "prompt",
        "--data.label_key": "label", "--reward.remote_url": str(reward), "--actor.num_gpus_per_node": "2",
        "--vllm.num_engines": "1", "--algo.kl.init_coef": "0", "--rollout.n_samples_per_prompt": "4",
        "--rollout.batch_size": "4", "--train.batch_size": "16", "--train.micro_batch_size": "2",
        "--algo.advantage.estimator": "lpo", "--rollout.max_new_tokens": "32", "--data.max_len": "512",
        "--ckpt.path": str(tmp_path / "ckpt"), "--ckpt.output_dir": str(tmp_path / "final"),
    }
    switches = []
    extra = list(extra)
    while extra:
        flag = extra.pop(0)
        if extra and not extra[0].startswith("--"):
            base[flag] = extra.pop(0)
        elif flag.startswith("--no:"):
            base.pop(flag[5:], None)
        else:
            switches.append(flag)
    argv = [x for kv in base.items() for x in kv] + switches
    return argv + (["--dry-run"] if dry else [])


def lpo_train(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    except Started:
        code = "started"
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(argv, capsys, *needles):
    code, out, err = lpo_train(argv, capsys)
    assert code == 2, (code, out[-2000:], err[-3000:])
    assert "nothing was started" in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# ----------------------------------------------------------------------------- the issue's five bad inputs


def _broken_json(tmp_path, model):
    data = jsonl(tmp_path / "broken.jsonl", ['{"prompt": "a", "label": "1"}', '{"prompt": "b", "label": ',
                                             '{"prompt": "c", "label": "3"}'])
    return argv_for(tmp_path, data, model), [f"{data}:2: invalid JSON"]


def _missing_input_key(tmp_path, model):
    data = jsonl(tmp_path / "q.jsonl", [{"question": "1+1?", "label": "2"}] * 3)
    return argv_for(tmp_path, data, model), [
        f"--data.input_key prompt: {data} has no key 'prompt'; its keys: question, label"]


def _empty_dataset(tmp_path, model):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n")
    return argv_for(tmp_path, data, model), [f"{data}: the file is empty (no rows)"]


def _missing_model(tmp_path, model):
    data = jsonl(tmp_path / "ok.jsonl", rows(4))
    missing = tmp_path / "models" / "qwen3-missing"
    return argv_for(tmp_path, data, missing), [f"--actor.model_name_or_path {missing}: no such directory"]


def _missing_reward(tmp_path, model):
    data = jsonl(tmp_path / "ok.jsonl", rows(4))
    reward = tmp_path / "my_reward.py"
    return argv_for(tmp_path, data, model, reward=reward), [f"--reward.remote_url {reward}: no such file"]


FIVE = {"broken_json_line_2": _broken_json, "missing_input_key": _missing_input_key, "empty_dataset": _empty_dataset,
        "missing_local_model": _missing_model, "missing_reward_file": _missing_reward}


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "launch"])
@pytest.mark.parametrize("case", sorted(FIVE))
def test_the_issues_bad_inputs_stop_before_anything_starts(case, dry, tmp_path, tiny_model_dir, capsys):
    import ray

    argv, needles = FIVE[case](tmp_path, tiny_model_dir)
    argv = argv if dry else argv[:-1]
    refused(argv, capsys, *needles)
    assert not ray.is_initialized()


def test_every_problem_is_reported_at_once(tmp_path, tiny_model_dir, capsys):
    argv, _ = _broken_json(tmp_path, tiny_model_dir)
    evalset = jsonl(tmp_path / "eval.jsonl", [{"question": "x", "label": "1"}])
    argv = argv_for(tmp_path, tmp_path / "broken.jsonl", tmp_path / "nope" / "model", "--eval.dataset", str(evalset),
                    reward=tmp_path / "r.py")
    err = refused(argv, capsys, "preflight found 3 problem(s)", "broken.jsonl:2: invalid JSON",
                  f"{evalset} has no key 'prompt'",
                  "no such directory", "r.py: no such file", "--preflight off skips these checks")
    assert "[datasets]" in err and "[model]" in err and "[reward]" in err


def test_preflight_off_skips_the_checks(tmp_path, tiny_model_dir, capsys):
    argv, _ = _broken_json(tmp_path, tiny_model_dir)
    code, out, _ = lpo_train(argv + ["--preflight", "off"], capsys)
    assert code == 0 and "--preflight off: inputs are not checked" in out and "preflight: off" in out


# ----------------------------------------------------------------------------- datasets read as upstream


def test_a_good_dry_run_prints_the_summary(tmp_path, tiny_model_dir, capsys):
    data = jsonl(tmp_path / "math.jsonl", rows(10) + [{"prompt": "problem 3", "label": "7"}])
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir), capsys)
    assert code == 0, err
    assert "dataset: 11 prompts -> 3 rollout batches" in out
    assert f"--data.prompt_dataset: 11 rows from {data} (keys: prompt, label)" in out
    assert f"duplicate prompts: 1 row(s) repeat an earlier prompt (first: {data}:11 = {data}:4)" in out
    assert "labels (--data.prompt_dataset): math 11 (bare answer 11)" in out
    assert "openrlhf_lpo's: labels are checked with its parsers" in out
    assert "preflight: 6 checks passed" in out


def test_json_parquet_and_dataset_folders_with_splits(tmp_path, tiny_model_dir, capsys):
    import datasets

    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(rows(5), indent=2))
    code, out, err = lpo_train(argv_for(tmp_path, listed, tiny_model_dir), capsys)
    assert code == 0 and "dataset: 5 prompts" in out, err
    parquet = tmp_path / "p.parquet"
    datasets.Dataset.from_list(rows(6)).to_parquet(str(parquet))
    code, out, err = lpo_train(argv_for(tmp_path, parquet, tiny_model_dir), capsys)
    assert code == 0 and "dataset: 6 prompts" in out, err
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(3)),
                          "test": datasets.Dataset.from_list(rows(2))}).save_to_disk(str(folder))
    code, out, err = lpo_train(argv_for(tmp_path, folder, tiny_model_dir, "--data.prompt_split", "test"), capsys)
    assert code == 0 and "dataset: 2 prompts" in out, err
    refused(argv_for(tmp_path, folder, tiny_model_dir, "--data.prompt_split", "validation"), capsys,
            f"--data.prompt_split validation: {folder} has no split 'validation'; its splits: test, train")
    refused(argv_for(tmp_path, listed, tiny_model_dir, "--data.prompt_split", "test"), capsys,
            "has no split 'test'; its splits: train (a local file has only 'train')")
    hollow = tmp_path / "hollow"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(1)),
                          "test": datasets.Dataset.from_list(rows(1)).filter(lambda r: False)}).save_to_disk(str(hollow))
    refused(argv_for(tmp_path, hollow, tiny_model_dir, "--data.prompt_split", "test"), capsys,
            f"--data.prompt_dataset {hollow}: the dataset is empty (0 rows in split 'test')")
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_list(rows(1)).select([]).to_parquet(str(empty))
    refused(argv_for(tmp_path, empty, tiny_model_dir), capsys, f"{empty}: the file is empty (no rows)")


def test_blends_and_caps_match_openrlhfs_own_loader(tmp_path, tiny_model_dir, capsys):
    """Comma-separated datasets, --data.prompt_probs and --data.max_samples give the rows upstream gives."""
    from types import SimpleNamespace

    from openrlhf.datasets.utils import blending_datasets

    a = jsonl(tmp_path / "a.jsonl", rows(6, prefix="a"))
    b = jsonl(tmp_path / "b.jsonl", rows(3, prefix="b"))
    strategy = SimpleNamespace(print=lambda *x: None, is_rank_0=lambda: False, args=SimpleNamespace(use_ms=False))
    blend = blending_datasets(f"{a},{b}", "0.5,0.5", strategy, 42, max_count=int(1e8))
    assert len(blend) > 9  # interleaving until every dataset is exhausted oversamples the short one
    code, out, err = lpo_train(argv_for(tmp_path, f"{a},{b}", tiny_model_dir, "--data.prompt_probs", "0.5,0.5"), capsys)
    assert code == 0 and f"dataset: {len(blend)} prompts" in out, err
    refused(argv_for(tmp_path, f"{a},{b}", tiny_model_dir, "--data.prompt_probs", "0.5"), capsys,
            "--data.prompt_probs '0.5' has 1 value(s) but --data.prompt_dataset names 2 dataset(s)")
    code, out, err = lpo_train(argv_for(tmp_path, f"{a},{b}", tiny_model_dir, "--data.max_samples", "7"), capsys)
    assert code == 0 and "dataset: 7 prompts" in out, err
    # a bad label beyond --data.max_samples never reaches the trainer: not an error; within it, it is
    bad = jsonl(tmp_path / "bad.jsonl", rows(8) + [{"prompt": "x", "label": json.dumps({"task": "chess"})}])
    code, out, err = lpo_train(argv_for(tmp_path, bad, tiny_model_dir, "--data.max_samples", "8"), capsys)
    assert code == 0, err
    refused(argv_for(tmp_path, bad, tiny_model_dir), capsys, f"{bad}:9")
    refused(argv_for(tmp_path, bad, tiny_model_dir, "--data.max_samples", "0"), capsys, "--data.max_samples 0")


def test_prompt_and_key_problems_name_the_rows(tmp_path, tiny_model_dir, capsys):
    data = jsonl(tmp_path / "p.jsonl", rows(3) + [{"prompt": "", "label": "1"}, {"prompt": None, "label": "1"}])
    refused(argv_for(tmp_path, data, tiny_model_dir), capsys, f"the prompt is empty (--data.input_key prompt): "
            f"1 row(s): {data}:4", f"the prompt is missing (null) (--data.input_key prompt): 1 row(s): {data}:5")
    chat = jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": "1"}] * 2)
    refused(argv_for(tmp_path, chat, tiny_model_dir), capsys, "add --data.apply_chat_template", f"{chat}:1, {chat}:2")
    code, out, err = lpo_train(argv_for(tmp_path, chat, tiny_model_dir, "--data.apply_chat_template"), capsys)
    assert code == 0, err
    refused(argv_for(tmp_path, data, tiny_model_dir, "--data.label_key", "answer"), capsys,
            f"--data.label_key answer: {data} has no key 'answer'; its keys: prompt, label")
    refused(argv_for(tmp_path, data, tiny_model_dir, "--data.input_template", "Q: {} {x}"), capsys,
            "--data.input_template 'Q: {} {x}': str.format fails")
    evalset = jsonl(tmp_path / "e.jsonl", ['{"prompt": "a", "label": "1"}', "not json"])
    refused(argv_for(tmp_path, jsonl(tmp_path / "ok.jsonl", rows(4)), tiny_model_dir, "--eval.dataset", str(evalset)),
            capsys, f"--eval.dataset: {evalset}:2: invalid JSON")
    refused(argv_for(tmp_path, tmp_path / "nothere.jsonl", tiny_model_dir), capsys,
            f"--data.prompt_dataset {tmp_path / 'nothere.jsonl'}: no such file")
    lists = jsonl(tmp_path / "lists.jsonl", ['{"prompt": "a", "label": "1"}', '[1, 2]'])
    refused(argv_for(tmp_path, lists, tiny_model_dir), capsys, f"{lists}:2: a JSON line must be an object")


def test_lines_are_named_as_an_editor_counts_them_blank_lines_included(tmp_path, tiny_model_dir, capsys):
    """Blank lines (which JSON-lines readers skip) still count: a broken line after them, and a bad row
    after them, are named by their line number in the file."""
    good = [json.dumps(r) for r in rows(3)]
    broken = jsonl(tmp_path / "broken.jsonl", good[:2] + ["", "   ", "not json"] + good[2:])
    refused(argv_for(tmp_path, broken, tiny_model_dir), capsys, f"{broken}:5: invalid JSON")
    gappy = jsonl(tmp_path / "gappy.jsonl", good + ["", ""] + [json.dumps({"prompt": "", "label": "1"})] + good)
    refused(argv_for(tmp_path, gappy, tiny_model_dir), capsys,
            f"the prompt is empty (--data.input_key prompt): 1 row(s): {gappy}:6\n")


def test_hub_datasets_are_left_to_the_run_in_a_dry_run(tmp_path, tiny_model_dir, capsys):
    code, out, err = lpo_train(argv_for(tmp_path, "someorg/some-dataset", tiny_model_dir), capsys)
    assert code == 0, err
    assert "someorg/some-dataset is a hub dataset: a dry run does not download it" in out
    assert "dataset: size unknown" in out


def test_images_are_checked_when_the_run_uses_them(tmp_path, tiny_model_dir, capsys):
    png = tmp_path / "d.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(png)
    good = [{"prompt": "<image>find x", "label": "1", "images": [str(png)]}] * 2
    vision = ("--data.max_images_per_prompt", "1", "--data.apply_chat_template")
    data = jsonl(tmp_path / "v.jsonl", good + [
        {"prompt": "<image>x", "label": "1", "images": [str(png), str(png)]},
        {"prompt": "find x", "label": "1", "images": [str(png)]},
        {"prompt": "<image>x", "label": "1", "images": [str(tmp_path / "gone.png")]}])
    refused(argv_for(tmp_path, data, tiny_model_dir, *vision), capsys,
            f"more images than --data.max_images_per_prompt 1: 1 row(s): {data}:3",
            f"the number of <image> placeholders in the prompt differs from the number of images "
            f"(each image needs one <image> where it goes): 2 row(s): {data}:3, {data}:4",
            f"an image path does not exist on this machine (--data.image_key images): 1 row(s): {data}:5")
    text = jsonl(tmp_path / "t.jsonl", rows(3))
    refused(argv_for(tmp_path, text, tiny_model_dir, *vision), capsys, "--data.image_key images: "
            f"{text} has no key 'images' (--data.max_images_per_prompt > 0: a vision-language run needs the images "
            "column); its keys: prompt, label")
    code, out, err = lpo_train(argv_for(tmp_path, jsonl(tmp_path / "g.jsonl", good), tiny_model_dir), capsys)
    assert code == 0 and "images are not used" in out, err
    long = jsonl(tmp_path / "long.jsonl", [{"prompt": "<image>" + "x" * 600, "label": "1", "images": [str(png)]}])
    refused(argv_for(tmp_path, long, tiny_model_dir, "--data.max_images_per_prompt", "1"), capsys,
            f"an image prompt longer than the 480 tokens it may use", f"{long}:1")


# ----------------------------------------------------------------------------- labels (the reward's own parsers)


BAD_LABELS = [
    ({"task": "countdown", "nums": [3, 4]}, "'target' must be an integer"),
    ({"task": "countdown", "nums": [3], "target": 3}, "'nums' must be a list of at least 2 integers"),
    ({"task": "code", "tests": {"inputs": ["1"], "outputs": []}}, "'tests': tests has 1 inputs but 0 outputs"),
    ({"task": "math", "answer": "  "}, "'answer' is missing or empty"),
    ({"task": "geometry", "answer": "3", "choices": "A,B"}, "choices must be a list of option values"),
    ({"task": "chess"}, "label task 'chess' is unknown; registered tasks: ['code', 'countdown', 'geometry', 'math']"),
    ("", "'answer' is missing or empty"),
]
GOOD_LABELS = [{"task": "countdown", "nums": [3, 4, 5], "target": 7},
               {"task": "code", "tests": {"inputs": ["1\n"], "outputs": ["1\n"]}},
               {"task": "math", "answer": "\\frac{1}{2}"}, {"task": "geometry", "answer": "3", "choices": ["3", "4"]}, "42"]


def test_labels_parse_for_their_task(tmp_path, tiny_model_dir, capsys):
    good = [{"prompt": f"p{i}", "label": json.dumps(lab) if isinstance(lab, dict) else lab}
            for i, lab in enumerate(GOOD_LABELS)]
    data = jsonl(tmp_path / "good.jsonl", good)
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir), capsys)
    assert code == 0, err
    assert "labels (--data.prompt_dataset): code 1, countdown 1, geometry 1, math 2 (JSON 4, bare answer 1)" in out
    bad = [{"prompt": f"q{i}", "label": json.dumps(lab) if isinstance(lab, dict) else lab}
           for i, (lab, _) in enumerate(BAD_LABELS)]
    data = jsonl(tmp_path / "bad.jsonl", good + bad + [{"prompt": "z", "label": None}])
    err = refused(argv_for(tmp_path, data, tiny_model_dir), capsys, "the label is missing (null) (--data.label_key label)")
    for k, (_, needle) in enumerate(BAD_LABELS):
        assert needle in err, needle
        assert f"{data}:{len(good) + k + 1}" in err
    # a label the preflight accepts is graded by the reward, one it refuses fails the reward the same way
    from openrlhf_lpo.rewards.reward_func import score_one

    for lab in GOOD_LABELS:
        score_one("p" + "\\boxed{1}", "p", json.dumps(lab) if isinstance(lab, dict) else lab)
    for lab, needle in BAD_LABELS:
        with pytest.raises(ValueError, match=re.escape(needle)):
            score_one("p" + "\\boxed{1}", "p", json.dumps(lab) if isinstance(lab, dict) else lab)


def test_labels_are_left_to_another_reward_file(tmp_path, tiny_model_dir, capsys):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return {}\n")
    data = jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "label": json.dumps({"task": "chess"})}])
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir, reward=reward), capsys)
    assert code == 0 and "labels are not checked: it is not openrlhf_lpo/rewards/reward_func.py" in out, err
    refused(argv_for(tmp_path, data, tiny_model_dir, "--no:--data.label_key"), capsys, "--data.label_key is not set")


# ----------------------------------------------------------------------------- prompts and tokens


def test_token_percentiles_and_truncation_match_a_brute_force_count(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """More rows than the sample: percentiles over the evenly spaced sample, truncation over every row."""
    from openrlhf_lpo.cli.preflight import prompts as pf_prompts
    from transformers import AutoTokenizer

    monkeypatch.setattr(pf_prompts, "SAMPLE", 64)
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, size=150)
    texts = ["".join(rng.choice(list("abcdefgh "), size=n)) for n in lengths]
    data = jsonl(tmp_path / "t.jsonl", [{"prompt": t, "label": "1"} for t in texts])
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir, "--data.apply_chat_template",
                                        "--data.max_len", "256", "--rollout.max_new_tokens", "100"), capsys)
    assert code == 0, err
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    counts = [len(tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False))
              for t in texts]
    assert len({c - len(t) for c, t in zip(counts, texts)}) == 1  # the character tokenizer: one token per character
    sample = sorted({round(k * 149 / 63) for k in range(64)})
    want = np.percentile([counts[i] for i in sample], [50, 90, 99], method="inverted_cdf").astype(int)
    assert f"prompt tokens (--data.prompt_dataset, a {len(sample)}-row sample of 150, tokenizer of {tiny_model_dir}): " \
           f"p50 {want[0]}, " \
           f"p90 {want[1]}, p99 {want[2]}," in out
    over = [i for i, c in enumerate(counts) if c > 156]
    assert over and f"truncated prompts: {len(over)} row(s) exceed the room of 156 tokens (--data.max_len 256 - " \
                    f"--rollout.max_new_tokens 100)" in out
    assert f"(first: {data}:{over[0] + 1}, {counts[over[0]]} tokens)" in out
    # a dataset above RENDER_ALL rows: prompts are rendered and checked on an evenly spaced subset of that size
    monkeypatch.setattr(pf_prompts, "RENDER_ALL", 100)
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir, "--data.apply_chat_template",
                                        "--data.max_len", "256", "--rollout.max_new_tokens", "100"), capsys)
    subset = sorted({round(k * 149 / 99) for k in range(100)})
    over = [i for i in subset if counts[i] > 156]
    assert code == 0 and f"truncated prompts: {len(over)} row(s) (of an evenly spaced 100-row subset) exceed" in out


def test_rows_the_chat_template_refuses(tmp_path, tiny_model_dir, capsys):
    strict = _copy_model(tiny_model_dir, tmp_path / "strict")
    (strict / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool turns are not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    chat = [{"prompt": [{"role": "user", "content": "hi"}], "label": "1"}] * 2
    data = jsonl(tmp_path / "c.jsonl", chat + [{"prompt": [{"role": "tool", "content": "x"}], "label": "1"}])
    refused(argv_for(tmp_path, data, strict, "--data.apply_chat_template"), capsys,
            "the chat template fails on the prompt (TemplateError: tool turns are not supported): 1 row(s): "
            f"{data}:3")


def test_lengths_the_model_cannot_hold(tmp_path, tiny_model_dir, capsys):
    data = jsonl(tmp_path / "d.jsonl", rows(4))
    refused(argv_for(tmp_path, data, tiny_model_dir, "--rollout.max_new_tokens", "512"), capsys,
            "--rollout.max_new_tokens 512 >= --data.max_len 512: no room is left for the prompt")
    refused(argv_for(tmp_path, data, tiny_model_dir, "--data.max_len", "2048"), capsys,
            f"--data.max_len 2048 (prompt + response, vLLM's max_model_len) exceeds the 1024 positions of "
            f"{tiny_model_dir}")


# ----------------------------------------------------------------------------- model and tokenizer


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_model_folder_problems(tmp_path, tiny_model_dir, capsys):
    data = jsonl(tmp_path / "d.jsonl", rows(4))
    no_config = _copy_model(tiny_model_dir, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    refused(argv_for(tmp_path, data, no_config), capsys, f"{no_config} holds no config.json")
    no_tok = _copy_model(tiny_model_dir, tmp_path / "no_tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / name).unlink()
    refused(argv_for(tmp_path, data, no_tok), capsys, f"--actor.model_name_or_path {no_tok}: holds no tokenizer files")
    no_weights = _copy_model(tiny_model_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    refused(argv_for(tmp_path, data, no_weights), capsys, "holds no weight files (*.safetensors or *.bin)")
    no_template = _copy_model(tiny_model_dir, tmp_path / "no_template")
    (no_template / "chat_template.jinja").unlink()
    cfg = json.loads((no_template / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, out, err = lpo_train(argv_for(tmp_path, data, no_template), capsys)
    assert code == 0, err  # no chat template is fine without --data.apply_chat_template
    refused(argv_for(tmp_path, data, no_template, "--data.apply_chat_template"), capsys,
            f"--data.apply_chat_template: the tokenizer of {no_template} has no chat template")
    small = _copy_model(tiny_model_dir, tmp_path / "small_vocab")
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(dict(cfg, vocab_size=50)))
    refused(argv_for(tmp_path, data, small), capsys, "but config.json's vocab_size is 50")
    (tmp_path / "file_model").write_text("x")
    refused(argv_for(tmp_path, data, tmp_path / "file_model"), capsys, "is a file; pass the model folder")


def test_a_hub_id_outside_the_cache(tmp_path, capsys, monkeypatch):
    data = jsonl(tmp_path / "d.jsonl", rows(4))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = lpo_train(argv_for(tmp_path, data, "no-such-org/no-such-model-1b"), capsys)
    assert code == 0, err
    assert "no-such-org/no-such-model-1b is a hub id not in the local cache (HF_HUB_OFFLINE=1 here)" in out
    refused(argv_for(tmp_path, data, "no-such-org/no-such-model-1b", dry=False), capsys,
            "no-such-org/no-such-model-1b: not a local folder and not in the local Hugging Face cache, and "
            "HF_HUB_OFFLINE=1", "huggingface-cli download no-such-org/no-such-model-1b")
    refused(argv_for(tmp_path, data, "not a model!"), capsys,
            "--actor.model_name_or_path 'not a model!': no such local folder, and not a valid Hugging Face model id")


# ----------------------------------------------------------------------------- reward file


REWARD_FILES = {
    "syntax": ("x = 1\ndef reward_func(queries, prompts, labels:\n    pass\n", ":2: SyntaxError"),
    "raises": ("import json\nraise RuntimeError('no API key')\n", ":2: RuntimeError: no API key"),
    "no_function": ("def reward(queries, prompts, labels):\n    return {}\n", "the file defines no 'reward_func'"),
    "signature": ("def reward_func(queries):\n    return {}\n", "reward_func must accept (queries, prompts, labels)"),
    "hangs": ("import time\ntime.sleep(60)\n", "loading the file did not finish in 2 s"),
}


@pytest.mark.parametrize("case", sorted(REWARD_FILES))
def test_reward_files_that_cannot_serve(case, tmp_path, tiny_model_dir, capsys, monkeypatch):
    import time

    monkeypatch.setenv("LPO_PREFLIGHT_REWARD_TIMEOUT", "2")
    text, needle = REWARD_FILES[case]
    reward = tmp_path / "reward.py"
    reward.write_text(text)
    t0 = time.time()
    refused(argv_for(tmp_path, jsonl(tmp_path / "d.jsonl", rows(4)), tiny_model_dir, reward=reward), capsys,
            f"--reward.remote_url {reward}", needle)
    assert time.time() - t0 < 30


def test_an_agent_file_must_define_its_executor(tmp_path, tiny_model_dir, capsys):
    data = jsonl(tmp_path / "d.jsonl", rows(4))
    agent = tmp_path / "agent.py"
    agent.write_text("class Executor:\n    pass\n")
    refused(argv_for(tmp_path, data, tiny_model_dir, "--train.agent_func_path", str(agent)), capsys,
            f"--train.agent_func_path {agent}: the file defines no 'AgentExecutor'")
    agent.write_text("class AgentExecutor:\n    pass\n")
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir, "--train.agent_func_path", str(agent)), capsys)
    assert code == 0 and f"agent: {agent} defines AgentExecutor" in out, err


def test_an_http_reward_server_is_not_contacted(tmp_path, tiny_model_dir, capsys):
    code, out, err = lpo_train(argv_for(tmp_path, jsonl(tmp_path / "d.jsonl", rows(4)), tiny_model_dir,
                                        reward="http://127.0.0.1:1/reward"), capsys)
    assert code == 0 and "reward: HTTP server http://127.0.0.1:1/reward (not contacted by preflight)" in out, err


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_paths_and_disk(tmp_path, tiny_model_dir, capsys):
    from openrlhf_lpo.cli.disk import model_params

    data = jsonl(tmp_path / "d.jsonl", rows(8))
    (tmp_path / "afile").write_text("x")
    refused(argv_for(tmp_path, data, tiny_model_dir, "--ckpt.path", str(tmp_path / "afile" / "ckpt")), capsys,
            f"--ckpt.path {tmp_path / 'afile' / 'ckpt'}: cannot be created: {tmp_path / 'afile'} is a file")
    refused(argv_for(tmp_path, data, tiny_model_dir, "--ckpt.output_dir", str(tmp_path / "afile")), capsys,
            f"--ckpt.output_dir {tmp_path / 'afile'}: exists and is not a folder")
    # the need: 2 rollout batches, a save each, ZeRO-2 fp32 model: 2 x (12 + 2) B/param + 2 exports + final
    params = model_params(tiny_model_dir)
    assert params == os.path.getsize(Path(tiny_model_dir) / "model.safetensors") // 4 > 1e6
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir, "--ckpt.save_steps", "1", "--ckpt.save_hf"),
                               capsys)
    assert code == 0, err
    assert f"2 deepspeed checkpoint(s) of {(params * 14) / 1024**2:.1f} MiB in {tmp_path / 'ckpt'}" in out
    assert f"2 Hugging Face export(s) of {params * 2 / 1024**2:.1f} MiB in {tmp_path / 'ckpt'}" in out
    huge = _copy_model(tiny_model_dir, tmp_path / "huge")  # planted: an index that claims 2 PB of bf16 weights
    (huge / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2 * 10**15},
                                                                    "weight_map": {}}))
    refused(argv_for(tmp_path, data, huge, "--ckpt.save_steps", "1"), capsys,
            f"--ckpt.path / --ckpt.output_dir: {tmp_path / 'ckpt'} and {tmp_path / 'final'} need about",
            "free", "lower --ckpt.max_num")


def _megatron_ckpt(root: Path, model_dir, step=2, **dims):
    from openrlhf_lpo.megatron.checkpoint import FORMAT

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    model = {k: cfg.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")}
    model.update(dims)
    tag = root / "_actor" / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step, "layout": {"tp": 2, "pp": 1, "dp": 1},
                                               "model": model}))
    (root / "_actor" / "latest").write_text(f"global_step{step}")


def _deepspeed_ckpt(root: Path, ranks=2, zero3=False, vocab=128, hidden=256, layers=4):
    """A DeepSpeed checkpoint's files as DeepSpeed 0.19 names them, with the parameter shapes it records."""
    from collections import OrderedDict

    import torch

    tag = root / "_actor" / "global_step4"
    tag.mkdir(parents=True)
    shapes = OrderedDict([("model.model.embed_tokens.weight", torch.Size([vocab, hidden]))] +
                         [(f"model.model.layers.{i}.mlp.up_proj.weight", torch.Size([768, hidden])) for i in range(layers)])
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero3 else "mp_rank_00_model_states.pt"
    torch.save({"param_shapes": [shapes], "dp_world_size": ranks, "ds_version": "0.19.6"}, tag / model_file)
    for r in range(ranks):
        torch.save({"optimizer_state_dict": {}}, tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (root / "_actor" / "latest").write_text("global_step4")


def test_resume_refuses_what_cannot_be_loaded(tmp_path, tiny_model_dir, megatron_layout_model, capsys):
    data = jsonl(tmp_path / "d.jsonl", rows(8))
    resume = ("--ckpt.load_enable",)
    megatron = ("--backend", "megatron", "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0")
    ckpt = tmp_path / "ckpt"
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir, *resume), capsys)
    assert code == 0 and f"resume: no checkpoint under {ckpt / '_actor'} yet: the run starts at step 0" in out, err
    _deepspeed_ckpt(ckpt)  # 2 ranks, ZeRO-2, the tiny model's shapes
    code, out, err = lpo_train(argv_for(tmp_path, data, tiny_model_dir, *resume), capsys)
    assert code == 0 and "(DeepSpeed, 2 data-parallel ranks, ZeRO-1/2)" in out, err
    refused(argv_for(tmp_path, data, tiny_model_dir, *resume, "--actor.num_gpus_per_node", "1",
                     "--rollout.batch_size", "4", "--train.batch_size", "16"), capsys,
            "was written by 2 data-parallel ranks, this run has 1", "--ds.use_universal_ckpt")
    refused(argv_for(tmp_path, data, tiny_model_dir, *resume, "--ds.zero_stage", "3"), capsys,
            "was written with ZeRO-1/2, this run uses --ds.zero_stage 3")
    refused(argv_for(tmp_path, data, tiny_model_dir, *resume, "--ds.use_universal_ckpt"), capsys,
            "latest_universal is missing", "ds_to_universal")
    refused(argv_for(tmp_path, data, tiny_model_dir, *resume, *megatron, "--ckpt.path", str(ckpt)),
            capsys, "is a deepspeed checkpoint but this run uses --backend megatron")
    other = tmp_path / "other"
    _deepspeed_ckpt(other, vocab=256)
    refused(argv_for(tmp_path, data, tiny_model_dir, *resume, "--ckpt.path", str(other)), capsys,
            "was written for vocab_size=256, but --actor.model_name_or_path", "has vocab_size=128")
    mg = tmp_path / "mg"
    _megatron_ckpt(mg, megatron_layout_model)  # written at TP2: resumes at TP1 (layout-free)
    code, out, err = lpo_train(argv_for(tmp_path, data, megatron_layout_model, *resume, *megatron,
                                        "--ckpt.path", str(mg)), capsys)
    assert code == 0 and "written at TP2 PP1 DP1; layout-free: resumes in this layout" in out, err
    refused(argv_for(tmp_path, data, megatron_layout_model, *resume, "--ckpt.path", str(mg)), capsys,
            "is a megatron checkpoint but this run uses --backend deepspeed")
    mg2 = tmp_path / "mg2"
    _megatron_ckpt(mg2, megatron_layout_model, hidden_size=4096)
    refused(argv_for(tmp_path, data, megatron_layout_model, *resume, *megatron, "--ckpt.path", str(mg2)),
            capsys, "was written for hidden_size=4096, the model has hidden_size=64",
            "the checkpoint is from another model")
    gone = tmp_path / "gone"
    (gone / "_actor").mkdir(parents=True)
    (gone / "_actor" / "latest").write_text("global_step9")
    refused(argv_for(tmp_path, data, tiny_model_dir, *resume, "--ckpt.path", str(gone)), capsys,
            "latest names 'global_step9' but", "does not exist")
