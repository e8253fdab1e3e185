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
    from openrlhf_lpo.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ckpts")
    return build_tiny_model(root / "run_x" / "global_step_5", seed=0, num_layers=2, hidden_size=128,
                            num_heads=2, head_dim=64, num_kv_heads=1, intermediate_size=256)


class Planted:
    """A custom math benchmark whose samples are planted texts: ``make(tmp_path, {gold: [texts]})`` writes the
    data file (one problem per gold, ids "0", "1", ...) and arms the ``planted-test`` engine, which answers
    sample j of problem p with ``texts[j]`` (found from the per-sample seed) and counts the text's tokens
    with the checkpoint's tokenizer."""

    plan: dict[str, list[str]] = {}
    bench = "planted"

    @classmethod
    def make(cls, root: Path, golds_texts: dict[str, list[str]], bench: str = "planted") -> Path:
        import json

        data = root / f"{bench}.jsonl"
        data.write_text("".join(json.dumps({"problem": f"Question {i}: find it.", "answer": gold}) + "\n"
                                for i, gold in enumerate(golds_texts)))
        cls.plan = {str(i): list(texts) for i, texts in enumerate(golds_texts.values())}
        cls.bench = bench
        return data


def _register_planted_engine():
    from evaluation.engines import ENGINES, Completion, register_engine

    if "planted-test" in ENGINES:
        return

    @register_engine("planted-test")
    class PlantedEngine:
        def __init__(self, model_path, seed=0, **kw):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.seed = seed

        def generate(self, prompts, n, sampling, seeds, **kw):
            from evaluation.generate import sample_seed

            where = {sample_seed(self.seed, Planted.bench, pid, j): (pid, j)
                     for pid, texts in Planted.plan.items() for j in range(len(texts))}
            out = []
            for seed in seeds:
                pid, j = where[seed]
                text = Planted.plan[pid][j]
                ntok = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                out.append([Completion(text, "length" if ntok >= sampling.max_tokens else "stop", ntok)])
            return out

        def close(self):
            pass


_register_planted_engine()


@pytest.fixture(scope="session")
def planted():
    return Planted


@pytest.fixture
def kill_engine_after(monkeypatch):
    """``kill_engine_after(calls)``: the hf engine's generate raises KeyboardInterrupt (a killed process) after
    ``calls`` calls; returns ``restore()``, which puts the previous generate back."""
    from evaluation.engines import HFEngine

    def arm(calls: int):
        real = HFEngine.generate
        count = {"n": 0}

        def dying(self, *a, **k):
            count["n"] += 1
            if count["n"] > calls:
                raise KeyboardInterrupt("simulated kill")
            return real(self, *a, **k)

        monkeypatch.setattr(HFEngine, "generate", dying)
        return lambda: monkeypatch.setattr(HFEngine, "generate", real)

    return arm


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
