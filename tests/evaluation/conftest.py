"""Fixtures for the evaluation tests: real benchmark data, one shared grader pool, a tiny model."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def bench_dir() -> Path:
    d = Path(os.environ.get("LPO_BENCHMARKS_DIR", REPO.parent / "shared" / "benchmarks")).resolve()
    assert (d / "math500" / "test.jsonl").exists(), f"benchmark data missing in {d} (set LPO_BENCHMARKS_DIR)"
    return d


@pytest.fixture(scope="session")
def pool():
    """One 2-worker grader pool for the session (worker start-up is the expensive part)."""
    from openrlhf_lpo.rewards.grading import GraderPool

    p = GraderPool(workers=2, timeout=20)
    yield p
    p.close()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    from openrlhf_lpo.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ckpts")
    return build_tiny_model(root / "run_x" / "global_step_5", seed=0, num_layers=2, hidden_size=128,
                            num_heads=2, head_dim=64, num_kv_heads=1, intermediate_size=256)


@pytest.fixture
def gpqa_csv(tmp_path):
    """Write GPQA's original csv layout with ``n`` made-up questions; returns the path."""
    import csv

    def write(n: int, name: str = "gpqa_diamond.csv") -> Path:
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                                              "Incorrect Answer 3"])
            w.writeheader()
            for i in range(n):
                w.writerow({"Question": f"Q{i}?", "Correct Answer": f"right{i}", "Incorrect Answer 1": f"w1-{i}",
                            "Incorrect Answer 2": f"w2-{i}", "Incorrect Answer 3": f"w3-{i}"})
        return path

    return write
