"""The TensorBoard step check the GPU smoke script uses (openrlhf_lpo/testing/tensorboard_rows.py), on files written by
the writer OpenRLHF's trainer logs with."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _write(tb_dir, steps):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tb_dir))
    for s in steps:
        w.add_scalar("train/policy_loss", 0.1 * s, s)
        w.add_scalar("rollout/reward_mean", 0.5, s)
    w.close()


def _check(*argv):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "openrlhf_lpo.testing.tensorboard_rows", *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_step_check_passes_on_the_logged_steps_and_names_what_is_missing(tmp_path):
    _write(tmp_path / "tb", [1, 2])
    assert _check(tmp_path / "tb", "--steps", "1,2", "--exact").returncode == 0
    missing = _check(tmp_path / "tb", "--steps", "1,2,3")
    assert missing.returncode == 1 and "training steps [3] are not in TensorBoard (logged: [1, 2])" in missing.stderr
    extra = _check(tmp_path / "tb", "--steps", "2", "--exact")
    assert extra.returncode == 1 and "expected exactly the training steps [2], TensorBoard has [1, 2]" in extra.stderr
    assert _check(tmp_path / "empty", "--steps", "1").returncode == 1


def test_gpu_smoke_reads_tensorboard_not_forwarded_log_lines():
    script = (REPO / "examples" / "scripts" / "gpu_smoke.sh").read_text()
    assert "Global step" not in script
    assert 'tensorboard_rows "$WORK/tb" --steps 1,2 --exact' in script
    assert '--logger.tensorboard_dir "$WORK/tb_resume"' in script
    assert 'tensorboard_rows "$WORK/tb_resume" --steps 3,4 --exact' in script
    out = subprocess.run(["bash", str(REPO / "examples" / "scripts" / "gpu_smoke.sh")], capture_output=True, text=True,
                         env=dict(os.environ, LPO_PRINT_ARGS="1", WORK="/tmp/w"), timeout=60)
    args = out.stdout.splitlines()
    assert args[args.index("--logger.tensorboard_dir") + 1] == "/tmp/w/tb"  # the directory the check reads
