"""Warm-up cache: key, reuse, determinism, atomicity."""

import dataclasses
import json

import pytest
import torch

from openrlhf_lpo.demo import warmup
from openrlhf_lpo.demo.warmup import WarmupConfig, cached_path, ensure_warmup


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_key_covers_every_field():
    base = WarmupConfig()
    assert base.key() == WarmupConfig().key()
    keys = {base.key()}
    for f in dataclasses.fields(WarmupConfig):
        v = getattr(base, f.name)
        if isinstance(v, bool):
            nv = not v
        elif isinstance(v, int):
            nv = v + 1
        elif isinstance(v, float):
            nv = v * 0.5 + 0.01
        else:
            nv = v + "x"
        keys.add(dataclasses.replace(base, **{f.name: nv}).key())
    assert len(keys) == 1 + len(dataclasses.fields(WarmupConfig))


def test_cache_dir_from_env(cache_dir):
    assert cached_path(WarmupConfig()).parent == cache_dir / "warmup"


def test_trains_once_then_reuses_and_is_deterministic(cache_dir, micro_warmup_config):
    cfg = micro_warmup_config
    first = ensure_warmup(cfg, progress=False)
    assert first["cached"] is False
    path = cached_path(cfg)
    assert first["path"] == str(path)
    assert first["steps"] == cfg.max_steps  # target 1.0 is not reached by a micro model in 4 steps
    assert [h["step"] for h in first["history"]] == [2, 4]
    meta = json.loads((path / "warmup.json").read_text())
    assert meta["key"] == cfg.key() and meta["config"] == dataclasses.asdict(cfg)
    w1 = _weights(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    second = ensure_warmup(cfg, progress=False)
    assert second["cached"] is True and second["path"] == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not retrained

    third = ensure_warmup(cfg, progress=False, force=True)  # same config -> same weights
    assert third["cached"] is False
    w3 = _weights(path)
    assert w1.keys() == w3.keys()
    for k in w1:
        assert torch.equal(w1[k], w3[k]), k
    # training changed the weights away from the random init of build_tiny_model
    from openrlhf_lpo.testing.tiny import build_tiny_model

    init = build_tiny_model(cache_dir / "init", seed=cfg.seed, hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=16, intermediate_size=64)
    w0 = _weights(cache_dir / "init")
    assert any(not torch.equal(w0[k], w1[k]) for k in w1)
    assert not [p for p in (cache_dir / "warmup").iterdir() if ".tmp-" in p.name]


def test_interrupted_warmup_leaves_no_entry(cache_dir, micro_warmup_config, monkeypatch):
    def boom(cfg, out_dir, progress=True, log=None):
        (out_dir / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(warmup, "train_warmup", boom)
    with pytest.raises(KeyboardInterrupt):
        ensure_warmup(micro_warmup_config, progress=False)
    assert not cached_path(micro_warmup_config).exists()
    assert list((cache_dir / "warmup").iterdir()) == []


@pytest.mark.parametrize("field,value,flag", [("batch_size", 0, "batch_size"), ("target_accuracy", 1.5, "target_accuracy"),
                                              ("task", "nope", "--task"), ("lr", 0.0, "lr")])
def test_bad_config_is_rejected(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        dataclasses.replace(WarmupConfig(), **{field: value}).validate()
