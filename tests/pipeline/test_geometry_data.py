"""Geometry data and rewards: the synthetic PIL task, the Geometry3k loader (HF parquet, JSON + PNG
folders, hub name offline), the paper's prompt, and answers graded by the shared math grader."""

import json

import pytest

from openrlhf_lpo.data.geometry import KINDS, PYTHAGOREAN, draw_problem, generate_geometry_problems, image_to_png
from openrlhf_lpo.data.geometry3k import load_geometry3k, read_geometry3k
from openrlhf_lpo.data.templates import GEOMETRY_INSTRUCTION, geometry_prompt, render
from openrlhf_lpo.rewards import reward_func as rf
from openrlhf_lpo.rewards.geometry import geometry_label, grade_geometry, parse_geometry_label

VERL_GEO3K = ("You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
              "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}.")


def test_paper_prompt_exact():
    assert GEOMETRY_INSTRUCTION == VERL_GEO3K
    assert geometry_prompt("<image>Find x.") == "<image>Find x. " + VERL_GEO3K
    assert render("geometry", problem="Find y.", choices=["1", "2"]) == "<image>Find y. Choices: A. 1 B. 2 " + VERL_GEO3K
    assert render("geometry-short", problem="<image>Find x.") == "<image>Find x. Answer in \\boxed{}."


def test_synthetic_problems_are_deterministic_and_load_in_openrlhf(tmp_path):
    from openrlhf.utils.vlm_utils import load_images

    rows = generate_geometry_problems(8, seed=3, template="geometry-short")
    assert rows == generate_geometry_problems(8, seed=3, template="geometry-short")
    assert [r["kind"] for r in rows] == list(KINDS) * 2
    assert rows[0]["images"] != rows[4]["images"]  # same question text, another diagram
    for r in rows:
        answer = int(r["answer"])
        assert parse_geometry_label(r["label"]) == (r["answer"], None)
        (image,) = load_images(r["images"])  # OpenRLHF decodes the data URI
        assert image.size == (112, 112)
        if r["kind"] == "triangle_angle":
            assert 0 < answer < 120
        elif r["kind"] == "right_hypotenuse":
            assert answer in {c for _, _, c in PYTHAGOREAN}
        elif r["kind"] == "segment_sum":
            assert 4 <= answer <= 80
    on_disk = generate_geometry_problems(2, seed=3, image_dir=str(tmp_path / "img"))
    assert all(p["images"][0].endswith(".png") and load_images(p["images"])[0].size == (112, 112) for p in on_disk)
    with pytest.raises(ValueError, match="unknown"):
        draw_problem("hexagon", 0)


def _png(kind, seed):
    image, _, answer = draw_problem(kind, seed, 84)
    return image_to_png(image), answer


@pytest.fixture(scope="module")
def hf_layout(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("snapshot")
    (root / "data").mkdir()
    for split, kinds in (("train", ("triangle_angle", "segment_sum", "read_number")), ("test", ("right_hypotenuse",))):
        rows = []
        for i, kind in enumerate(kinds):
            data, answer = _png(kind, i)
            rows.append({"images": [{"bytes": data, "path": None}], "problem": "<image>Find x.", "answer": answer})
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / f"{split}-00000-of-00001.parquet")
    return root


@pytest.fixture(scope="module")
def json_png_layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("geometry3k")
    for i in range(2):
        data, answer = _png("segment_sum", 10 + i)
        d = root / "train" / str(i)
        d.mkdir(parents=True)
        (d / "img_diagram.png").write_bytes(data)
        (d / "data.json").write_text(json.dumps({"id": i, "problem_text": "Find A C.", "answer": "C",
                                                 "choices": ["1", "2", answer, "4"]}))
    return root


def test_geometry3k_hf_snapshot_and_parquet(hf_layout):
    from openrlhf.utils.vlm_utils import load_images

    train = load_geometry3k(str(hf_layout), "train")
    assert [r["answer"] for r in train] == [_png(k, i)[1] for i, k in enumerate(("triangle_angle", "segment_sum", "read_number"))]
    assert train[0]["prompt"] == "<image>Find x. " + VERL_GEO3K
    assert json.loads(train[0]["label"]) == {"task": "geometry", "answer": train[0]["answer"], "choices": None}
    (image,) = load_images(train[1]["images"])
    assert list(image.convert("RGB").getdata()) == list(draw_problem("segment_sum", 1, 84)[0].convert("RGB").getdata())
    assert len(read_geometry3k(str(hf_layout), "test")) == 1
    assert len(load_geometry3k(str(hf_layout / "data" / "train-00000-of-00001.parquet"), limit=2)) == 2
    with pytest.raises(ValueError, match="split 'dev'"):
        read_geometry3k(str(hf_layout), "dev")


def test_geometry3k_json_png_folders_with_choices(json_png_layout):
    rows = load_geometry3k(str(json_png_layout), "train")
    answers = [_png("segment_sum", 10 + i)[1] for i in range(2)]
    assert [r["answer"] for r in rows] == answers  # letter "C" resolved to the value of option C
    assert rows[0]["prompt"] == f"<image>Find A C. Choices: A. 1 B. 2 C. {answers[0]} D. 4 " + VERL_GEO3K
    assert parse_geometry_label(rows[0]["label"]) == (answers[0], ["1", "2", answers[0], "4"])


def test_geometry3k_hub_name_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="huggingface-cli download hiyouga/geometry3k"):
        read_geometry3k("hiyouga/geometry3k", "train")
    with pytest.raises(ValueError, match="no such file"):
        read_geometry3k("/nonexistent/dir/x", "train")


def test_prepare_cli(hf_layout, tmp_path):
    from openrlhf_lpo.data.prepare import main

    assert main(["geometry3k", "--src", str(hf_layout), "--split", "train", "--out", str(tmp_path / "g.jsonl")]) == 0
    assert main(["geometry", "--n", "3", "--kinds", "read_number", "--template", "geometry-short",
                 "--out", str(tmp_path / "s.jsonl")]) == 0
    rows = [json.loads(l) for l in open(tmp_path / "g.jsonl")] + [json.loads(l) for l in open(tmp_path / "s.jsonl")]
    assert len(rows) == 6 and all(r["images"][0].startswith("data:image/png;base64,") for r in rows)
    with pytest.raises(SystemExit, match="unknown"):
        main(["geometry", "--kinds", "nope", "--out", str(tmp_path / "x.jsonl")])


CHOICES = ["3", "2\\sqrt{3}", "6", "12"]


@pytest.mark.parametrize("response,answer,choices,correct,status", [
    ("x = 180 - 60 - 86 so \\boxed{34}", "34", None, True, "ok"),
    ("\\boxed{34.0}", "34", None, True, "ok"),
    ("\\boxed{35}", "34", None, False, "ok"),
    ("<think>2\\sqrt{3}</think> \\boxed{\\sqrt{12}}", "2\\sqrt{3}", None, True, "ok"),
    ("<think> unfinished \\boxed{34}", "34", None, False, "no_answer"),
    ("I think it is B. \\boxed{B}", "2\\sqrt{3}", CHOICES, True, "ok"),
    ("\\boxed{(B)}", "2\\sqrt{3}", CHOICES, True, "ok"),
    ("\\boxed{\\text{C}}", "2\\sqrt{3}", CHOICES, False, "ok"),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", CHOICES, True, "ok"),  # the value instead of the letter
    ("The answer is B. \\boxed{6}", "2\\sqrt{3}", CHOICES, False, "ok"),  # only the box counts
])
def test_grade_geometry(response, answer, choices, correct, status):
    r = grade_geometry(response, answer, choices)
    assert (r.correct, r.status) == (correct, status)


def test_geometry_labels_and_reward_dispatch():
    assert parse_geometry_label(geometry_label("B", CHOICES)) == ("2\\sqrt{3}", CHOICES)
    assert parse_geometry_label(geometry_label("12", CHOICES)) == ("12", CHOICES)
    with pytest.raises(ValueError, match="beyond"):
        geometry_label("F", CHOICES)
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x. Answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    query = prompt.replace("<|image_pad|>", "<|image_pad|>" * 16)  # the engine decodes the expanded prompt
    labels = [geometry_label("B", CHOICES), geometry_label("34"), geometry_label("34")]
    out = rf.reward_func([query + "\\boxed{B}<|im_end|>", query + "\\boxed{34}", query + "x"], [prompt] * 3, labels)
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0]
    assert out["extra_logs"]["answer_found"].tolist() == [1.0, 1.0, 0.0]
