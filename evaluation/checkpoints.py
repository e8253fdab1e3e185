"""Checkpoints: what ``--ckpts`` names, and a readable run name and training step for each.

``--ckpts`` takes, comma-separated or as several arguments:

* a model directory (``config.json`` + weights);
* a glob (``'runs/*/ckpt/global_step*_hf'``);
* a run directory: every model directory below it (up to 4 levels) is evaluated;
* a Hugging Face model id ``org/name[@revision]`` when no such local path exists: read from the local
  HF cache (``HF_HUB_CACHE``), downloaded first when the hub is reachable; offline and not cached is a
  clear error, never a hang.

Layouts understood for the run name and step (the step is the last path component naming one):

======================================  ==================  ========
path                                    run                 step
======================================  ==================  ========
``<run>/ckpt/global_step20_hf``         (OpenRLHF / ours)   20
``<run>/ckpt/best_global_step20_hf``    (OpenRLHF best)     20
``<run>/global_step_20/actor/huggingface``  (verl)          20
``<run>/checkpoints/iter_0000020/hf``   (Megatron-LM)       20
``<run>/checkpoint-20``                 (HF Trainer)        20
======================================  ==================  ========

The run is the nearest directory above the step directory whose name is not a generic container
(``ckpt``, ``checkpoints``, ``_actor``, ``hf``, ...). A raw Megatron or DeepSpeed checkpoint (sharded
``mp_rank_*`` / ``*.distcp`` files, no ``config.json``) cannot be served by vLLM or transformers: the
error says to save HF weights (``--ckpt.save_hf``).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .io import sha256_text

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
GENERIC_DIRS = {
    "ckpt", "ckpts", "checkpoint", "checkpoints", "_actor", "actor", "hf", "huggingface", "hf_model",
    "hf_ckpt", "model", "models", "policy", "output", "outputs", "saved", "release", "latest", "torch",
}
_STEP_RE = re.compile(r"(?:global_step|checkpoint|iter|step)[_-]?(\d+)", re.IGNORECASE)
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(?:@[\w./-]+)?$")
# files whose content enters the checkpoint id; the processor files of a vision-language checkpoint (pixel
# limits: how many tokens an image becomes) change its outputs on image benchmarks
_ID_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.json",
             "processor_config.json", "preprocessor_config.json", "chat_template.json")
SEARCH_DEPTH = 4


@dataclass(frozen=True)
class Checkpoint:
    """A resolved checkpoint: ``path`` is a local model directory; ``source`` what the user wrote."""

    path: str
    source: str
    run: str
    step: int | None
    label: str
    hub_id: str | None = None


class BadCheckpoint(ValueError):
    """A checkpoint that cannot be evaluated (the message says why and what to do)."""


def is_model_dir(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json"))


def has_weights(path: str | os.PathLike) -> bool:
    p = Path(path)
    return any(f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name.endswith(".index.json")) for f in p.iterdir())


def _looks_like_sharded_training_ckpt(path: Path) -> bool:
    if (path / "latest_checkpointed_iteration.txt").exists() or (path / "latest").is_file():
        return True
    for sub in list(path.iterdir())[:200]:
        if sub.name.startswith("mp_rank_") or sub.suffix == ".distcp" or sub.name.endswith("_model_states.pt"):
            return True
        if sub.is_dir() and any(x.name.startswith("mp_rank_") or x.suffix == ".distcp" for x in list(sub.iterdir())[:200]):
            return True
    return False


def parse_step(path: str) -> int | None:
    """Training step from the last path component that names one (``global_step20_hf``, ``iter_0000020``...)."""
    for part in reversed(Path(path).parts):
        m = _STEP_RE.search(part)
        if m:
            return int(m.group(1))
    return None


def run_and_label(path: str) -> tuple[str, int | None, str]:
    """``(run name, step, label)`` of a local checkpoint path, e.g. ``("lpo_fwd", 20, "lpo_fwd__global_step20_hf")``."""
    parts = [p for p in Path(os.path.abspath(path)).parts if p not in ("/", "")]
    leaf = parts[-1] if parts else "model"
    step_at = next((i for i in range(len(parts) - 1, -1, -1) if _STEP_RE.search(parts[i])), None)
    if step_at is None:  # a model without a training step (a base or downloaded model): it is its own run
        label = re.sub(r"[^A-Za-z0-9._-]+", "_", leaf)[-80:]
        return leaf, None, label
    run = next((p for p in reversed(parts[:step_at]) if p.lower() not in GENERIC_DIRS and not _STEP_RE.search(p)), "")
    step_dir = parts[step_at]
    label = f"{run}__{step_dir}" if run else step_dir
    return run or step_dir, int(_STEP_RE.search(step_dir).group(1)), re.sub(r"[^A-Za-z0-9._-]+", "_", label)[-80:]


FINGERPRINT_BLOCK = 1 << 16  # bytes read at each of FINGERPRINT_BLOCKS offsets of a weight file
FINGERPRINT_BLOCKS = 32


def weights_fingerprint(path: Path) -> str:
    """sha256 of a weight file's size and of 64 KiB blocks at 32 evenly spaced offsets (the first holds a
    safetensors header, the last the end of the file): about 2 MiB read per file, whatever its size.

    A re-saved checkpoint changes nearly every byte of its weights, so it changes the fingerprint even
    when its size and modification time are the same (a copy that keeps times, a clock of coarse grain).
    """
    import hashlib

    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    last = max(0, size - FINGERPRINT_BLOCK)
    offsets = sorted({last * i // (FINGERPRINT_BLOCKS - 1) for i in range(FINGERPRINT_BLOCKS)})
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            h.update(f.read(FINGERPRINT_BLOCK))
    return h.hexdigest()[:16]


def checkpoint_id(ckpt: Checkpoint | str) -> str:
    """Readable, content-aware id: the label + a hash of the path, configs and weight files.

    Weight files enter by name, size, mtime and a fingerprint of their content
    (:func:`weights_fingerprint`), so a checkpoint re-saved in the same folder gets a new id.
    """
    if isinstance(ckpt, str):
        ckpt = local_checkpoint(ckpt)
    p = Path(ckpt.path).resolve()
    h = [str(p)]
    for name in _ID_FILES:
        f = p / name
        if f.exists():
            h.append(name + ":" + sha256_text(f.read_text(encoding="utf-8", errors="replace")))
    for f in sorted(p.iterdir()):
        if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name.endswith(".index.json")):
            st = f.stat()
            h.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{weights_fingerprint(f)}")
    return f"{ckpt.label}-{sha256_text(chr(10).join(h))[:8]}"


def local_checkpoint(path: str, source: str | None = None) -> Checkpoint:
    run, step, label = run_and_label(path)
    return Checkpoint(str(path), source or str(path), run, step, label)


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _models_below(root: str) -> list[str]:
    found = []
    base = root.rstrip(os.sep).count(os.sep)
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if dirpath.count(os.sep) - base >= SEARCH_DEPTH:
            dirnames[:] = []
        if is_model_dir(dirpath):
            found.append(dirpath)
            dirnames[:] = []  # a model directory's subfolders are not other checkpoints
    return sorted(found, key=_natural_key)


def _no_model_message(path: str) -> str:
    p = Path(path)
    if p.is_dir() and _looks_like_sharded_training_ckpt(p):
        return (f"--ckpts {path!r} is a sharded training checkpoint (Megatron/DeepSpeed), which vLLM and "
                "transformers cannot load: save Hugging Face weights with --ckpt.save_hf (written to "
                "<ckpt.path>/global_step<N>_hf) and pass those")
    return f"--ckpts {path!r} is not a model directory (no config.json in it or below it)"


def _hub_checkpoint(spec: str) -> Checkpoint:
    repo, _, revision = spec.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers always brings huggingface_hub
        raise BadCheckpoint(f"--ckpts {spec!r}: reading Hugging Face model ids needs huggingface_hub") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(repo, revision=revision or None, local_files_only=True)
    except LocalEntryNotFoundError:
        if offline:
            raise BadCheckpoint(
                f"--ckpts {spec!r} is neither a local directory nor in the Hugging Face cache, and HF_HUB_OFFLINE "
                f"is set: download it first (`huggingface-cli download {repo}`) or pass a local folder"
            ) from None
        try:
            path = snapshot_download(repo, revision=revision or None,
                                     allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"])
        except Exception as e:
            raise BadCheckpoint(
                f"--ckpts {spec!r}: no such local directory, and downloading it from the Hugging Face hub failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check the name and the network, "
                "or set HF_HUB_OFFLINE=1 to use only the local cache"
            ) from None
    except Exception as e:
        raise BadCheckpoint(f"--ckpts {spec!r}: {type(e).__name__}: {e}") from None
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", repo.replace("/", "__"))
    return Checkpoint(str(path), spec, label, None, label, hub_id=spec)


def resolve_checkpoints(specs: list[str]) -> tuple[list[Checkpoint], list[tuple[str, str]]]:
    """``(checkpoints, bad)`` for ``--ckpts`` values; ``bad`` holds ``(path, reason)`` of model directories
    that cannot be evaluated (no weights), so the others still run.

    Raises ValueError when a value matches nothing at all (a typo should fail before any GPU work).
    """
    out: list[Checkpoint] = []
    bad: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(path: str, source: str) -> None:
        key = os.path.realpath(path)
        if key in seen:
            return
        seen.add(key)
        if not has_weights(path):
            bad.append((path, "no weight files (*.safetensors, *.bin): still being written, or a training "
                              "checkpoint without Hugging Face weights (save them with --ckpt.save_hf)"))
            return
        out.append(local_checkpoint(path, source))

    for spec in specs:
        for part in [p.strip() for p in spec.split(",") if p.strip()]:
            expanded = os.path.expanduser(part)
            if glob.has_magic(expanded):
                matches = sorted(glob.glob(expanded), key=_natural_key)
                if not matches:
                    raise ValueError(f"--ckpts pattern {part!r} matched nothing")
                models = [m for x in matches if os.path.isdir(x) for m in ([x] if is_model_dir(x) else _models_below(x))]
                if not models:
                    raise ValueError(f"--ckpts pattern {part!r} matched no model directory (a directory with config.json)")
                for m in models:
                    add(m, part)
            elif os.path.isdir(expanded):
                models = [expanded] if is_model_dir(expanded) else _models_below(expanded)
                if not models:
                    raise ValueError(_no_model_message(expanded))
                for m in models:
                    add(m, part)
            elif os.path.exists(expanded):
                raise ValueError(f"--ckpts {part!r} is a file; pass the model directory that holds config.json")
            elif _HUB_ID_RE.match(part) and not part.startswith((".", "~")):
                ck = _hub_checkpoint(part)
                if os.path.realpath(ck.path) in seen:
                    continue
                seen.add(os.path.realpath(ck.path))
                if has_weights(ck.path):
                    out.append(ck)
                else:
                    bad.append((part, "the cached snapshot has no *.safetensors weights (only safetensors are "
                                      "downloaded): download the model yourself and pass its folder"))
            else:
                raise ValueError(f"--ckpts {part!r} is not a model directory (no such directory)")
    if not out and not bad:
        raise ValueError(f"--ckpts {specs!r} matched no model directory (a directory with config.json)")
    return out, bad
