"""``lpo-eval`` on an image benchmark: Geometry3k read from its layouts, the paper's prompt with the
image item (a registered template: system prompt, default stop strings), the ``hf-vlm`` engine on a tiny
offline Qwen2.5-VL (routed from ``--engine hf``, stop strings honoured, images encoded as the trainer
encodes them), job keys that follow the images and the processor, Pass@16 by default."""

import json

import pytest

from openrlhf_lpo.data.geometry import draw_problem, image_to_png

ROWS = [("triangle_angle", 0, "Find x."), ("segment_sum", 1, "Find A C."), ("right_hypotenuse", 2, "Find x.")]


def _png(kind, seed):
    image, _, answer = draw_problem(kind, seed, 84)
    return image_to_png(image), answer


@pytest.fixture(scope="module")
def geo_parquet(tmp_path_factory):
    """The HF layout (hiyouga/geometry3k): images = [{bytes, path}], problem with <image>, answer value."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for kind, seed, text in ROWS:
        data, answer = _png(kind, seed)
        rows.append({"images": [{"bytes": data, "path": None}], "problem": "<image>" + text, "answer": answer})
    path = tmp_path_factory.mktemp("geo3k") / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def geo_json_png(tmp_path_factory):
    """The original layout: test/<id>/data.json (choices, answer letter) + img_diagram.png."""
    root = tmp_path_factory.mktemp("geo3k_raw")
    for i, (kind, seed, text) in enumerate(ROWS[:2]):
        data, answer = _png(kind, seed)
        d = root / "test" / str(2401 + i)
        d.mkdir(parents=True)
        (d / "img_diagram.png").write_bytes(data)
        choices = [str(int(answer) + off) for off in (-2, 0, 3, 5)]
        (d / "data.json").write_text(json.dumps({"id": 2401 + i, "problem_text": text, "choices": choices, "answer": "B"}))
    return str(root)


@pytest.fixture(scope="module")
def vlm_ckpt(tmp_path_factory):
    from openrlhf_lpo.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm_ckpts") / "geo_run" / "global_step_3", seed=0)


def test_geometry3k_from_hf_parquet_and_json_png(geo_parquet, geo_json_png):
    from evaluation.benchmarks import get_benchmark, load_benchmark
    from evaluation.generate import GenOptions, resolve_n_k
    from evaluation.vision import decode_image

    spec = get_benchmark("geo3k")
    assert (spec.name, spec.k, spec.group, spec.kind) == ("geometry3k", 16, "vision", "math")
    assert resolve_n_k("geometry3k", GenOptions(benchmarks=["geometry3k"], out="x")) == (16, 16)  # Pass@16
    hf = load_benchmark("geometry3k", geo_parquet)
    assert [p.gold for p in hf.problems] == [_png(k, s)[1] for k, s, _ in ROWS]
    assert all(p.question.startswith("<image>") and len(p.images) == 1 for p in hf.problems)
    original = draw_problem("segment_sum", 1, 84)[0].convert("RGB")
    assert list(decode_image(hf.problems[1].images[0]).getdata()) == list(original.getdata())
    raw = load_benchmark("geometry3k", geo_json_png)  # option letter "B" -> the value of choice B
    assert [p.gold for p in raw.problems] == [_png(k, s)[1] for k, s, _ in ROWS[:2]]
    assert [p.id for p in raw.problems] == ["2401", "2402"] and raw.problems[0].question == "<image>Find x."
    assert hf.data_sha != load_benchmark("geometry3k", geo_parquet, limit=2).data_sha


def test_geometry3k_hub_name_offline_is_a_clear_error(monkeypatch):
    from evaluation.benchmarks import load_benchmark

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="download") as e:
        load_benchmark("geometry3k")  # default: hiyouga/geometry3k@test
    assert "--data geometry3k=PATH" in str(e.value) and "hiyouga/geometry3k" in str(e.value)


def test_text_benchmarks_keep_their_data_hash(bench_dir, monkeypatch):
    """Problems gained an images field; a text benchmark's data hash (its job key) is unchanged."""
    from evaluation.benchmarks import load_benchmark
    from evaluation.io import canonical_json, sha256_text

    monkeypatch.setenv("LPO_BENCHMARKS_DIR", str(bench_dir))
    loaded = load_benchmark("math500", limit=3)
    fields = ("id", "question", "gold", "kind", "choices")
    assert loaded.data_sha == sha256_text(canonical_json([{f: getattr(p, f) for f in fields} for p in loaded.problems]))


def test_engine_encodes_the_image_like_the_trainer(vlm_ckpt, geo_parquet, tiny_ckpt):
    """The hf-vlm engine's inputs for the verl-geo3k prompt == OpenRLHF's rollout tokenization
    (process_prompt_with_images), i.e. evaluation sees the image exactly as training did; stop strings cut
    its completions like the text engine's; text engines and image-less prompts are refused."""
    from openrlhf.utils.vlm_utils import process_prompt_with_images

    from evaluation.benchmarks import load_benchmark
    from evaluation.engines import Sampling, make_engine
    from evaluation.templates import default_stop, render_prompt

    with pytest.raises(ValueError, match="--trust-remote-code"):  # the tiny processor ships its own (re-export) code
        make_engine("hf", vlm_ckpt)
    eng = make_engine("hf", vlm_ckpt, trust_remote_code=True)
    assert type(eng).__name__ == "HFVisionEngine"
    p = load_benchmark("geometry3k", geo_parquet).problems[2]
    prompt = render_prompt("verl-geo3k", p.question, p.kind, eng.tokenizer)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in prompt and "MUST BE put in \\boxed{}" in prompt
    with_system = render_prompt("verl-geo3k", p.question, p.kind, eng.tokenizer, system_prompt="Be brief.")
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n" + prompt
    assert default_stop("verl-geo3k", eng.text_tokenizer) == ["<|im_end|>", "<|endoftext|>"]
    enc = eng.encode(prompt, p.images)
    ids, mm, _ = process_prompt_with_images(eng.tokenizer, prompt, list(p.images))
    assert enc["input_ids"][0].tolist() == ids and enc["image_grid_thw"].tolist() == mm["image_grid_thw"].tolist()
    assert ids.count(eng.tokenizer.image_token_id) == 9  # 84 px: 3 x 3 merged patches
    with pytest.raises(ValueError, match="verl-geo3k"):
        eng.encode(render_prompt("qwen-boxed", p.question, p.kind), p.images)
    # a stop string taken from a sampled completion cuts it there (text after the image prompt)
    s = dict(temperature=1.0, top_p=1.0, max_tokens=12)
    full = next(c for seed in range(50) for c in eng.generate([prompt], 1, Sampling(**s), [seed], images=[p.images])[0]
                if len(c.text) >= 6)
    seed = next(seed for seed in range(50)
                if eng.generate([prompt], 1, Sampling(**s), [seed], images=[p.images])[0][0] == full)
    stop = full.text[3:5]
    (cut,) = eng.generate([prompt], 1, Sampling(**s, stop=(stop,)), [seed], images=[p.images])[0]
    assert cut.text == full.text[:full.text.find(stop)] and cut.finish_reason == "stop"
    assert cut.n_tokens < full.n_tokens
    text_eng = make_engine("hf", tiny_ckpt)  # a text checkpoint stays on the text engine, which refuses images
    assert type(text_eng).__name__ == "HFEngine"
    with pytest.raises(ValueError, match="problems have images"):
        text_eng.generate([prompt], 1, Sampling(**s), [0], images=[p.images])


def test_job_key_follows_images_and_processor(tmp_path, vlm_ckpt, geo_parquet):
    """Other diagrams under the same text -> another data hash; other pixel limits in the checkpoint's
    processor (how many tokens an image becomes) -> another checkpoint id; both key the job."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from evaluation.benchmarks import load_benchmark
    from evaluation.checkpoints import checkpoint_id

    rows = pq.read_table(geo_parquet).to_pylist()
    swapped = [dict(rows[0], images=rows[1]["images"]), *rows[1:]]  # problem 0's text with problem 1's diagram
    other = tmp_path / "swapped.parquet"
    pq.write_table(pa.Table.from_pylist(swapped), other)
    a, b = load_benchmark("geometry3k", geo_parquet), load_benchmark("geometry3k", str(other))
    assert [(p.question, p.gold) for p in a.problems] == [(p.question, p.gold) for p in b.problems]
    assert a.data_sha != b.data_sha
    ckpt = tmp_path / "run" / "global_step_3"
    shutil.copytree(vlm_ckpt, ckpt)
    before = checkpoint_id(str(ckpt))
    cfg_file = ckpt / "processor_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["image_processor"]["size"]["longest_edge"] //= 2
    cfg_file.write_text(json.dumps(cfg))
    assert checkpoint_id(str(ckpt)) != before


def test_lpo_eval_run_geometry3k(tmp_path, vlm_ckpt, geo_parquet):
    """``lpo-eval run`` (the CLI's main, in process) on image problems: generate with the hf-vlm engine,
    score with the math grader, report."""
    from evaluation.cli import main

    out = tmp_path / "runs"
    rc = main(["run", "--ckpts", vlm_ckpt, "--benchmarks", "geometry3k", "--data", f"geometry3k={geo_parquet}",
               "--engine", "hf", "--template", "verl-geo3k", "--limit", "2", "--n", "2", "--k", "2",
               "--max-tokens", "6", "--workers", "1", "--out", str(out), "--no-plots", "--trust-remote-code"])
    assert rc in (0, None)
    (job,) = [p for p in out.glob("*/*") if p.is_dir()]
    cfg = json.loads((job / "config.json").read_text())
    assert cfg["engine"] == "hf" and cfg["step"] == 3 and cfg["group"] == "vision" and cfg["template"] == "verl-geo3k"
    assert cfg["sampling"]["stop"] == ["<|im_end|>", "<|endoftext|>"] and cfg["trust_remote_code"] is True
    rows = [json.loads(line) for line in open(job / "samples.jsonl")]
    assert len(rows) == 4 and {r["gold"] for r in rows} == {_png(k, s)[1] for k, s, _ in ROWS[:2]}
    assert all(1 <= r["n_tokens"] <= 6 for r in rows)
    m = json.loads((job / "metrics.json").read_text())
    assert m["n"] == 2 and set(m["pass@k"]) == {"1", "2"}
    assert m["pass@1"] == pytest.approx(sum(r["correct"] for r in rows) / 4)
