"""lpo-compare's arguments (bad input exits 2 naming the argument, nothing runs) and its run matrix: every method
of a seed gets that seed as --train.seed, checked through the flags the recipe really prints and the lpo-train
parser; the CPU preset's runs take the configs/methods flags into the demo pipeline."""

import os
from pathlib import Path

import pytest

from openrlhf_lpo.cli import compare
from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
from openrlhf_lpo.compare import recipe as rc
from openrlhf_lpo.compare.plan import effective_flag, method_names
from openrlhf_lpo.openrlhf.request_seeds import prompt_seed, sample_seed
from recipe_flags import method_flags

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "scripts" / "train_math_qwen3_1.7b.sh"


@pytest.mark.parametrize("argv,words", [
    (["--preset", "cpu-demo", "--methods", "grpo,lpo_fwdd"], ["--methods", "'lpo_fwdd'", "lpo_fwd,"]),
    (["--preset", "cpu-demo", "--methods", "grpo,grpo"], ["--methods", "twice"]),
    (["--preset", "cpu-demo", "--methods", ","], ["--methods is empty"]),
    (["examples/scripts/train_nothing.sh", "--methods", "grpo"], ["RECIPE", "does not exist"]),
    (["README.md", "--methods", "grpo"], ["RECIPE", "not a script"]),
    (["examples/scripts", "--methods", "grpo"], ["RECIPE", "not a script"]),
    (["examples/scripts/gpu_check.sh", "--methods", "grpo"], ["not a recipe", "lib/launch.sh", "METHOD"]),
    (["--preset", "cpu-demo", "--methods", "grpo,lpo_fwd", "--seeds", "0"], ["--seeds must be >= 1"]),
    (["--preset", "cpu-demo", "--methods", "grpo", "--first-seed", "-1"], ["--first-seed"]),
    (["--preset", "gpu-demo", "--methods", "grpo"], ["--preset", "'gpu-demo'", "cpu-demo"]),
    (["--methods", "grpo"], ["neither", "--preset"]),
    ([str(RECIPE), "--preset", "ci", "--methods", "grpo"], ["both"]),
    (["--preset", "ci", "--methods", "grpo", "--jobs", "0"], ["--jobs"]),
    (["--preset", "ci", "--methods", "grpo", "--extra-args", "--train.seed 3"], ["--train.seed", "--seeds"]),
    (["--preset", "ci", "--methods", "grpo", "--eval-dataset", "x.jsonl"], ["--eval-dataset", "recipe"]),
    (["--preset", "ci", "--methods", "grpo", "--seeds", "two"], ["--seeds", "invalid int"]),
])
def test_bad_input_exits_2_naming_it(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        compare.run(argv + ["--out", str(tmp_path / "study")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(w in err for w in words), err
    assert not (tmp_path / "study").exists()  # nothing ran


def test_recipe_runs_are_matched_per_seed(tmp_path, monkeypatch):
    """The flags each run's recipe prints, parsed by lpo-train: seed s everywhere in seed s, the rest of a seed's
    runs identical but the method flags; checkpoints, TensorBoard and the final model in the run's directory,
    and --ckpt.load_enable so a run started again resumes."""
    monkeypatch.delenv("EXTRA_ARGS", raising=False)
    methods, out = ["grpo", "lpo_fwd", "dapo"], tmp_path / "study"
    specs = rc.plan_recipe(RECIPE, methods, [3, 4], out, ["--train.num_episodes", "1"])
    assert [s.key for s in specs] == [f"{m}/seed{s}" for s in (3, 4) for m in methods]
    common = {}
    for spec in specs:
        flags = [f.replace("<out>", str(out)) for f in spec.settings["flags"]]
        args = build_parser_and_parse(flags)
        assert args.train.seed == spec.seed and args.train.num_episodes == 1 and args.ckpt.load_enable
        assert Path(args.ckpt.path) == spec.work_dir / "ckpt" and Path(args.ckpt.output_dir) == spec.work_dir / "final"
        assert Path(args.logger.tensorboard_dir) == spec.work_dir / "tb"
        own = method_flags(spec.method, **{"rollout.max_new_tokens": args.rollout.max_new_tokens})
        assert " ".join(own) in " ".join(flags)
        rest = " ".join(flags).replace(" ".join(own), "").replace(f"/{spec.method}/", "/M/")
        assert common.setdefault(spec.seed, rest) == rest
    assert common[3] != common[4] and common[3].replace("seed3", "seed4").replace("--train.seed 3", "--train.seed 4") \
        == common[4]
    # what the seed fixes (openrlhf/request_seeds.py): the same sampling seeds per prompt position for every method
    assert prompt_seed(3, "train", 5) == prompt_seed(3, "train", 5) != prompt_seed(4, "train", 5)
    assert sample_seed(prompt_seed(3, "train", 5), 1) != sample_seed(prompt_seed(3, "train", 5), 0)
    # a recipe run as its command line says
    env = rc.run_env("lpo_fwd", 4, out / "seed4", ["--train.num_episodes", "1"])
    assert env["EXTRA_ARGS"].endswith("--train.seed 4")
    assert Path(env["SAVE_ROOT"]) / env["RUN_NAME"] == specs[4].work_dir
    assert effective_flag(["--a", "1", "--a", "2"], "--a") == "2"


def test_cpu_preset_runs_take_the_method_files_into_the_demo_pipeline(tmp_path):
    from openrlhf_lpo.compare.presets import get_study_preset
    from openrlhf_lpo.demo.pipeline import pipeline_argv
    from openrlhf_lpo.demo.presets import get_preset
    from openrlhf_lpo.demo.study import RecipeMethod

    preset = get_study_preset("cpu-demo")
    specs = preset.plan(["grpo", "lpo_rev", "dapo"], [0, 1], tmp_path, ["--actor.num_gpus_per_node", "2"])
    rl = get_preset("cpu-demo").rl
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    for spec in specs:
        assert spec.work_dir == tmp_path / f"seed{spec.seed}" / "pipeline" / spec.method
        flags = spec.settings["method_flags"]
        assert flags == method_flags(spec.method, **{"rollout.max_new_tokens": 5})  # pairsum: 3 chars + 2
        cfg = type(rl)(**{**spec.settings["rl"], "pipeline_args": tuple(spec.settings["rl"]["pipeline_args"])})
        argv = pipeline_argv(RecipeMethod(spec.method, tuple(flags)), cfg, "m", str(tmp_path / "p.jsonl"),
                             spec.work_dir, 5)
        args = build_parser_and_parse(argv)
        assert args.train.seed == spec.seed and args.ckpt.load_enable and args.actor.num_gpus_per_node == 2
        assert args.algo.advantage.estimator == ("lpo" if spec.method == "lpo_rev" else "group_norm")
        assert args.rollout.n_samples_per_prompt == rl.k and args.ckpt.save_steps == rl.eval_every
    assert specs[0].settings_hash != specs[3].settings_hash  # grpo seed 0 vs seed 1
    assert set(method_names()) >= {"grpo", "lpo_fwd", "lpo_rev", "dapo"}


def test_dry_run_prints_the_matrix_and_decisions(tmp_path, capsys):
    out = tmp_path / "study"
    assert compare.run(["--preset", "ci", "--methods", "grpo,lpo_fwd", "--seeds", "2", "--out", str(out),
                        "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "runs at once: 2 (auto)" in text and not out.exists()
    assert [line.split()[:2] for line in text.splitlines() if "/seed" in line and "fresh" in line] == \
        [["grpo/seed0", "fresh"], ["lpo_fwd/seed0", "fresh"], ["grpo/seed1", "fresh"], ["lpo_fwd/seed1", "fresh"]]
    assert os.path.basename(str(out)) in text


def test_every_class_that_builds_the_prompt_dataloader_seeds_its_order():
    """A paired study's baseline and its LPO pair run the same classes (every estimator: LPOTrainer, the async
    sample generator): they seed the prompt order with --train.seed (SeededPromptOrder), first in the MRO, so the
    stock __init__ shuffles after it. The mixin itself: a torch DataLoader built in the base's __init__ yields
    the same order for one seed whatever the global RNG held before, another order for another seed."""
    import types

    import torch

    from openrlhf_lpo.openrlhf import ray_classes as rc_

    for cls in (rc_.LPOTrainer, rc_.LPOGenerateSamplesActor):
        assert cls.__mro__[1] is rc_.SeededPromptOrder, cls

    class Base:
        def __init__(self, pretrain, strategy):
            loader = torch.utils.data.DataLoader(list(range(64)), batch_size=8, shuffle=True)
            self.order = [int(x) for batch in loader for x in batch]

    class Probe(rc_.SeededPromptOrder, Base):
        pass

    strategy = lambda seed: types.SimpleNamespace(args=types.SimpleNamespace(train=types.SimpleNamespace(seed=seed)))  # noqa: E731
    torch.manual_seed(123)
    a = Probe("model", strategy(3)).order
    torch.rand(5)
    b = Probe("model", strategy(3)).order
    c = Probe("model", strategy(4)).order
    assert a == b and a != c and sorted(a) == list(range(64))
