"""`lpo-explain` prints what the README shows, and its numbers equal an independent float64 computation."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
README_CMD = ["--rewards", "1", "0", "0", "1", "0", "0", "0", "0", "--temperature", "std", "--divergence", "fwd"]
ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)(?:\s+(\S+))?\s*$")


def _reference(r, temperature, divergence, s=None):
    """numpy float64: tau, P = softmax(s), w* = softmax(R/tau) (on-policy s_t = 0), c = dD/ds, A, D."""
    r = np.asarray(r, dtype=np.float64)
    k = len(r)
    s = np.zeros(k) if s is None else np.asarray(s, dtype=np.float64)
    tau = {"std": np.std(r, ddof=1), "one": 1.0, "mean": np.mean(r), "loo": (k - 1) / k,
           "batch_std": np.sqrt(np.mean((r - r.mean()) ** 2))}.get(temperature, temperature)
    x = (r - r.max()) / tau
    w = np.exp(x) / np.exp(x).sum()
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    if divergence == "fwd":  # KL(w||P) = sum w log(w/P); d/ds = P - w
        d = np.sum(w * np.log(w / p))
        c = p - w
    else:  # KL(P||w); d/ds_j = P_j (log(P_j/w_j) - KL)
        d = np.sum(p * np.log(p / w))
        c = p * (np.log(p / w) - d)
    a = (r - r.mean()) / tau
    return tau, p, w, c, a, d


def _table(text):
    rows = [ROW.match(line) for line in text.splitlines()[2:]]
    return np.array([[float(v) for v in m.groups() if v is not None] for m in rows if m])


def test_readme_table_is_what_lpo_explain_prints_and_it_is_right():
    out = subprocess.run([sys.executable, "-m", "openrlhf_lpo.cli.explain", *README_CMD], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    # the README's block, line for line ("..." elides the rest)
    readme = (REPO / "README.md").read_text()
    block = readme.split("`lpo-explain --rewards 1 0 0 1 0 0 0 0 --temperature std --divergence fwd`")[1]
    block = block.split("```\n", 1)[1].split("```", 1)[0]
    shown = [line for line in block.splitlines() if line.strip() and line.strip() != "..."]
    printed = text.splitlines()
    assert len(shown) == 4 and shown == printed[: len(shown)], (shown, printed[:4])

    tau, p, w, c, a, d = _reference([1, 0, 0, 1, 0, 0, 0, 0], "std", "fwd")
    assert printed[0] == f"K=8  temperature='std' -> tau={tau:.4g}  divergence=fwd"
    table = _table(text)
    assert table.shape == (8, 6)
    np.testing.assert_array_equal(table[:, 0], np.arange(8))
    np.testing.assert_array_equal(table[:, 1], [1, 0, 0, 1, 0, 0, 0, 0])
    # each printed number equals the reference to its printed precision (half a unit in the last place)
    np.testing.assert_allclose(table[:, 2], p, atol=0.501e-4, rtol=0)
    np.testing.assert_allclose(table[:, 3], w, atol=0.501e-4, rtol=0)
    np.testing.assert_allclose(table[:, 4], c, atol=0.501e-5, rtol=0)
    np.testing.assert_allclose(table[:, 5], a, atol=0.501e-4, rtol=0)
    summary = printed[10]
    m = re.match(r"D = (\S+); sum c = (\S+); sum \|c\| = (\S+) \(bound 2\)\.", summary)
    assert m, summary
    assert abs(float(m.group(1)) - d) < 0.5e-6 and abs(float(m.group(2))) < 1e-12
    assert abs(float(m.group(3)) - np.abs(c).sum()) < 0.5e-4
    # sanity of the reference itself: the README's hand-checkable values
    assert abs(tau - 0.4629) < 1e-4 and abs(w[0] - 0.3715) < 1e-4 and abs(a[0] - 1.6202) < 1e-4


@pytest.mark.parametrize("temperature,divergence,rewards", [
    ("one", "rev", [0.5, 0.0, 1.0, 0.25]),
    ("mean", "fwd", [1, 0, 0, 0, 1, 0]),
    ("0.7", "rev", [2.0, -1.0, 0.5]),
    ("loo", "rev", [1, 0, 0, 1, 1]),  # RLOO: A = R - mean of the others
    ("batch_std", "rev", [0.5, 0.0, 1.0, 0.25]),  # REINFORCE++-baseline on a one-group batch
])
def test_other_temperatures_and_divergences(temperature, divergence, rewards, capsys):
    from openrlhf_lpo.cli.explain import main

    main(["--rewards", *map(str, rewards), "--temperature", temperature, "--divergence", divergence])
    text = capsys.readouterr().out
    spec = float(temperature) if temperature[0].isdigit() else temperature
    tau, p, w, c, a, d = _reference(rewards, spec, divergence)
    table = _table(text)
    np.testing.assert_allclose(table[:, 3], w, atol=0.501e-4, rtol=0)
    np.testing.assert_allclose(table[:, 4], c, atol=0.501e-5, rtol=0)
    paired = temperature in ("one", "mean", "loo", "batch_std")
    assert table.shape[1] == (6 if paired else 5)  # a PG column only for a paired temperature
    if paired:
        np.testing.assert_allclose(table[:, 5], a, atol=0.501e-4, rtol=0)
        if temperature == "loo":  # the estimator's own definition: R_k minus the mean of the other K-1
            r = np.asarray(rewards, dtype=np.float64)
            loo = r - (r.sum() - r) / (len(r) - 1)
            np.testing.assert_allclose(table[:, 5], loo, atol=0.501e-4, rtol=0)
        if divergence == "rev":  # Proposition 1, printed and true
            assert "On-policy reverse KL: c_k = -A_k/K (Proposition 1)." in text
            np.testing.assert_allclose(c, -a / len(rewards), atol=1e-12)


def test_bad_input_names_the_flag(capsys):
    from openrlhf_lpo.cli.explain import main

    with pytest.raises(SystemExit) as e:
        main(["--rewards", "1", "0", "--temperature", "median"])
    assert e.value.code == 2 and "unknown temperature 'median'; valid: batch_std, loo, mean, one, pop_std, std" in capsys.readouterr().err


@pytest.mark.parametrize("divergence, bound", [("hellinger", "bound 2"), ("tv", "bound 1"), ("alpha:0.5", "bound 4"),
                                               ("alpha:2", "no bound"), ("alpha:-0.5", "no bound"), ("js", "no bound")])
def test_the_divergence_family_with_its_coefficients_and_bound(divergence, bound, capsys):
    """Off-policy (current s given): the printed c equals central finite differences of the divergence's
    definition, computed here in numpy; the summary states the proven bound on sum |c|."""
    from openrlhf_lpo.cli.explain import main

    rewards, s = [1.0, 0.0, 0.0, 0.5], np.array([0.1, 0.0, -0.1, 0.05])
    main(["--rewards", *map(str, rewards), "--divergence", divergence, "--log-ratio", *map(str, s)])
    text = capsys.readouterr().out
    r = np.asarray(rewards)
    x = (r - r.max()) / np.std(r, ddof=1)
    w = np.exp(x) / np.exp(x).sum()

    def div(s):
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        if divergence == "hellinger":
            return ((np.sqrt(w) - np.sqrt(p)) ** 2).sum()
        if divergence == "tv":
            return 0.5 * np.abs(w - p).sum()
        if divergence == "js":
            m = (p + w) / 2
            return 0.5 * (np.sum(p * np.log(p / m)) + np.sum(w * np.log(w / m)))
        a = float(divergence.split(":")[1])
        return (np.sum(w ** a * p ** (1 - a)) - 1) / (a * (a - 1))

    h = 1e-6
    c = np.array([(div(s + h * np.eye(4)[k]) - div(s - h * np.eye(4)[k])) / (2 * h) for k in range(4)])
    table = _table(text)
    np.testing.assert_allclose(table[:, 4], c, atol=0.6e-5, rtol=0)
    assert f"divergence={divergence}" in text.splitlines()[0]
    summary = [line for line in text.splitlines() if line.startswith("D = ")][0]
    assert f"({bound})" in summary and abs(float(summary.split(";")[0][4:]) - div(s)) < 0.5e-6


def test_bad_divergence_names_the_family(capsys):
    from openrlhf_lpo.cli.explain import main

    with pytest.raises(SystemExit) as e:
        main(["--rewards", "1", "0", "--divergence", "alpha:nan"])
    assert e.value.code == 2 and "divergence 'alpha:nan': a = nan must be a finite real number" in capsys.readouterr().err
