"""Promises that a plausible bug would break silently, each through the real commands: a job per sampling
setting (a temperature sweep is never served the first run's samples), a new checkpoint id when the
weights are re-saved in the same folder, and maj@k over grader-equivalent answers (``1/2``, ``0.5``,
``\\frac{1}{2}`` are one vote). ``scripts/mutation_check.py`` applies each bug and runs these tests."""

import itertools
import json
import os
import shutil

import pytest

from evaluation.checkpoints import checkpoint_id
from evaluation.generate import GEN_FILE, GenOptions
from evaluation.launch import generate
from evaluation.score import score

SETTINGS = {"temperature": 0.9, "top_p": 0.5, "top_k": 5, "max_tokens": 7, "n": {"*": 3}, "seed": 1}


def _opts(out, data, **kw):
    base = dict(benchmarks=["planted"], data={"planted": str(data)}, out=str(out), engine="planted-test",
                n={"*": 2}, k={"*": 1}, progress=False, max_tokens=6, template="none")
    base.update(kw)
    return GenOptions(**base)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_two_runs_differing_in_one_sampling_setting_leave_two_jobs(setting, tmp_path, tiny_ckpt, planted):
    data = planted.make(tmp_path, {"4": ["\\boxed{4}", "\\boxed{5}", "\\boxed{4}"]})
    out = tmp_path / "runs"
    generate([tiny_ckpt], _opts(out, data))
    rep = generate([tiny_ckpt], _opts(out, data, **{setting: SETTINGS[setting]}))
    assert len(rep.done) == 1  # the second run was generated, not found finished
    jobs = sorted(out.glob(f"*/planted-*/{GEN_FILE}"))
    assert len(jobs) == 2
    cfgs = [json.loads((j.parent / "config.json").read_text()) for j in jobs]
    key = {"n": "n", "seed": "seed"}.get(setting)
    got = sorted((c[key] if key else c["sampling"][setting]) for c in cfgs)
    want = SETTINGS[setting]["*"] if setting == "n" else SETTINGS[setting]
    base = getattr(_opts(out, data), setting)
    assert got == sorted([base["*"] if setting == "n" else base, want])


def _resave(ckpt, seed: int) -> None:
    """Re-save the checkpoint's weights (same names, shapes and dtypes: the same file size) with new values,
    keeping the file's modification time, as a copy that preserves times would."""
    import torch
    from safetensors.torch import load_file, save_file

    f = ckpt / "model.safetensors"
    st = f.stat()
    tensors = load_file(str(f))
    g = torch.Generator().manual_seed(seed)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in tensors.items()}, str(f),
              metadata={"format": "pt"})
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_checkpoint_id_changes_when_the_weights_are_resaved(tmp_path, tiny_ckpt, planted):
    ckpt = tmp_path / "run" / "ckpt" / "global_step5_hf"
    shutil.copytree(tiny_ckpt, ckpt)
    first = checkpoint_id(str(ckpt))
    assert checkpoint_id(str(ckpt)) == first  # stable while nothing changes
    _resave(ckpt, seed=1)
    second = checkpoint_id(str(ckpt))
    assert second != first and second.split("-")[0] == first.split("-")[0]  # same label, new hash
    # end to end: the re-saved checkpoint is evaluated again instead of found finished
    data = planted.make(tmp_path, {"4": ["\\boxed{4}", "\\boxed{5}"]})
    out = tmp_path / "runs"
    generate([str(ckpt)], _opts(out, data))
    _resave(ckpt, seed=2)
    rep = generate([str(ckpt)], _opts(out, data))
    assert len(rep.done) == 1 and len({p.parent.parent.name for p in out.glob(f"*/*/{GEN_FILE}")}) == 2


def _maj_at_k(labels: list, k: int) -> float:
    """Brute force: the mean over all k-subsets of 1/t when the correct class ("ok") is among the t most
    voted classes (None abstains)."""
    total = 0.0
    subsets = list(itertools.combinations(range(len(labels)), k))
    for s in subsets:
        votes = [labels[i] for i in s if labels[i] is not None]
        if not votes:
            continue
        counts = {v: votes.count(v) for v in set(votes)}
        top = max(counts.values())
        leaders = [v for v, c in counts.items() if c == top]
        total += 1 / len(leaders) if "ok" in leaders else 0.0
    return total / len(subsets)


def test_score_majority_votes_with_the_graders_equivalence(tmp_path, tiny_ckpt, planted):
    """Wrong answers equal under math-verify (1/2, 0.5, \\frac{1}{2}, 2/4) are one vote through `score`."""
    texts = {
        "3": ["\\boxed{3}", "\\boxed{3}", "\\boxed{1/2}", "\\boxed{0.5}", "\\boxed{\\frac{1}{2}}"],
        "7": ["\\boxed{7}", "\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{2/4}", "\\boxed{8}"],
        "0.25": ["\\boxed{\\frac{1}{4}}", "\\boxed{0.25}", "\\boxed{1/3}", "\\boxed{\\frac13}", "I do not know."],
    }
    # the classes math-verify puts these answers in: "ok" for a correct one, a name per wrong value
    classes = [["ok", "ok", "half", "half", "half"], ["ok", "half", "half", "half", "eight"],
               ["ok", "ok", "third", "third", None]]
    data = planted.make(tmp_path, texts)
    out = tmp_path / "runs"
    generate([tiny_ckpt], _opts(out, data, n={"*": 5}, k={"*": 1}, max_tokens=64))
    (m,) = score(out, workers=1, timeout=20, show_progress=False, budgets=())
    rows = [json.loads(x) for x in next(out.glob("*/planted-*/samples.jsonl")).read_text().splitlines()]
    assert [r["correct"] for r in rows] == [c == "ok" for cl in classes for c in cl]
    for k in (1, 2, 4, 5):
        want = sum(_maj_at_k(cl, k) for cl in classes) / len(classes)
        assert m["maj@k"][str(k)] == pytest.approx(want), k
    assert m["maj@k"]["5"] == pytest.approx((0 + 0 + 0.5) / 3)  # as text votes it would be (1 + 0.2 + 1) / 3
