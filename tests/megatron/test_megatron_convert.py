"""HF <-> Megatron conversion as pure functions (no process group): layouts and round trips
for Qwen3, Qwen2, Llama and Mistral (tiny random models built offline), and slice reading."""

import functools
import itertools

import pytest
import torch

from openrlhf_lpo.megatron import convert
from openrlhf_lpo.testing.tiny import tiny_config


@functools.lru_cache(maxsize=None)
def _hf_state(arch, tied, layers=4):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, vocab_size=128, hidden_size=64, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=96, tie_word_embeddings=tied)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    for k in sd:  # make every tensor distinct (norms are all-ones, biases zero at init)
        sd[k] = sd[k] + torch.randn_like(sd[k])
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return cfg, sd


@pytest.mark.parametrize(
    "arch,tied,tp,pp,te",
    [(a, t, tp, pp, te) for a, t, (tp, pp), te in itertools.product(
        ["qwen3", "qwen2", "llama", "mistral"], [True, False], [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)],
        [False, True])],
)
def test_round_trip_bit_exact(arch, tied, tp, pp, te):
    cfg, sd = _hf_state(arch, tied)
    shards = convert.hf_to_mcore_shards(sd, cfg, tp, pp, te_names=te)
    back = convert.mcore_shards_to_hf(shards, cfg, tp, pp, te_names=te)
    expect = set(sd) - ({"lm_head.weight"} if tied else set())
    assert set(back) == expect
    for k in expect:
        assert torch.equal(back[k], sd[k]), k
    # every shard really is a 1/tp piece of the fused tensor (nothing replicated by mistake)
    q = shards[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert q.shape[0] == (4 + 2 * 2) * 16 // tp
    if tied and pp > 1:  # the last stage keeps its own copy of the embedding as output layer
        assert torch.equal(shards[(0, pp - 1)]["output_layer.weight"],
                           sd["model.embed_tokens.weight"].chunk(tp, 0)[0])


def test_qkv_is_group_interleaved():
    """Independent construction: rows of group g = its 2 query heads, its key, its value."""
    cfg = tiny_config("qwen3", vocab_size=128, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=96)
    hd = 16
    q = torch.arange(4 * hd, dtype=torch.float32)[:, None] * torch.ones(1, 3)
    k = 1000 + torch.arange(2 * hd, dtype=torch.float32)[:, None] * torch.ones(1, 3)
    v = 2000 + torch.arange(2 * hd, dtype=torch.float32)[:, None] * torch.ones(1, 3)
    fused = convert.fuse_qkv(q, k, v, cfg)
    expected = []
    for g in range(2):
        expected += [q[(2 * g + h) * hd:(2 * g + h + 1) * hd] for h in range(2)]
        expected += [k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    assert torch.equal(fused, torch.cat(expected))
    # negative control: the naive [q; k; v] layout is not what megatron expects
    assert not torch.equal(fused, torch.cat([q, k, v]))
    # TP=2: rank 1 holds exactly group 1
    assert torch.equal(fused.chunk(2)[1], torch.cat(expected[4:]))
    assert all(torch.equal(a, b) for a, b in zip(convert.split_qkv(fused, cfg), (q, k, v)))


def test_gate_up_split_per_shard():
    cfg, sd = _hf_state("qwen3", True, layers=1)
    shards = convert.hf_to_mcore_shards(sd, cfg, 2, 1)
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    fc1 = shards[(1, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    proj = shards[(1, 0)]["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(proj, sd["model.layers.0.self_attn.o_proj.weight"].chunk(2, dim=1)[1])


def test_unknown_tensor_name_raises():
    cfg, _ = _hf_state("qwen3", True, layers=1)
    with pytest.raises(KeyError, match="no HF mapping"):
        convert.rule_for("decoder.layers.0.mlp.router.weight", cfg)


def test_safetensors_getter(tmp_path):
    from safetensors.torch import save_file

    t = {"a": torch.randn(3, 2), "b": torch.arange(4.0)}
    save_file(t, str(tmp_path / "model.safetensors"))
    get = convert.hf_tensor_getter(str(tmp_path))
    assert torch.equal(get("a"), t["a"]) and torch.equal(get("b"), t["b"])
    with pytest.raises(KeyError):
        get("c")
    with pytest.raises(ValueError, match="no model.safetensors"):
        convert.hf_tensor_getter(str(tmp_path / "missing"))


def test_slice_reads_equal_whole_tensor_reads(tmp_path):
    """Reading only a rank's rows/columns from safetensors gives the same shards as slicing whole
    tensors in memory, and reads exactly the shard's elements."""
    from safetensors.torch import save_file

    cfg, sd = _hf_state("llama", False)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    total = sum(v.numel() for v in sd.values())
    for tp, pp in ((2, 1), (2, 2), (1, 4)):
        per_rank = []
        for t in range(tp):
            for p in range(pp):
                reader = convert.TensorReader(str(tmp_path))
                got = dict(convert.hf_to_mcore_local(reader, cfg, tp, t, pp, p))
                ref = dict(convert.hf_to_mcore_local(sd, cfg, tp, t, pp, p))
                assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
                assert reader.elements_read == sum(v.numel() for v in got.values())
                per_rank.append(reader.elements_read)
        assert max(per_rank) < total / min(tp * pp, 4) * 1.5  # each rank reads about its share
