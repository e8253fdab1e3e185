"""docs/divergences.md ("Add your own divergence"): its worked example is examples/divergences/my_divergences.py
verbatim, and that module, loaded as a plugin (LPO_PLUGINS) in fresh processes, passes its own check and
works through lpo-explain and lpo-train's flag validation and dry-run plan."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "divergences" / "my_divergences.py"
DOC = REPO / "docs" / "divergences.md"


def _env(plugins=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LPO_PLUGINS", None)
    if plugins:
        env["LPO_PLUGINS"] = "my_divergences"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(EXAMPLE.parent), env.get("PYTHONPATH", "")])
    return env


def _run(*args, plugins=True):
    return subprocess.run([sys.executable, *args], env=_env(plugins), cwd=str(REPO), capture_output=True, text=True,
                          timeout=600)


def test_the_page_shows_the_example_verbatim():
    text = DOC.read_text()
    m = re.search(r"<!-- example: examples/divergences/my_divergences.py -->\n```python\n(.*?)```", text, re.S)
    assert m, "docs/divergences.md lost its example block"
    assert m.group(1) == EXAMPLE.read_text()


def test_the_example_checks_itself():
    proc = _run("-m", "my_divergences", plugins=False)  # as __main__ (a plugin import would register it twice)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("chi2", "renyi")))
    import ast

    for name in ("chi2", "renyi:0.5", "renyi:2", "renyi:3.5"):
        err = ast.literal_eval(rows[name])
        assert err["autograd"] < 1e-12 and err["finite_diff"] < 1e-7 and err["zero_sum"] < 1e-12, (name, err)
        if name.startswith("renyi"):
            assert err["abs_sum"] <= 2.0  # the bound it declares
    assert float(rows["chi2_vs_alpha2"]) < 1e-12


@pytest.mark.e2e
def test_the_plugin_works_in_lpo_explain_and_lpo_train():
    proc = _run("-m", "openrlhf_lpo.cli.explain", "--rewards", "1", "0", "0", "1", "--divergence", "renyi:0.5",
                "--log-ratio", "0.1", "0", "-0.1", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "divergence=renyi:0.5" in proc.stdout and "(bound 2)" in proc.stdout
    base = ["-m", "openrlhf_lpo.cli.train_ppo_ray", "--actor.model_name_or_path", "unused", "--reward.remote_url",
            "http://unused", "--actor.num_gpus_per_node", "1", "--rollout.n_samples_per_prompt", "4",
            "--rollout.batch_size", "2", "--train.batch_size", "8", "--train.micro_batch_size", "4",
            "--algo.advantage.estimator", "lpo"]
    # the data/model checks are tests/pipeline/test_preflight.py's: off here (no data file)
    ok = _run(*base, "--lpo.divergence_schedule", "renyi:2@0,chi2@10", "--preflight", "off", "--dry-run")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "divergence schedule: renyi:2 from update 0, chi2 from update 10" in ok.stdout
    bad = _run(*base, "--lpo.divergence", "renyi:1")
    assert bad.returncode == 2 and "--lpo.divergence: divergence 'renyi:1': a = 1 must be positive and not 1" in bad.stderr
