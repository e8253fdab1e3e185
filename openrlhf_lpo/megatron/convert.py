"""HF <-> megatron-core weight conversion (Qwen2/Qwen3/Llama/Mistral), any TP x PP, one tensor at a time.

Layout facts (checked by tests/megatron against HF logits and by bit-exact round trips):

* ``linear_qkv`` is fused **group-interleaved**: for each of the ``G = num_key_value_heads``
  groups, the ``H/G`` query heads of that group, then its key head, then its value head
  (``head_dim`` rows each). Sharding it over TP on dim 0 therefore hands whole KV groups to each
  rank, which is why ``num_key_value_heads % tp == 0``. Qwen2's q/k/v biases use the same layout.
* ``linear_fc1 = [gate; up]`` **per TP shard**: rank r holds ``[gate_r; up_r]``, so gate and up
  are chunked separately.
* Column-parallel (dim 0): ``linear_qkv``, ``linear_fc1``, ``word_embeddings``, ``output_layer``;
  row-parallel (dim 1): ``linear_proj``, ``linear_fc2``; norms are replicated.
* PP: stage ``p`` holds global layers ``[p*L/pp, (p+1)*L/pp)`` under local indices; the first
  stage holds the embedding, the last the final norm and ``output_layer`` (with tied embeddings
  and pp>1 the last stage keeps its own copy of the embedding as ``output_layer.weight``).
  With ``vpp`` virtual stages, chunk ``v`` of stage ``p`` holds the ``L/(pp*vpp)`` layers from
  :func:`model.chunk_layer_offset` on; the embedding is in chunk 0 of stage 0, the final norm and
  output layer in the last chunk of the last stage. A built model is one chunk or a list of chunks
  (each chunk's offset is read from its first layer's ``layer_number``).
* RoPE needs no permutation (megatron's non-interleaved rotary = HF ``rotate_half``).
* The Transformer Engine spec fuses the pre-attention / pre-MLP RMSNorm weights into
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``; both name sets are handled.

Entry points:

* :func:`hf_to_mcore_local` – the local shard dict of one (tp_rank, pp_rank), reading through a
  :class:`TensorReader` only the HF tensors of the rank's pipeline stage and, of each, only the
  rows/columns of its TP shard (``safe_open(...).get_slice``: a 14B model at TP8 x PP1 reads ~1/8
  of the checkpoint per rank, not all of it).
* :func:`load_hf_weights` – copy HF weights into a built (possibly DDP-wrapped) model stage.
* :func:`export_hf_weights` – generator over ``(hf_name, full_tensor)`` for the whole model,
  collective over the model-parallel group: TP all-gather, PP broadcast, QKV / gate-up un-fusing.
* :func:`mcore_shards_to_hf` – the same un-sharding as a pure function over in-memory shards.
* :func:`save_hf_checkpoint` – write the exported stream as sharded safetensors (atomically).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from openrlhf_lpo.megatron.model import _get, arch_spec, chunk_layer_offset, head_dim, num_kv_heads

# TP split kinds
COL, ROW, REP, GATE_UP = "col", "row", "rep", "gate_up"

LOCAL_NAMES = {
    "input_norm": "input_layernorm.weight",
    "pre_mlp_norm": "pre_mlp_layernorm.weight",
}
TE_NAMES = {
    "input_norm": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_norm": "mlp.linear_fc1.layer_norm_weight",
}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Rule:
    """How one megatron tensor is made from HF tensors: ``fuse`` in {copy, qkv, gate_up}."""

    hf_names: Tuple[str, ...]
    fuse: str
    split: str


def _dims(cfg):
    return _get(cfg, "num_attention_heads"), num_kv_heads(cfg), head_dim(cfg)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg, tp: int = 1) -> torch.Tensor:
    """HF q/k/v (weights ``[n*hd, hidden]`` or biases ``[n*hd]``) -> group-interleaved fused QKV.

    With ``tp > 1`` the inputs are one TP rank's row chunks (its ``heads/tp`` query heads and
    ``groups/tp`` KV heads) and the result is that rank's shard of the fused tensor."""
    nh, ng, hd = _dims(cfg)
    nh, ng = nh // tp, ng // tp
    tail = q.shape[1:]
    qg = q.reshape(ng, (nh // ng) * hd, *tail)
    kg = k.reshape(ng, hd, *tail)
    vg = v.reshape(ng, hd, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail).contiguous()


def split_qkv(qkv: torch.Tensor, cfg) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv` on the full (TP-gathered) fused tensor."""
    nh, ng, hd = _dims(cfg)
    tail = qkv.shape[1:]
    per = (nh // ng) * hd
    g = qkv.reshape(ng, per + 2 * hd, *tail)
    q = g[:, :per].reshape(nh * hd, *tail).contiguous()
    k = g[:, per : per + hd].reshape(ng * hd, *tail).contiguous()
    v = g[:, per + hd :].reshape(ng * hd, *tail).contiguous()
    return q, k, v


def _norm_names(te_names: bool) -> Dict[str, str]:
    return TE_NAMES if te_names else LOCAL_NAMES


def layer_rules(cfg, te_names: bool = False) -> Dict[str, Rule]:
    """Per-layer megatron suffix -> rule; ``{i}`` in HF names is the global layer index."""
    p = "model.layers.{i}."
    n = _norm_names(te_names)
    rules = {
        n["input_norm"]: Rule((p + "input_layernorm.weight",), "copy", REP),
        "self_attention.linear_qkv.weight": Rule(
            (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
            "qkv",
            COL,
        ),
        "self_attention.linear_proj.weight": Rule((p + "self_attn.o_proj.weight",), "copy", ROW),
        n["pre_mlp_norm"]: Rule((p + "post_attention_layernorm.weight",), "copy", REP),
        "mlp.linear_fc1.weight": Rule((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "gate_up", GATE_UP),
        "mlp.linear_fc2.weight": Rule((p + "mlp.down_proj.weight",), "copy", ROW),
    }
    arch = arch_spec(cfg)
    if arch.qk_layernorm:
        rules["self_attention.q_layernorm.weight"] = Rule((p + "self_attn.q_norm.weight",), "copy", REP)
        rules["self_attention.k_layernorm.weight"] = Rule((p + "self_attn.k_norm.weight",), "copy", REP)
    if arch.qkv_bias:
        rules["self_attention.linear_qkv.bias"] = Rule(
            (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"), "qkv", COL
        )
    return rules


def rule_for(global_name: str, cfg, te_names: bool = False) -> Rule:
    """Conversion rule for a megatron name with a *global* layer index."""
    m = _LAYER_RE.match(global_name)
    if m:
        i, suffix = int(m.group(1)), m.group(2)
        rules = layer_rules(cfg, te_names)
        if suffix not in rules:
            raise KeyError(f"no HF mapping for megatron tensor {global_name!r}")
        r = rules[suffix]
        return Rule(tuple(h.format(i=i) for h in r.hf_names), r.fuse, r.split)
    tied = bool(_get(cfg, "tie_word_embeddings", False))
    if global_name == "embedding.word_embeddings.weight":
        return Rule(("model.embed_tokens.weight",), "copy", COL)
    if global_name == "output_layer.weight":
        return Rule(("model.embed_tokens.weight",) if tied else ("lm_head.weight",), "copy", COL)
    if global_name == "decoder.final_layernorm.weight":
        return Rule(("model.norm.weight",), "copy", REP)
    raise KeyError(f"no HF mapping for megatron tensor {global_name!r}")


def expected_local_names(cfg, tp: int, pp: int, pp_rank: int, te_names: bool = False, vpp: int = 1,
                         vp_stage: int = 0) -> List[str]:
    """Megatron (local-index) tensor names held by one stage (one chunk of it with ``vpp > 1``)."""
    L = _get(cfg, "num_hidden_layers")
    per = L // (pp * vpp)
    names = []
    if pp_rank == 0 and vp_stage == 0:
        names.append("embedding.word_embeddings.weight")
    suffixes = list(layer_rules(cfg, te_names))
    for j in range(per):
        names.extend(f"decoder.layers.{j}.{s}" for s in suffixes)
    if pp_rank == pp - 1 and vp_stage == vpp - 1:
        names.append("decoder.final_layernorm.weight")
        tied = bool(_get(cfg, "tie_word_embeddings", False))
        if not tied or pp > 1:
            names.append("output_layer.weight")
    return names


def local_to_global(name: str, layer_offset: int) -> str:
    m = _LAYER_RE.match(name)
    if not m:
        return name
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}"


class TensorReader:
    """Read whole tensors or row/column ranges of named tensors, counting what it reads.

    ``source``: an HF checkpoint directory (safetensors, sharded or not; slices are read with
    ``safe_open(...).get_slice`` so only the requested bytes leave the file), a mapping
    ``name -> tensor``, or a getter ``name -> tensor`` (whole tensors, sliced in memory).
    ``elements_read`` counts the elements returned (tests check a rank reads only its share).
    ``weight_map`` (tensor name -> file under ``source``) replaces the HF index lookup.
    """

    def __init__(self, source, weight_map: Optional[Dict[str, str]] = None):
        self.elements_read = 0
        self._files: Dict[str, str] = {}
        self._handles: Dict[str, object] = {}
        self._path = None
        self._get = None
        if isinstance(source, (str, os.PathLike)):
            self._path = str(source)
            self._files = dict(weight_map) if weight_map is not None else _safetensors_index(self._path)
        elif isinstance(source, Mapping):
            self._get = source.__getitem__
        elif callable(source):
            self._get = source
        else:
            raise TypeError(f"cannot read tensors from {type(source).__name__}")

    def _slice(self, name: str):
        if name not in self._files:
            raise KeyError(f"{name!r} not found in HF checkpoint {self._path!r}")
        fn = self._files[name]
        if fn not in self._handles:
            from safetensors import safe_open

            self._handles[fn] = safe_open(os.path.join(self._path, fn), "pt")
        return self._handles[fn].get_slice(name)

    def shape(self, name: str) -> Tuple[int, ...]:
        if self._get is not None:
            return tuple(self._get(name).shape)
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """The tensor, or its ``[start:stop]`` range along ``dim`` (0 or 1)."""
        if self._get is not None:
            t = self._get(name)
            if dim is not None:
                t = t.narrow(dim, start, (stop if stop is not None else t.shape[dim]) - start)
            t = t.contiguous()
        else:
            sl = self._slice(name)
            if dim is None:
                t = sl[:]
            elif dim == 0:
                t = sl[start:stop]
            elif dim == 1:
                t = sl[:, start:stop]
            else:
                raise ValueError(f"dim must be 0 or 1, got {dim}")
        self.elements_read += t.numel()
        return t


def _safetensors_index(path: str) -> Dict[str, str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ValueError(f"no model.safetensors(.index.json) under {path!r}")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def as_reader(source) -> TensorReader:
    return source if isinstance(source, TensorReader) else TensorReader(source)


def read_split(reader: TensorReader, name: str, split: str, tp: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of one stored tensor: rows (``col``), columns (``row``), the
    whole tensor (``rep``), or for a fused ``[gate; up]`` the rank's rows of each half."""
    if split == REP or tp == 1:
        return reader.read(name)
    shape = reader.shape(name)
    if split == COL:
        n = shape[0] // tp
        return reader.read(name, 0, tp_rank * n, (tp_rank + 1) * n)
    if split == ROW:
        n = shape[1] // tp
        return reader.read(name, 1, tp_rank * n, (tp_rank + 1) * n)
    if split == GATE_UP:
        half = shape[0] // 2
        n = half // tp
        return torch.cat([reader.read(name, 0, tp_rank * n, (tp_rank + 1) * n),
                          reader.read(name, 0, half + tp_rank * n, half + (tp_rank + 1) * n)], 0)
    raise ValueError(split)


def _read_hf_shard(reader: TensorReader, rule: Rule, cfg, tp: int, tp_rank: int) -> torch.Tensor:
    """Rank's shard of one megatron tensor, reading only the HF rows/columns it needs."""
    if rule.fuse == "copy":
        return read_split(reader, rule.hf_names[0], rule.split, tp, tp_rank)
    parts = [read_split(reader, h, COL, tp, tp_rank) for h in rule.hf_names]
    if rule.fuse == "qkv":  # each rank's q heads and kv heads are contiguous row chunks
        return fuse_qkv(*parts, cfg, tp=tp)
    if rule.fuse == "gate_up":
        return torch.cat(parts, 0)
    raise ValueError(rule.fuse)


def hf_to_mcore_local(
    source,
    cfg,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    te_names: bool = False,
    names: Optional[List[str]] = None,
    vpp: int = 1,
    vp_stage: int = 0,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(local_megatron_name, shard)`` for one (tp_rank, pp_rank[, vp_stage]), one tensor at a time.

    ``source``: a :class:`TensorReader` or what it accepts (checkpoint dir, mapping, getter).
    Only the stage's HF tensors are touched, and of each only this rank's rows/columns.
    """
    reader = as_reader(source)
    offset = chunk_layer_offset(_get(cfg, "num_hidden_layers"), pp, pp_rank, vpp, vp_stage)
    if names is None:
        names = expected_local_names(cfg, tp, pp, pp_rank, te_names, vpp, vp_stage)
    for local in names:
        rule = rule_for(local_to_global(local, offset), cfg, te_names)
        yield local, _read_hf_shard(reader, rule, cfg, tp, tp_rank).contiguous()


def hf_to_mcore_shards(hf_sd: Mapping[str, torch.Tensor], cfg, tp: int, pp: int, te_names: bool = False):
    """All shards in memory: ``{(tp_rank, pp_rank): {local_name: tensor}}`` (tests, small models)."""
    return {
        (t, p): dict(hf_to_mcore_local(hf_sd.__getitem__, cfg, tp, t, pp, p, te_names))
        for t in range(tp)
        for p in range(pp)
    }


def _unshard(rule: Rule, shards: List[torch.Tensor]) -> torch.Tensor:
    if rule.split == REP or len(shards) == 1:
        return shards[0]
    if rule.split == COL:
        return torch.cat(shards, 0)
    if rule.split == ROW:
        return torch.cat(shards, 1)
    if rule.split == GATE_UP:
        halves = [s.chunk(2, 0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    raise ValueError(rule.split)


def _unfuse(rule: Rule, full: torch.Tensor, cfg) -> List[Tuple[str, torch.Tensor]]:
    if rule.fuse == "copy":
        return [(rule.hf_names[0], full)]
    if rule.fuse == "qkv":
        return list(zip(rule.hf_names, split_qkv(full, cfg)))
    if rule.fuse == "gate_up":
        gate, up = full.chunk(2, 0)
        return [(rule.hf_names[0], gate.contiguous()), (rule.hf_names[1], up.contiguous())]
    raise ValueError(rule.fuse)


def _skip_on_export(global_name: str, cfg) -> bool:
    # a tied output layer is the embedding; HF stores it once
    return global_name == "output_layer.weight" and bool(_get(cfg, "tie_word_embeddings", False))


def mcore_shards_to_hf(shards, cfg, tp: int, pp: int, te_names: bool = False) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_mcore_shards` (pure function; the collective version is
    :func:`export_hf_weights`)."""
    L = _get(cfg, "num_hidden_layers")
    out: Dict[str, torch.Tensor] = {}
    for p in range(pp):
        for local in shards[(0, p)]:
            g = local_to_global(local, p * (L // pp))
            if _skip_on_export(g, cfg):
                continue
            rule = rule_for(g, cfg, te_names)
            full = _unshard(rule, [shards[(t, p)][local] for t in range(tp)])
            for name, tensor in _unfuse(rule, full, cfg):
                out[name] = tensor
    return out


# ----------------------------------------------------------------------------------------------
# Working on a built model
# ----------------------------------------------------------------------------------------------


def unwrap(model):
    """Strip DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def chunks_of(model) -> List:
    """The model chunks of a rank: a list / ``ModuleList`` of chunks (virtual pipeline), or one model."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


def chunk_offset(chunk) -> int:
    """Global index of the chunk's first decoder layer (megatron's ``layer_number`` is 1-based)."""
    layers = unwrap(chunk).decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def uses_te_names(model) -> bool:
    return any(k.endswith("layer_norm_weight") for c in chunks_of(model) for k, _ in unwrap(c).named_parameters())


def local_tensors(model) -> Dict[str, torch.Tensor]:
    """Tensors of a model stage that carry HF weights (extra state, rotary buffers excluded)."""
    m = unwrap(model)
    out = {}
    for k, v in m.state_dict(keep_vars=True).items():
        if "_extra_state" in k or not isinstance(v, torch.Tensor):
            continue
        out[k] = v
    return out


def load_hf_weights(model, source, cfg) -> int:
    """Copy HF weights into the current rank's model stage (one chunk or a list of chunks);
    returns the number of tensors set.

    ``source``: checkpoint dir, mapping, getter or :class:`TensorReader` (only this rank's
    slices are read). Raises ``ValueError`` when a shape does not match (config/checkpoint mismatch).
    """
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    te = uses_te_names(model)
    reader = as_reader(source)
    n = 0
    with torch.no_grad():
        for chunk in chunks_of(model):
            target = local_tensors(chunk)
            offset = chunk_offset(chunk)
            for name in target:
                rule = rule_for(local_to_global(name, offset), cfg, te)
                shard = _read_hf_shard(reader, rule, cfg, tp, tp_rank).contiguous()
                dst = target[name]
                if tuple(dst.shape) != tuple(shard.shape):
                    raise ValueError(
                        f"shape mismatch for {name}: model {tuple(dst.shape)} vs converted HF {tuple(shard.shape)}"
                    )
                dst.copy_(shard.to(dst.dtype))
                n += 1
    return n


def _export_meta(model, cfg, dtype: Optional[torch.dtype], tp: int, te: bool):
    """This rank's exported tensors (global name -> local tensor, over its chunks) and, in model order,
    ``(global name, full un-sharded shape, dtype on the wire)`` of each."""
    mine: Dict[str, torch.Tensor] = {}
    meta = []
    for chunk in chunks_of(model):
        offset = chunk_offset(chunk)
        for local, t in local_tensors(chunk).items():
            g = local_to_global(local, offset)
            if _skip_on_export(g, cfg):
                continue
            rule = rule_for(g, cfg, te)
            full_shape = list(t.shape)
            if rule.split in (COL, GATE_UP):
                full_shape[0] *= tp
            elif rule.split == ROW:
                full_shape[1] *= tp
            mine[g] = t
            meta.append((g, tuple(full_shape), dtype or t.dtype))
    return mine, meta


def export_hf_weights(model, cfg, dtype: Optional[torch.dtype] = None,
                      dst: Optional[int] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the whole model, one tensor at a time (collective: every TP and PP
    rank of the model-parallel group must iterate it fully).

    ``dst=None``: on every rank. Per tensor: cast to ``dtype`` (if given), all-gather over TP on the owning
    stage, broadcast over PP from that stage, un-fuse QKV and gate/up.
    ``dst=0`` (the weight sync and the HF export, whose only reader is global rank 0): on rank 0 only; the other
    ranks yield nothing. Per tensor: gather over TP to the owning stage's TP rank 0 only, which sends it to
    rank 0 point to point (no copy on the other 2 x (tp x pp - 1) ranks; none at all on rank 0's own stage).
    Peak extra memory: one full (fused) tensor, on the ranks that hold one.
    """
    if dst is not None:
        yield from _export_to_rank0(model, cfg, dtype, dst)
        return
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    te = uses_te_names(model)
    mine, meta = _export_meta(model, cfg, dtype, tp, te)
    if pp > 1:
        gathered: List = [None] * pp
        dist.all_gather_object(gathered, meta, group=pp_group)
    else:
        gathered = [meta]
    for owner, stage_meta in enumerate(gathered):
        for g, full_shape, tdtype in stage_meta:
            rule = rule_for(g, cfg, te)
            if owner == pp_rank:
                shard = mine[g].detach()
                if dtype is not None:  # cast before the gather: half the traffic for bf16 engines
                    shard = shard.to(dtype)
                if tp > 1 and rule.split != REP:
                    parts = [torch.empty_like(shard) for _ in range(tp)]
                    dist.all_gather(parts, shard.contiguous(), group=tp_group)
                    full = _unshard(rule, parts)
                else:
                    full = shard.clone()  # callers own what they receive (no view of a live param)
            else:
                full = torch.empty(full_shape, dtype=tdtype, device=next(iter(mine.values())).device)
            if pp > 1:
                full = full.contiguous()
                dist.broadcast(full, src=dist.get_global_rank(pp_group, owner), group=pp_group)
            for name, tensor in _unfuse(rule, full, cfg):
                yield name, tensor


def save_hf_checkpoint(
    model,
    cfg,
    out_dir: str,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 4 * 1024**3,
    write: Optional[bool] = None,
) -> Optional[List[str]]:
    """Export the model as HF safetensors shards + index (written by global rank 0, atomically).

    Collective over the model-parallel group. The HF config itself is written when ``cfg`` has
    ``save_pretrained``. Returns the file list on the writing rank.
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    to_rank0 = write is None and dist.is_initialized()  # the default writer: the stream reaches rank 0 only
    if write is None:
        write = (not dist.is_initialized()) or dist.get_rank() == 0
    if write:
        os.makedirs(out_dir, exist_ok=True)
    files: List[str] = []
    weight_map: Dict[str, str] = {}
    buf: Dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal buf, size
        if not buf:
            return
        fname = f"model-{len(files) + 1:05d}.safetensors"
        tmp = os.path.join(out_dir, fname + ".tmp")
        save_file(buf, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, fname))
        files.append(fname)
        weight_map.update({k: fname for k in buf})
        buf, size = {}, 0

    for name, tensor in export_hf_weights(model, cfg, dtype, dst=0 if to_rank0 else None):
        if not write:
            continue
        buf[name] = tensor.detach().to("cpu").clone()
        size += tensor.numel() * tensor.element_size()
        if size >= max_shard_bytes:
            flush()
    if not write:
        return None
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    tmp = os.path.join(out_dir, "model.safetensors.index.json.tmp")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "model.safetensors.index.json"))
    if hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(out_dir)
    return files


def _export_to_rank0(model, cfg, dtype: Optional[torch.dtype], dst: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """:func:`export_hf_weights` with ``dst``: full tensors reach global rank ``dst`` (0) only."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dst != 0:
        raise ValueError(f"export_hf_weights(dst={dst}): only global rank 0 (TP rank 0 of the first stage) receives")
    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if ps.get_data_parallel_rank() != 0:  # the first replica holds the weights rank 0 reads
        return
    receiver = dist.get_rank() == 0
    te = uses_te_names(model)
    mine, meta = _export_meta(model, cfg, dtype, tp, te)
    if pp > 1:
        stages: List = [None] * pp
        dist.all_gather_object(stages, meta, group=pp_group)
    else:
        stages = [meta]
    device = next(iter(mine.values())).device
    for owner, stage_meta in enumerate(stages):
        for g, full_shape, tdtype in stage_meta:
            rule = rule_for(g, cfg, te)
            full = None
            if owner == pp_rank:
                shard = mine[g].detach()
                if dtype is not None:  # cast before the gather: half the traffic for bf16 engines
                    shard = shard.to(dtype)
                if tp > 1 and rule.split != REP:
                    parts = [torch.empty_like(shard) for _ in range(tp)] if tp_rank == 0 else None
                    dist.gather(shard.contiguous(), gather_list=parts, dst=dist.get_global_rank(tp_group, 0),
                                group=tp_group)
                    full = _unshard(rule, parts) if tp_rank == 0 else None
                elif tp_rank == 0:
                    full = shard.clone()  # callers own what they receive (no view of a live param)
            if owner != 0 and tp_rank == 0:  # the owning stage's TP rank 0 -> rank 0, over rank 0's PP group
                if receiver:
                    full = torch.empty(full_shape, dtype=tdtype, device=device)
                    dist.recv(full, src=dist.get_global_rank(pp_group, owner), group=pp_group)
                elif owner == pp_rank:
                    dist.send(full.contiguous(), dst=dist.get_global_rank(pp_group, 0), group=pp_group)
            if receiver:
                for name, tensor in _unfuse(rule, full, cfg):
                    yield name, tensor


def hf_tensor_getter(path: str) -> Callable[[str], torch.Tensor]:
    """Lazy whole-tensor getter over an HF checkpoint directory (safetensors, sharded or not)."""
    return TensorReader(path).read
