"""Resume: a generate run killed mid-benchmark (with a torn last write) and restarted is byte-identical."""

import random
from pathlib import Path

import pytest

from evaluation.engines import ENGINES, Completion, register_engine
from evaluation.generate import GEN_FILE, PARTIAL_SUFFIX, GenOptions, recover_partial
from evaluation.launch import generate
from evaluation.report import report
from evaluation.score import score

if "fake-test" not in ENGINES:

    @register_engine("fake-test")
    class FakeEngine:
        """Deterministic per-seed answers; ``fail_after`` calls then raises (a killed process)."""

        fail_after = None
        calls = 0

        def __init__(self, model_path, **kw):
            self.tokenizer = None

        def generate(self, prompts, n, sampling, seeds):
            type(self).calls += 1
            if self.fail_after is not None and type(self).calls > self.fail_after:
                raise KeyboardInterrupt("simulated kill")
            out = []
            for seed in seeds:
                rng = random.Random(seed)
                out.append([Completion(rng.choice(["\\boxed{%d}" % rng.randint(0, 30), "\\boxed{C}", "Answer: B", "??"]),
                                       rng.choice(["stop", "length"]), rng.randint(1, 50)) for _ in range(n)])
            return out

        def close(self):
            pass


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.suffix != ".png"}


def _opts(out, engine, **kw):
    base = dict(benchmarks=["aime24", "arc_c"], out=str(out), engine=engine, n={"*": 3}, k={"*": 2}, limit=7,
                batch_problems=2, progress=False, max_tokens=6, template="qwen-boxed")
    base.update(kw)
    return GenOptions(**base)


def test_fake_engine_resume_is_byte_identical(tmp_path, tiny_ckpt):
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    ENGINES["fake-test"].fail_after = None
    generate([tiny_ckpt], _opts(clean, "fake-test"))
    ENGINES["fake-test"].calls, ENGINES["fake-test"].fail_after = 0, 6  # aime24: 4 calls; dies in arc_c
    with pytest.raises(KeyboardInterrupt):
        generate([tiny_ckpt], _opts(resumed, "fake-test"))
    partials = list(resumed.rglob(GEN_FILE + PARTIAL_SUFFIX))
    assert len(partials) == 1 and "arc_c" in str(partials[0])
    lines = partials[0].read_bytes().splitlines(keepends=True)
    assert len(lines) == 3 * 2 * 2  # two calls of two problems, n=3 each, before the kill
    with open(partials[0], "ab") as f:  # a torn write: half a problem, half a line
        f.write(lines[0] + lines[1][:20])
    ENGINES["fake-test"].fail_after = None
    generate([tiny_ckpt], _opts(resumed, "fake-test"))
    assert not list(resumed.rglob("*" + PARTIAL_SUFFIX))
    for root in (clean, resumed):
        score(root, workers=1, timeout=20, show_progress=False)
        report(root, plots=False)
    a, b = _files(clean), _files(resumed)
    assert sorted(a) == sorted(b) and len(a) == 2 * 6 + 3  # config, problems, generations, samples, metrics, .lock
    for name in a:
        assert a[name] == b[name], name


def test_recover_partial_keeps_every_whole_expected_sample(tmp_path):
    """Each sample has its own seed, so every whole line that is the next expected sample is kept (also
    inside a problem); a torn line, or the first line out of order, ends what is kept."""
    p = tmp_path / "g.partial"
    rows = [f'{{"problem_id": "{i}", "sample_idx": {j}}}\n' for i in range(3) for j in range(2)]
    expected = [(str(i), j) for i in range(3) for j in range(2)]
    p.write_text("".join(rows[:5]) + '{"problem_id": "2", "sam')
    assert recover_partial(p, expected) == 5
    assert p.read_text() == "".join(rows[:5])
    p.write_text("".join(rows[:3]) + rows[4])  # sample (1, 1) is missing: (2, 0) is not the next one
    assert recover_partial(p, expected) == 3 and p.read_text() == "".join(rows[:3])
    p.write_text("".join(rows[2:4]))  # does not start with problem 0: nothing is reusable
    assert recover_partial(p, expected) == 0 and p.read_text() == ""


def test_hf_engine_resume_is_byte_identical(tmp_path, tiny_ckpt, kill_engine_after):
    kw = dict(benchmarks=["math500"], limit=3, batch_problems=1, n={"*": 2}, k={"*": 1}, max_tokens=5)
    generate([tiny_ckpt], _opts(tmp_path / "clean", "hf", **kw))
    restore = kill_engine_after(1)
    with pytest.raises(KeyboardInterrupt):
        generate([tiny_ckpt], _opts(tmp_path / "resumed", "hf", **kw))
    restore()
    generate([tiny_ckpt], _opts(tmp_path / "resumed", "hf", **kw))
    a, b = _files(tmp_path / "clean"), _files(tmp_path / "resumed")
    assert sorted(a) == sorted(b) and any(k.endswith(GEN_FILE) for k in a)
    for name in a:
        assert a[name] == b[name], name
