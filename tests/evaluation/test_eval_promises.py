"""README promises of lpo-eval not pinned elsewhere: the training step read from every named checkpoint
layout, and the per-benchmark default n / k through the CLI's own option parsing."""

import pytest

from evaluation.checkpoints import local_checkpoint, parse_step, run_and_label
from evaluation.cli import _gen_options, build_parser
from evaluation.generate import plan_jobs


@pytest.mark.parametrize(
    "rel, step, run",
    [
        ("sft/checkpoint-100", 100, "sft"),  # HF Trainer
        ("exp/step100", 100, "exp"),  # plain step directories
        ("meg/checkpoints/iter_0000100", 100, "meg"),  # Megatron-LM (leading zeros)
        ("lpo_fwd/ckpt/global_step20_hf", 20, "lpo_fwd"),  # OpenRLHF --ckpt.save_hf
        ("exp/step100/actor/huggingface", 100, "exp"),  # the step is the last component naming one
        ("models/qwen3-8b", None, "qwen3-8b"),  # no step: a base model is its own run
    ],
)
def test_training_step_from_checkpoint_names(rel, step, run, tmp_path):
    assert parse_step(str(tmp_path / rel)) == step
    got_run, got_step, label = run_and_label(str(tmp_path / rel))
    assert (got_run, got_step) == (run, step)
    assert "/" not in label and (step is None or str(step) in label.replace("0000", ""))


# README: "n defaults to the paper's k (32 for AIME/AMC, 8 for code, 4 for Minerva)"; others Pass@1 from n = 1
DEFAULTS = {"aime24": 32, "aime25": 32, "amc23": 32, "minerva": 4, "humaneval": 8, "math500": 1,
            "olympiadbench": 1, "arc_c": 1, "mmlu_pro": 1}


def _jobs(tiny_ckpt, tmp_path, *flags):
    args = build_parser().parse_args(["generate", "--ckpts", tiny_ckpt, "--out", str(tmp_path), "--benchmarks",
                                      ",".join(DEFAULTS), "--limit", "1", *flags])
    jobs = plan_jobs(local_checkpoint(tiny_ckpt), _gen_options(args))
    return {j.config["benchmark"]: j for j in jobs}


def test_default_n_and_k_per_benchmark(tiny_ckpt, tmp_path, bench_dir):
    jobs = _jobs(tiny_ckpt, tmp_path)
    assert set(jobs) == set(DEFAULTS)
    for bench, k in DEFAULTS.items():
        assert (jobs[bench].n, jobs[bench].config["n"], jobs[bench].config["k"]) == (k, k, k), bench
    # overrides: --k alone raises n to it; --n '*' applies to every benchmark but keeps the paper's k
    jobs = _jobs(tiny_ckpt, tmp_path, "--k", "math500=4", "--n", "*=64")
    assert (jobs["math500"].n, jobs["math500"].config["k"]) == (64, 4)
    assert (jobs["aime24"].n, jobs["aime24"].config["k"]) == (64, 32)
    jobs = _jobs(tiny_ckpt, tmp_path, "--k", "math500=4")
    assert (jobs["math500"].n, jobs["math500"].config["k"]) == (4, 4) and jobs["minerva"].n == 4
