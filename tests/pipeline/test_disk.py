"""Disk: HF exports rotate with the training state (openrlhf_lpo/runtime/hf_exports.py), and the one disk estimate
(openrlhf_lpo/cli/disk.py, printed by ``--dry-run`` and checked by the preflight) counts the exports the
rotation keeps. The rotation inside a real run is checked end to end in test_e2e_reward_errors.py (run A
saves every step with --ckpt.max_num 1); the printed line in test_preflight.py."""

import json
import os
import subprocess
from types import SimpleNamespace

from openrlhf_lpo.cli import disk
from openrlhf_lpo.runtime.hf_exports import rotate_for_args, rotate_hf_exports

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tree(root, exports, states=(), others=()):
    for name in exports:
        os.makedirs(os.path.join(root, f"{name}_hf"))
        open(os.path.join(root, f"{name}_hf", "model.safetensors"), "w").close()
    for name in states:
        os.makedirs(os.path.join(root, "_actor", name))
    for name in others:
        os.makedirs(os.path.join(root, name))


def _left(root):
    return sorted(d for d in os.listdir(root) if d.endswith("_hf") or d.startswith("."))


def test_exports_follow_the_states_that_deepspeed_kept(tmp_path):
    root = str(tmp_path)
    _tree(root, ["global_step20", "global_step40", "global_step60", "global_step80", "best_global_step40"],
          states=["global_step60", "global_step80", "best_global_step40"], others=["logs"])
    removed = rotate_hf_exports(root, 2, os.path.join(root, "_actor"), keep=["global_step80"])
    assert sorted(os.path.basename(p) for p in removed) == ["global_step20_hf", "global_step40_hf"]
    assert _left(root) == ["best_global_step40_hf", "global_step60_hf", "global_step80_hf"]
    assert os.path.isdir(os.path.join(root, "logs"))  # anything that is not an export is left alone


def test_without_states_the_newest_exports_by_step_are_kept(tmp_path):
    root = str(tmp_path)
    _tree(root, ["global_step100", "global_step20", "global_step5", "best_global_step5", "best_global_step20"])
    os.makedirs(os.path.join(root, ".global_step1_hf.removing"))  # a crash mid-removal left this
    rotate_hf_exports(root, 2, os.path.join(root, "_actor"))  # --ckpt.disable_ds: no state directories
    assert _left(root) == [".global_step1_hf.removing", "best_global_step20_hf", "global_step100_hf",
                           "global_step20_hf"]  # by step number, not by name (5 < 20 < 100)


def test_the_flags_choose_the_rule(tmp_path):
    def ckpt(root, **kw):
        return SimpleNamespace(path=root, max_num=1, **kw)

    a = str(tmp_path / "a")
    _tree(a, ["global_step1", "global_step2", "global_step3"], states=["global_step3"])
    rotate_for_args(ckpt(a, hf_max_num=None), keep=["global_step3"])
    assert _left(a) == ["global_step3_hf"]  # follows --ckpt.max_num's state rotation
    b = str(tmp_path / "b")
    _tree(b, ["global_step1", "global_step2", "global_step3"], states=["global_step3"])
    rotate_for_args(ckpt(b, hf_max_num=-1), keep=["global_step3"])
    assert len(_left(b)) == 3  # -1 keeps every export (a learning curve to evaluate later)
    c = str(tmp_path / "c")
    _tree(c, ["global_step1", "global_step2", "global_step3"], states=["global_step3"])
    rotate_for_args(ckpt(c, hf_max_num=2), keep=["global_step3"])
    assert _left(c) == ["global_step2_hf", "global_step3_hf"]  # its own count, regardless of the states


# ----------------------------------------------------------------------------- the estimate


def test_the_estimate_counts_the_exports_the_rotation_keeps(tmp_path):
    """cli/disk.py's one estimate (the preflight's disk check and the --dry-run summary) for the MATH 8B
    recipe: 7500 prompts / 256 = 30 batches x 10 episodes, a save every 20 -> 15 saves, --ckpt.max_num 3."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": "1"}) + "\n" for i in range(7500)))
    env = dict(os.environ, LPO_PRINT_ARGS="1", MODEL="Qwen/Qwen3-8B-Base", DATA=str(data), SAVE_ROOT=str(tmp_path))
    for key in ("EXTRA_ARGS", "METHOD", "BACKEND", "NNODES", "GPUS_PER_NODE"):
        env.pop(key, None)
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "scripts", "train_math_qwen3_8b.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"go to {tmp_path}/math_qwen3-8b_lpo_fwd" in out.stderr  # the launcher says where
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    args = build_parser_and_parse(out.stdout.splitlines())
    n, ckpt = 8_190_735_360, f"{tmp_path}/math_qwen3-8b_lpo_fwd/ckpt"
    assert (args.ckpt.path, args.ds.zero_stage, args.ckpt.max_num, args.ckpt.hf_max_num) == (ckpt, 3, 3, None)

    def exports(hf_max_num, batches=300):
        args.ckpt.hf_max_num = hf_max_num
        need = disk.run_disk_need(args, n, batches)
        (hf,) = [(what, b) for what, b, where in need.parts if "Hugging Face" in what and where == ckpt]
        assert hf[1] % (2 * n) == 0  # bf16 exports
        return hf[1] // (2 * n), need

    count, need = exports(None)
    assert count == 4  # the 3 whose ZeRO-3 state is kept + the one written before the oldest goes (was 15)
    assert need.total == 3 * 12 * n + 4 * 2 * n + 2 * n  # 12 B/param ZeRO-3 states, exports, final model
    assert exports(-1)[0] == 15  # every export stays: one per save
    assert exports(0)[0] == 2 and exports(7)[0] == 8 and exports(20)[0] == 15
    assert exports(None, batches=None)[0] == 4  # the dataset size unknown: the rotation still bounds it


def test_recipes_write_outside_the_checkout_by_default():
    env = dict(os.environ, LPO_PRINT_ARGS="1")
    env.pop("SAVE_ROOT", None)
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "scripts", "train_math_qwen3_8b.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    args = out.stdout.splitlines()
    ckpt = args[args.index("--ckpt.path") + 1]
    assert not os.path.abspath(ckpt).startswith(REPO + os.sep), ckpt
    assert ckpt == os.path.join(os.path.expanduser("~"), "lpo_runs", "math_qwen3-8b_lpo_fwd", "ckpt")
