"""Layout-free checkpoints of the Megatron actor: resume in any TP / PP / VPP / DP layout, no pickle.

Directory ``root`` (OpenRLHF's ``ckpt.path/_actor``)::

    global_stepN/
        meta.json                     format, step, optimizer step, layout written in, model dims
        client_state.pt               trainer state (read back with ``torch.load(weights_only=True)``)
        stagePP-tpTT.json             tensor name -> file, for the tensors TP rank TT of stage PP wrote
        stagePP-tpTT-NNNNN.safetensors  "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"
    latest                            "global_stepN"; replaced atomically once the directory is whole

Tensors are stored **un-sharded** under megatron's global names (fused QKV group-interleaved,
``linear_fc1 = [gate; up]``, global layer indices) in fp32: the optimizer's main parameters and Adam
moments. The TP ranks of the first DP replica take turns writing them (tensor i by TP rank i % tp,
the writer): the distributed optimizer's ranges are reduced to the first replica only and the TP shards
gathered to the writer only, so one rank holds one full fp32 tensor at a time and the others none.
The waits around the writes (all writers done, rank 0's rename and pruning, the HF export) are barriers
on a gloo group of their own with ``--megatron.save_timeout_minutes`` (default 360), not on the
training groups, whose NCCL watchdog (``--megatron.timeout_minutes``, 60) a slow filesystem could trip. Loading
reads through :func:`convert.read_split` only the rows/columns a rank owns in the *current*
layout, so a checkpoint written at TP2 resumes at TP1, PP2 at TP2, PP2 x VPP2 at VPP1, with or
without the distributed optimizer (tests/megatron: TP2 -> TP1, PP2 -> TP2 and VPP2 -> VPP1 continue
the uninterrupted run).

Safety: safetensors and JSON hold no code; ``client_state.pt`` is loaded with ``weights_only=True``.
Crash safety: everything is written into ``<tag>.partial/``, renamed to ``<tag>/`` when complete,
and only then ``latest`` is replaced; a crash mid-save leaves the previous checkpoint and ``latest``
untouched. ``max_num`` / ``max_mem_gb`` (``--ckpt.max_num`` / ``--ckpt.max_mem``) prune the oldest
``global_step*`` directories after ``latest`` moved.

Reading from host memory: :func:`save` reads every optimizer tensor through ``read`` (default: the tensor
itself). The colocated actor, asleep at its save, passes ``SleepMixin.host_view``, which returns the tensor where
it lies in host memory, so the optimizer state never comes back to the device for a save: what the save holds on
the device is its transients on the writing rank, one parameter at a time (the fp32 shard, its copy from the
host, the TP gather and the unsharded tensor: ``colocation_memory.save_transient_bytes``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from openrlhf_lpo.megatron import convert
from openrlhf_lpo.megatron.device import group_device
from openrlhf_lpo.megatron.model import _get

FORMAT = "openrlhf-lpo/megatron-checkpoint/1"
STATE_KEYS = ("exp_avg", "exp_avg_sq")  # Adam moments (torch AdamW, TE / apex FusedAdam)
_STEP_DIR = re.compile(r"^global_step(\d+)$")
_MAX_FILE_BYTES = 2 * 1024**3
_MODEL_DIMS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "tie_word_embeddings")


# ----------------------------------------------------------------------------- optimizer view


class _MainState:
    """Where the fp32 main copy and Adam moments of one model parameter live on this rank."""

    def __init__(self, torch_opt, main: Optional[torch.Tensor], state: Optional[dict], flat_range, dp_group):
        self.torch_opt = torch_opt
        self.main = main  # None when this DP rank owns no element of the parameter
        self.state = state
        self.flat_range = flat_range  # (start, end) in the flattened parameter, distributed optimizer only
        self.dp_group = dp_group


def _megatron_optimizers(optimizer) -> List:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_states(optimizer, params: List[torch.nn.Parameter]) -> Dict[int, _MainState]:
    """model parameter id -> :class:`_MainState` for every inner megatron optimizer kind."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out: Dict[int, _MainState] = {}
    for o in _megatron_optimizers(optimizer):
        torch_opt = o.optimizer
        if isinstance(o, DistributedOptimizer):
            # 0.16.1 maps only the parameters with elements in this DP rank's shard
            for p in params:
                if p in o.model_param_gbuf_map:
                    gbuf_index, dtype, bucket_index = o.model_param_gbuf_map[p]
                    pmap = o.gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"]
                    if p in pmap:
                        r = pmap[p]["param"]
                        group_index, order = o.model_param_group_index_map[p]
                        main = torch_opt.param_groups[group_index]["params"][order]
                        out[id(p)] = _MainState(torch_opt, main, torch_opt.state[main], (r.start, r.end),
                                                o.data_parallel_group)
                        continue
                # this DP rank owns no element of p: it still joins the gather over the DP group
                out.setdefault(id(p), _MainState(torch_opt, None, None, None, o.data_parallel_group))
            continue
        owned = {id(q) for g in torch_opt.param_groups for q in g["params"]}
        for p in params:
            main = getattr(p, "main_param", None)
            if main is None or id(main) not in owned:
                main = p if id(p) in owned else None
            if main is not None:
                out[id(p)] = _MainState(torch_opt, main, torch_opt.state[main], None, None)
    missing = [p for p in params if id(p) not in out]
    if missing:
        raise RuntimeError(f"{len(missing)} model parameters have no optimizer main copy (frozen parameters?)")
    return out


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _optimizer_step(optimizer, read=_identity) -> int:
    for o in _megatron_optimizers(optimizer):
        for group in o.optimizer.param_groups:
            if "step" in group:
                return int(read(group["step"]) if isinstance(group["step"], torch.Tensor) else group["step"])
            for p in group["params"]:
                st = o.optimizer.state.get(p, {})
                if "step" in st:
                    return int(read(st["step"]) if isinstance(st["step"], torch.Tensor) else st["step"])
    return 0


def _ensure_states(optimizer) -> None:
    """Create Adam state for every main parameter (a zero-gradient step), so loads can copy into it."""
    for o in _megatron_optimizers(optimizer):
        opt = o.optimizer
        params = [p for g in opt.param_groups for p in g["params"] if p.numel() > 0]
        if all(all(k in opt.state.get(p, {}) for k in STATE_KEYS) for p in params):
            continue
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in params:
            p.grad = None


def _set_step(optimizer, step: int) -> None:
    for o in _megatron_optimizers(optimizer):
        for group in o.optimizer.param_groups:
            if "step" in group:
                group["step"] = step
            for p in group["params"]:
                st = o.optimizer.state.get(p)
                if st and "step" in st:
                    if isinstance(st["step"], torch.Tensor):
                        st["step"].fill_(step)
                    else:
                        st["step"] = step


# ----------------------------------------------------------------------------- names


def _stage_params(actor) -> List[Tuple[str, str, torch.nn.Parameter]]:
    """(local name, global name, parameter) of this rank's stage (all its virtual-pipeline
    chunks), in model order."""
    out = []
    for chunk in convert.chunks_of(actor.model):
        offset = convert.chunk_offset(chunk)
        out.extend((n, convert.local_to_global(n, offset), p) for n, p in convert.unwrap(chunk).named_parameters())
    return out


def _ckpt_name(key: str, global_name: str) -> str:
    return f"{key}/{global_name}"


# ----------------------------------------------------------------------------- save


def _gather_full(actor, st: _MainState, which: str, p: torch.nn.Parameter, rule, writer: int,
                 read=_identity) -> Optional[torch.Tensor]:
    """The full fp32 tensor of ``which`` ("param" or a state key) of ``p`` on TP rank ``writer`` of the first
    DP replica; None on every other rank, which only sends its part (collective over the TP and DP groups).
    The rank's own part is read through ``read`` (module docstring)."""
    ps = actor.ps
    if st.dp_group is not None:  # distributed optimizer: each DP rank owns a range of the flat param
        dev = group_device(st.dp_group)
        flat = torch.zeros(p.numel(), dtype=torch.float32, device=dev)
        if st.main is not None:
            src = read(st.main if which == "param" else st.state[which])
            flat[st.flat_range[0] : st.flat_range[1]] = src.detach().reshape(-1).to(dev, torch.float32)
        if dist.get_world_size(st.dp_group) > 1:  # the first replica sums the ranges (each owned once)
            dist.reduce(flat, dst=dist.get_global_rank(st.dp_group, 0), group=st.dp_group)
            if dist.get_rank(st.dp_group) != 0:
                return None
        shard = flat.view(p.shape)
    else:
        if ps.get_data_parallel_rank() != 0:  # the replicas hold the same state: the first one writes
            return None
        src = read(st.main if which == "param" else st.state[which])
        shard = src.detach().to(torch.float32).view(p.shape)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if tp > 1 and rule.split != convert.REP:
        group = ps.get_tensor_model_parallel_group()
        dev = group_device(group)
        parts = [torch.empty(shard.shape, dtype=torch.float32, device=dev) for _ in range(tp)] \
            if tp_rank == writer else None
        dist.gather(shard.to(dev).contiguous(), gather_list=parts, dst=dist.get_global_rank(group, writer), group=group)
        return convert._unshard(rule, parts) if tp_rank == writer else None
    return shard if tp_rank == writer else None


_SAVE_GROUPS: Dict[Tuple[int, int], object] = {}


def save_barrier(timeout_minutes: float) -> None:
    """A barrier of the whole world on a gloo group with ``timeout_minutes`` (made on first use, collectively),
    for the waits around checkpoint and HF writes: the training groups' watchdog never sees them."""
    key = (dist.get_world_size(), int(timeout_minutes * 60))
    if key not in _SAVE_GROUPS:
        _SAVE_GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))
    dist.barrier(group=_SAVE_GROUPS[key])


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(actor, root: str, tag: str, client_state: dict, max_num: Optional[int] = None,
         max_mem_gb: Optional[float] = None, read=_identity) -> str:
    """Write ``root/tag`` (collective over the world); returns its path. ``read``: where each optimizer tensor is
    read from (module docstring)."""
    from safetensors.torch import save_file

    if not _STEP_DIR.match(tag):
        raise ValueError(f"checkpoint tag {tag!r} must look like global_step<N>")
    ps = actor.ps
    rank = dist.get_rank()
    save_timeout = float(getattr(actor.cfg, "save_timeout_minutes", 360))
    final = os.path.join(root, tag)
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    params = _stage_params(actor)
    states = _main_states(actor.optimizer, [p for _, _, p in params])
    opt_step = _optimizer_step(actor.optimizer, read)
    keys = ("param",) + (STATE_KEYS if opt_step > 0 else ())
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    first_replica = ps.get_data_parallel_rank() == 0
    stage = ps.get_pipeline_model_parallel_rank()
    prefix = f"stage{stage:02d}-tp{tp_rank:02d}"
    te = convert.uses_te_names(actor.model)
    weight_map: Dict[str, str] = {}
    buf: Dict[str, torch.Tensor] = {}
    size = [0, 0]  # bytes buffered, files written

    def flush():
        if not buf:
            return
        size[1] += 1
        fname = f"{prefix}-{size[1]:05d}.safetensors"
        save_file(buf, os.path.join(partial, fname), metadata={"format": FORMAT})
        weight_map.update({k: fname for k in buf})
        buf.clear()
        size[0] = 0

    for i, (_, g, p) in enumerate(params):
        rule = convert.rule_for(g, actor.hf_config, te)
        for key in keys:
            full = _gather_full(actor, states[id(p)], key, p, rule, writer=i % tp, read=read)  # None but the writer
            if full is not None:  # a copy: a host-memory read must not alias the host pool in the buffer
                buf[_ckpt_name(key, g)] = full.detach().to("cpu", copy=True).contiguous()
                size[0] += full.numel() * 4
                if size[0] >= _MAX_FILE_BYTES:
                    flush()
    if first_replica:
        flush()
        with open(os.path.join(partial, f"{prefix}.json"), "w") as f:
            json.dump({"weight_map": weight_map}, f)
    save_barrier(save_timeout)  # every writer done
    if rank == 0:
        meta = {
            "format": FORMAT,
            "tag": tag,
            "step": int(actor.step),
            "optimizer_step": opt_step,
            "state_keys": list(keys[1:]),
            "layout": {"tp": ps.get_tensor_model_parallel_world_size(),
                       "pp": ps.get_pipeline_model_parallel_world_size(),
                       "vpp": int(getattr(actor.cfg, "vpp", 1)),
                       "dp": ps.get_data_parallel_world_size(),
                       "distributed_optimizer": bool(actor.cfg.use_distributed_optimizer),
                       "params_dtype": actor.cfg.params_dtype},
            "model": {k: _get(actor.hf_config, k) for k in _MODEL_DIMS},
            "stages": [f"stage{s:02d}-tp{t:02d}.json" for s in range(ps.get_pipeline_model_parallel_world_size())
                       for t in range(ps.get_tensor_model_parallel_world_size())],
        }
        with open(os.path.join(partial, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        torch.save(client_state, os.path.join(partial, "client_state.pt"))
        if os.path.exists(final):  # re-saving a step: the old copy goes only after the new one is whole
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        _write_text(os.path.join(root, "latest"), tag)
        prune(root, keep=tag, max_num=max_num, max_mem_gb=max_mem_gb)
    save_barrier(save_timeout)  # rank 0 renamed and pruned
    return final


def step_dirs(root: str) -> List[Tuple[int, str]]:
    """(step, name) of the complete ``global_step*`` directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, "meta.json")):
            out.append((int(m.group(1)), name))
    return sorted(out)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def prune(root: str, keep: str, max_num: Optional[int] = None, max_mem_gb: Optional[float] = None) -> List[str]:
    """Delete the oldest checkpoints beyond ``max_num`` or ``max_mem_gb`` (never ``keep``)."""
    dirs = [name for _, name in step_dirs(root)]
    removed = []
    while len(dirs) > 1:
        too_many = max_num is not None and max_num > 0 and len(dirs) > max_num
        too_big = (max_mem_gb is not None and max_mem_gb != float("inf")
                   and sum(_dir_bytes(os.path.join(root, d)) for d in dirs) > max_mem_gb * 1024**3)
        if not (too_many or too_big):
            break
        victim = next((d for d in dirs if d != keep), None)
        if victim is None:
            break
        shutil.rmtree(os.path.join(root, victim), ignore_errors=True)
        dirs.remove(victim)
        removed.append(victim)
    return removed


# ----------------------------------------------------------------------------- load


def latest_tag(root: str) -> Optional[str]:
    path = os.path.join(root, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _check_model(meta: dict, hf_config, path: str) -> None:
    for k, v in meta.get("model", {}).items():
        mine = _get(hf_config, k)
        if k == "tie_word_embeddings":
            v, mine = bool(v), bool(mine)
        if v != mine:
            raise ValueError(f"checkpoint {path!r} was written for {k}={v}, the model has {k}={mine}")


def load(actor, root: str, tag: Optional[str] = None) -> dict:
    """Load ``root/tag`` (default: the one ``latest`` names) into this rank's layout; returns client_state."""
    tag = tag or latest_tag(root)
    if tag is None:
        raise ValueError(f"no complete Megatron checkpoint in {root!r} (missing 'latest')")
    path = os.path.join(root, tag)
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"{path!r} is not a complete Megatron checkpoint (no meta.json)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path!r}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    _check_model(meta, actor.hf_config, path)
    weight_map: Dict[str, str] = {}
    for stage_file in meta["stages"]:
        with open(os.path.join(path, stage_file)) as f:
            weight_map.update(json.load(f)["weight_map"])
    reader = convert.TensorReader(path, weight_map=weight_map)
    ps = actor.ps
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    tied = bool(_get(actor.hf_config, "tie_word_embeddings", False))
    te = convert.uses_te_names(actor.model)
    params = _stage_params(actor)
    keys = ["param"] + list(meta.get("state_keys", []))
    if len(keys) > 1:
        _ensure_states(actor.optimizer)
    states = _main_states(actor.optimizer, [p for _, _, p in params])
    with torch.no_grad():
        for _, g, p in params:
            rule = convert.rule_for(g, actor.hf_config, te)
            src = g
            if _ckpt_name("param", g) not in weight_map and g == "output_layer.weight" and tied:
                src = "embedding.word_embeddings.weight"  # written at PP1: the tied copy is the embedding
            st = states[id(p)]
            for key in keys:
                shard = convert.read_split(reader, _ckpt_name(key, src), rule.split, tp, tp_rank)
                if tuple(shard.shape) != tuple(p.shape):
                    raise ValueError(f"{path!r}: {key} of {g} has shape {tuple(shard.shape)} in this layout, "
                                     f"the model expects {tuple(p.shape)}")
                if key == "param":
                    p.copy_(shard.to(p.dtype))
                if st.main is None:
                    continue
                part = shard.reshape(-1)[st.flat_range[0] : st.flat_range[1]] if st.flat_range else shard
                dst = st.main if key == "param" else st.state[key]
                if dst is not p:
                    dst.copy_(part.reshape(dst.shape).to(dst.dtype))
    _set_step(actor.optimizer, int(meta["optimizer_step"]))
    actor.step = int(meta["step"])
    client = load_client_state(os.path.join(path, "client_state.pt"))
    dist.barrier()
    return client


def load_client_state(path: str):
    """``torch.load(weights_only=True)``: tensors and plain containers only, never arbitrary objects."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the restricted unpickler names what it refused
        raise ValueError(f"{path} holds objects other than tensors and plain containers "
                         f"(refused without unpickling them): {str(e).splitlines()[0]}") from None
