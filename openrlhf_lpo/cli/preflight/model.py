"""Preflight check ``model``: ``--actor.model_name_or_path`` holds what the actors and engines will load.

* a local folder exists and holds ``config.json`` (valid JSON), weight files (safetensors for
  ``--backend megatron``) and tokenizer files, and the tokenizer loads (without running code shipped
  with the model: a tokenizer that needs it is skipped with a note);
* ``--data.apply_chat_template`` needs a chat template (tokenizer or processor);
* ``--data.max_len`` is vLLM's ``max_model_len``: it must fit the model's positions
  (``max_position_embeddings``, times a linear/dynamic/yarn RoPE factor) unless
  ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``;
* anything else is a Hugging Face hub id: its local cache is used when it holds the config (the checks
  above then run on the snapshot); otherwise a real launch with ``HF_HUB_OFFLINE=1`` fails here, and a
  dry run or an online launch says that the tokenizer checks are skipped.

Facts for later checks: ``ctx.model`` (:class:`ModelFacts`: folder, config, tokenizer, parameters).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from openrlhf_lpo.cli.preflight import PreflightError, looks_like_path, register_check
from openrlhf_lpo.core.training_backends import backend_of

FLAG = "--actor.model_name_or_path"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
ROPE_FACTOR_TYPES = ("linear", "dynamic", "yarn")


@dataclass
class ModelFacts:
    name: str
    path: Optional[str] = None        # local folder (or the hub cache snapshot)
    hub_id: Optional[str] = None
    config: Optional[dict] = None
    tokenizer: Any = None
    params: Optional[int] = None

    @property
    def vlm(self) -> bool:
        return bool(self.config) and "vision_config" in self.config

    @property
    def text_config(self) -> dict:
        cfg = self.config or {}
        return cfg.get("text_config") or cfg


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def _cached_snapshot(name: str) -> Optional[str]:
    """The hub cache folder that holds ``name``'s config.json, without any network access."""
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.utils import HFValidationError
    except ImportError:  # pragma: no cover - transformers brings huggingface_hub
        return None
    try:
        path = try_to_load_from_cache(name, "config.json")
    except HFValidationError:
        raise PreflightError(f"{FLAG} {name!r}: no such local folder, and not a valid Hugging Face model id "
                             "(org/name); pass the folder that holds config.json") from None
    return os.path.dirname(path) if isinstance(path, str) else None


def _resolve(ctx, name: str) -> ModelFacts:
    if os.path.isdir(name):
        return ModelFacts(name, path=name)
    if os.path.exists(name):
        raise PreflightError(f"{FLAG} {name}: is a file; pass the model folder that holds config.json")
    if looks_like_path(name):
        raise PreflightError(f"{FLAG} {name}: no such directory (a local model folder: check the path, or build "
                             "/download the model first)")
    snapshot = _cached_snapshot(name)
    if snapshot is not None:
        return ModelFacts(name, path=snapshot, hub_id=name)
    backend = backend_of(ctx.args)
    if _offline() and not ctx.dry_run:
        raise PreflightError(
            f"{FLAG} {name}: not a local folder and not in the local Hugging Face cache, and HF_HUB_OFFLINE=1: "
            f"the actors cannot load it. Download it first (`huggingface-cli download {name}`) or pass a local folder")
    where = "HF_HUB_OFFLINE=1 here" if _offline() else "the actors download it at start"
    ctx.say(f"model: {name} is a hub id not in the local cache ({where}): tokenizer, chat-template, positions "
            "and disk checks skipped" + ("" if not backend.reads_model_config else f"; --backend {backend.name} reads "
                                         "its config even in a dry run: download it or pass a local folder"))
    return ModelFacts(name, hub_id=name)


def _config(facts: ModelFacts) -> dict:
    path = os.path.join(facts.path, "config.json")
    if not os.path.isfile(path):
        raise PreflightError(f"{FLAG} {facts.name}: {facts.path} holds no config.json (not a Hugging Face model "
                             "folder; a training checkpoint needs --ckpt.save_hf weights)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as e:
        raise PreflightError(f"{FLAG} {facts.name}: {path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise PreflightError(f"{FLAG} {facts.name}: {path} must hold a JSON object")
    return config


def _check_files(ctx, facts: ModelFacts) -> bool:
    """Weights and tokenizer files are there (False: a hub snapshot without the tokenizer yet)."""
    names = os.listdir(facts.path)
    weights = [n for n in names if n.endswith(WEIGHT_SUFFIXES) or n.endswith(".index.json")]
    if not weights:
        if facts.hub_id:
            ctx.say(f"model: the cached snapshot of {facts.hub_id} has no weight files yet (the actors download them)")
        else:
            raise PreflightError(f"{FLAG} {facts.name}: holds no weight files (*.safetensors or *.bin); it has "
                                 f"{', '.join(sorted(names)[:12]) or 'nothing'}")
    backend = backend_of(ctx.args)
    if weights and backend.safetensors_only and not any(n.startswith("model.safetensors") for n in weights):
        raise PreflightError(f"{FLAG} {facts.name}: --backend {backend.name} reads model.safetensors(.index.json) "
                             "only; convert the .bin weights (save_pretrained(..., safe_serialization=True))")
    if not any(n in names for n in TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in names):
        if facts.hub_id:
            ctx.say(f"model: the cached snapshot of {facts.hub_id} has no tokenizer files yet: tokens not counted")
            return False
        raise PreflightError(f"{FLAG} {facts.name}: holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                             "copy the base model's tokenizer into the folder")
    return True


def _load_tokenizer(ctx, facts: ModelFacts):
    from transformers import AutoTokenizer

    use_fast = not getattr(ctx.args.data, "disable_fast_tokenizer", False)
    try:
        return AutoTokenizer.from_pretrained(facts.path, trust_remote_code=False, use_fast=use_fast)
    except Exception as e:  # noqa: BLE001 - any loader failure is reported with the folder
        text = str(e)
        if "trust_remote_code" in text or "custom code" in text:
            ctx.say(f"model: the tokenizer of {facts.name} runs code shipped with the model; preflight does not run "
                    "it, so prompt tokens are not counted")
            return None
        raise PreflightError(f"{FLAG} {facts.name}: its tokenizer does not load ({type(e).__name__}: "
                             f"{text.splitlines()[0] if text else ''})") from None


def _check_chat_template(ctx, facts: ModelFacts) -> None:
    if not ctx.args.data.apply_chat_template:
        return
    has = bool(getattr(facts.tokenizer, "chat_template", None)) or any(
        os.path.isfile(os.path.join(facts.path, n)) for n in CHAT_TEMPLATE_FILES)
    if facts.tokenizer is None and not has:
        config = os.path.join(facts.path, "tokenizer_config.json")
        if os.path.isfile(config):
            try:
                with open(config, encoding="utf-8") as f:
                    has = bool(json.load(f).get("chat_template"))
            except (OSError, ValueError):
                pass
    if not has:
        raise PreflightError(
            f"--data.apply_chat_template: the tokenizer of {facts.name} has no chat template (tokenizer_config.json "
            "'chat_template', chat_template.jinja or chat_template.json). Drop --data.apply_chat_template and write "
            "the prompt in full (as the Countdown recipe does), or use a model that has one (an -Instruct model)")


def _check_vocab(facts: ModelFacts) -> None:
    vocab = facts.text_config.get("vocab_size")
    if facts.tokenizer is not None and vocab and len(facts.tokenizer) > int(vocab):
        raise PreflightError(f"{FLAG} {facts.name}: the tokenizer has {len(facts.tokenizer)} tokens but config.json's "
                             f"vocab_size is {vocab}: ids >= {vocab} have no embedding; the tokenizer is from another "
                             "model (copy the base model's tokenizer files)")


def positions(config: dict) -> Optional[int]:
    """The longest sequence the model's positions allow (vLLM's derived max_model_len), or None."""
    text = config.get("text_config") or config
    n = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    if not n:
        return None
    rope = text.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type")
    if kind in ROPE_FACTOR_TYPES and rope.get("factor"):
        n = int(n * float(rope["factor"]))
    return int(n)


def _check_positions(ctx, facts: ModelFacts) -> None:
    limit = positions(facts.config)
    max_len = ctx.args.data.max_len
    if limit is None or max_len <= limit:
        return
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1":
        ctx.say(f"model: --data.max_len {max_len} > the model's {limit} positions (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
        return
    raise PreflightError(
        f"--data.max_len {max_len} (prompt + response, vLLM's max_model_len) exceeds the {limit} positions of "
        f"{facts.name} (config.json max_position_embeddings{' x rope factor' if limit != facts.text_config.get('max_position_embeddings') else ''}); "
        f"lower --data.max_len (and --rollout.max_new_tokens) to at most {limit}")


@register_check("model")
def check_model(ctx) -> None:
    name = ctx.args.actor.model_name_or_path
    if not name:
        raise PreflightError(f"{FLAG} is required: a local model folder or a Hugging Face model id")
    name = os.path.expanduser(str(name))
    facts = _resolve(ctx, name)
    ctx.model = facts
    if facts.path is None:
        return
    facts.config = _config(facts)
    has_tokenizer = _check_files(ctx, facts)
    from openrlhf_lpo.cli.disk import model_params

    facts.params = model_params(facts.path)
    facts.tokenizer = _load_tokenizer(ctx, facts) if has_tokenizer else None
    _check_vocab(facts)
    _check_chat_template(ctx, facts)
    _check_positions(ctx, facts)
    kind = facts.config.get("model_type", "?") + (" (vision-language)" if facts.vlm else "")
    size = f", {facts.params / 1e9:.2f}B parameters" if facts.params and facts.params >= 1e7 else (
        f", {facts.params:,} parameters" if facts.params else "")
    ctx.say(f"model: {facts.name} ({kind}{size}, {positions(facts.config) or '?'} positions"
            + (f"; hub cache {facts.path}" if facts.hub_id else "") + ")")
