"""Listwise Policy Optimization (LPO, arXiv 2605.06139): the math, in pure torch.

A prompt's K sampled responses form a simplex. With s_k the length-normalised, clipped
log-ratio of response k (Eq. 4), the listwise policy is P = softmax(s). The target is the
listwise Gibbs distribution w* = softmax(R/tau + s_t) (Theorem 1, Eq. 8), and the loss is a
divergence between w* and P averaged over prompts (Eq. 10 forward KL, Eq. 11 reverse KL, or
any divergence on the simplex, App. C.6: ``js``, ``hellinger``, ``tv`` and the family ``alpha:<a>``,
resolved by name through the registries). Its gradient is sum_k c_k grad s_k;
``listwise_coefficients`` gives c in closed form, which also powers the two-pass surrogate
sum_k stopgrad(c_k) s_k.

Shapes: B responses; G prompts with K responses each, laid out as [G, K].
Everything here is computed in float32 or wider, whatever the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.nn.functional as F

from openrlhf_lpo.registry import lookup, register_unique, registrar  # stdlib only: the one room listwise imports

Tensor = torch.Tensor
TemperatureSpec = Union[str, float, int]

__all__ = [
    "DIVERGENCES",
    "DIVERGENCE_FAMILIES",
    "Divergence",
    "DivergenceFamily",
    "TEMPERATURES",
    "PG_ESTIMATORS",
    "PROJECTIONS",
    "register_divergence",
    "register_coefficients",
    "register_divergence_family",
    "resolve_divergence",
    "parse_divergence",
    "divergence_names",
    "register_temperature",
    "batch_std_temperature",
    "register_pg_estimator",
    "register_projection",
    "to_groups",
    "sequence_log_ratio",
    "SEQUENCE_SCORES",
    "SequenceScore",
    "register_sequence_score",
    "sequence_score",
    "ANCHORS",
    "sequence_anchor",
    "group_anchor",
    "group_temperature",
    "degenerate_groups",
    "gibbs_target",
    "listwise_log_policy",
    "listwise_divergence",
    "listwise_coefficients",
    "projection_coefficients",
    "listwise_loss",
    "listwise_surrogate",
    "pointwise_projection_loss",
    "pg_advantages",
    "cispo_token_loss",
    "token_is_weight",
    "parse_temperature",
    "listwise_group_sums",
    "listwise_stats_from_sums",
    "load_plugins",
]


# ----------------------------------------------------------------------------- helpers


def _wide(x: Tensor) -> Tensor:
    """``x`` in float32 or wider (bf16/fp16 are promoted, float64 is kept)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_groups(name: str, x: Tensor, min_k: int = 2) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [G, K], got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(
            f"{name} must have shape [G, K] (prompts x responses per prompt), got {tuple(x.shape)}; "
            "reshape flat per-response values with to_groups(values, K)"
        )
    if x.shape[1] < min_k:
        raise ValueError(
            f"{name} has K={x.shape[1]} responses per prompt; the listwise simplex needs K >= {min_k} "
            "(set --rollout.n_samples_per_prompt >= 2)"
        )


def _check_finite(name: str, x: Tensor) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{name} contains NaN or inf (first at index {idx}); fix the reward function so every "
            "response gets a finite reward"
        )


def _check_same_shape(a_name: str, a: Tensor, b_name: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{a_name} has shape {tuple(a.shape)} but {b_name} has shape {tuple(b.shape)}; they must match")


def to_groups(values: Tensor, group_size: int) -> Tensor:
    """Reshape flat per-response values [B] (prompt-major, K consecutive) to [B/K, K]."""
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: LPO needs K >= 2 responses per prompt")
    if values.dim() != 1 or values.numel() % group_size:
        raise ValueError(
            f"cannot split {tuple(values.shape)} values into groups of K={group_size}; "
            "the batch must hold whole groups (a multiple of n_samples_per_prompt)"
        )
    return values.view(-1, group_size)


# ----------------------------------------------------------------------------- Eq. 4: s_k


def sequence_log_ratio(
    log_probs: Tensor,
    old_log_probs: Tensor,
    action_mask: Optional[Tensor],
    clip_eps: Union[float, tuple] = 0.2,
) -> Tensor:
    """Length-normalised clipped log-ratio s_k of each response (Eq. 4), shape [B].

    s_k = (1/|y_k|) sum_i clip(log pi_theta - log pi_old, log(1-eps_low), log(1+eps_high)).
    The clamp is hard, so tokens outside the band get zero gradient in both directions.
    ``clip_eps`` is eps or (eps_low, eps_high); eps_low >= 1 leaves the log-ratio unbounded below (the band of a
    policy-gradient run's ``--lpo.end_kl`` metrics, e.g. CISPO's 1.0/3.0; LPO's own flags need eps_low < 1).
    A response with no tokens gives 0.
    """
    _check_same_shape("log_probs", log_probs, "old_log_probs", old_log_probs)
    eps_low, eps_high = (clip_eps, clip_eps) if isinstance(clip_eps, (int, float)) else tuple(clip_eps)
    if not (0.0 < eps_low) or eps_high <= 0.0:
        raise ValueError(f"clip_eps={clip_eps!r}: need eps_low > 0 and eps_high > 0")
    ratio = _wide(log_probs) - _wide(old_log_probs)
    ratio = ratio.clamp(math.log1p(-eps_low) if eps_low < 1.0 else None, math.log1p(eps_high))
    if action_mask is None:
        return ratio.mean(dim=-1)
    _check_same_shape("action_mask", action_mask, "log_probs", log_probs)
    mask = action_mask.to(ratio.dtype)
    total = (ratio * mask).sum(dim=-1)
    count = mask.sum(dim=-1)
    return total / count.clamp(min=1.0)


# ----------------------------------------------------------------------------- sequence scores and anchors


@dataclass(frozen=True)
class SequenceScore:
    """How a response's token log-ratios log pi_theta - log pi_old become its score s_k: clamped to the band
    [log(1-eps_low), log(1+eps_high)] or not (``clip``), averaged over the response's tokens or summed
    (``length_normalised``). The anchor of ``--lpo.anchor old`` aggregates log pi_old the same way."""

    name: str
    clip: bool
    length_normalised: bool


SEQUENCE_SCORES: Dict[str, SequenceScore] = {}


def register_sequence_score(name: str, clip: bool, length_normalised: bool) -> SequenceScore:
    """Register a score (``--lpo.score <name>``)."""
    return register_unique(SEQUENCE_SCORES, "sequence score", name, SequenceScore(name, clip, length_normalised))


# LPO's Eq. 4 (the default), TPO's completion logit l_theta - l_old (arXiv 2604.06159, Eq. 1: the summed
# sequence log-probability, no clip), and the per-token mean without a clip (the length-normalised TPO variant
# that the author's TRL integration, huggingface/trl#5591, makes its default)
register_sequence_score("mean_clip", clip=True, length_normalised=True)
register_sequence_score("sum", clip=False, length_normalised=False)
register_sequence_score("mean", clip=False, length_normalised=True)


def _aggregate(values: Tensor, action_mask: Optional[Tensor], length_normalised: bool) -> Tensor:
    """Masked sum over the last dim, or the masked mean (0 for a response with no tokens)."""
    if action_mask is None:
        return values.mean(dim=-1) if length_normalised else values.sum(dim=-1)
    _check_same_shape("action_mask", action_mask, "values", values)
    mask = action_mask.to(values.dtype)
    total = (values * mask).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1.0) if length_normalised else total


def sequence_score(
    log_probs: Tensor,
    old_log_probs: Tensor,
    action_mask: Optional[Tensor],
    clip_eps: Union[float, tuple] = 0.2,
    score: str = "mean_clip",
) -> Tensor:
    """s_k of each response, shape [B], under the registered ``score``:

    ``mean_clip`` (Eq. 4): (1/|y_k|) sum_t clip(log pi_theta - log pi_old) (:func:`sequence_log_ratio`);
    ``sum`` (TPO, arXiv 2604.06159, Eq. 1): sum_t (log pi_theta - log pi_old) = l_theta - l_old, no clip;
    ``mean``: (1/|y_k|) sum_t (log pi_theta - log pi_old), no clip. ``clip_eps`` is read only by clipped scores.
    """
    spec = lookup(SEQUENCE_SCORES, "sequence score", score)
    if spec.clip:
        return sequence_log_ratio(log_probs, old_log_probs, action_mask, clip_eps)
    _check_same_shape("log_probs", log_probs, "old_log_probs", old_log_probs)
    return _aggregate(_wide(log_probs) - _wide(old_log_probs), action_mask, spec.length_normalised)


# --lpo.anchor: "none" measures the list against the sampled responses alone (LPO: P = softmax(s), uniform at the
# start of an update); "old" adds the old policy's own probability of each response (TPO: p_theta = softmax(l_theta)
# = softmax(s + l_old), p_old = softmax(l_old), q = softmax(l_old + u/eta))
ANCHORS = ("none", "old")


def sequence_anchor(old_log_probs: Tensor, action_mask: Optional[Tensor], score: str = "mean_clip") -> Tensor:
    """l_old of each response, shape [B]: log pi_old(y_k) aggregated over its tokens as ``score`` aggregates the
    log-ratio (summed for ``sum``: the sequence log-probability of TPO's p_old; the per-token mean otherwise)."""
    spec = lookup(SEQUENCE_SCORES, "sequence score", score)
    return _aggregate(_wide(old_log_probs), action_mask, spec.length_normalised)


def group_anchor(anchor: Tensor) -> Tensor:
    """[G,K] anchors minus each group's largest: softmax(anchor + x) is unchanged, and every e^(anchor) of the
    group's sums lies in (0, 1] (the best response's is 1) however long the responses are."""
    _check_groups("anchor", anchor)
    a = _wide(anchor)
    return a - a.amax(dim=1, keepdim=True)


# ----------------------------------------------------------------------------- temperature

TEMPERATURES: Dict[str, Callable[[Tensor], Tensor]] = {}
WEIGHTED_TEMPERATURES: set = set()  # names whose fn also takes the responses' token counts (``weights``)


def register_temperature(name: str, weighted: bool = False):
    """Register ``fn(rewards[G,K]) -> tau[G,1]`` under ``name`` (like ``register_kl``); ``weighted``:
    ``fn(rewards, weights)`` with ``weights`` [G,K] the responses' token counts (or None)."""
    if weighted:
        WEIGHTED_TEMPERATURES.add(name)
    return registrar(TEMPERATURES, "temperature", name)


@register_temperature("std")
def _std_temperature(rewards: Tensor) -> Tensor:
    """Group standard deviation (unbiased, as OpenRLHF's group_norm): pairs with GRPO."""
    return rewards.std(dim=1, unbiased=True, keepdim=True)


@register_temperature("pop_std")
def _population_std_temperature(rewards: Tensor) -> Tensor:
    """Group standard deviation with 1/K (population): TPO's standardisation u = (R - mean)/sigma
    (arXiv 2604.06159, App. A), so that w* = softmax(R/tau + s_t) is TPO's target with eta = 1."""
    return rewards.std(dim=1, unbiased=False, keepdim=True)


@register_temperature("one")
def _unit_temperature(rewards: Tensor) -> Tensor:
    """tau = 1: pairs with Dr.GRPO (mean-centred advantages)."""
    return torch.ones_like(rewards[:, :1])


@register_temperature("mean")
def _mean_temperature(rewards: Tensor) -> Tensor:
    """Group mean reward (success rate for binary rewards): pairs with MaxRL."""
    if bool((rewards < 0).any()):
        raise ValueError(
            "temperature 'mean' (MaxRL pairing) needs non-negative rewards; use 'std' or 'one' "
            "for signed rewards"
        )
    return rewards.mean(dim=1, keepdim=True)


@register_temperature("loo")
def _leave_one_out_temperature(rewards: Tensor) -> Tensor:
    """tau = (K-1)/K: pairs with RLOO. Its leave-one-out advantage is Dr.GRPO's with a factor,
    A_k = R_k - (1/(K-1)) sum_{j != k} R_j = K/(K-1) (R_k - mean) = (R_k - mean)/tau (Eq. 2-3 with
    tau = (K-1)/K); K is the group size of ``rewards``."""
    k = rewards.shape[1]
    return torch.full_like(rewards[:, :1], (k - 1) / k)


def batch_std_temperature(rewards: Tensor, weights: Optional[Tensor] = None) -> Tensor:
    """tau [G,1] = sigma, one batch-level value for every group: pairs with REINFORCE++-baseline.

    REINFORCE++-baseline (OpenRLHF ``reinforce_baseline``) subtracts the group mean, then whitens the
    whole rollout batch: A = (a - m)/sigma with a = R - mean_g(R), m = sum w a / sum w and
    sigma^2 = max(sum w (a - m)^2 / sum w, 1e-8) over all G*K responses (OpenRLHF's floor on the
    variance). ``weights`` [G,K] = response token counts is OpenRLHF's token-weighted whitening (the
    ``batch_std`` pairing uses it): A = (a - m)/sigma, whose part a/sigma is the Gibbs form of Eq. 2-3
    with tau = sigma; the shift -m/sigma is the same for every response of the batch, which a softmax over
    a group cannot represent (m = 0 when lengths carry no reward information, e.g. equal lengths; wrong
    answers that are longer make m < 0). ``weights`` None weighs every response 1 (m = 0 exactly).
    ``rewards`` must hold every group of the batch (``group_temperature`` is called on the whole
    rollout batch)."""
    r = _wide(rewards)
    a = r - r.mean(dim=1, keepdim=True)
    if weights is None:
        w = torch.ones_like(a)
    else:
        _check_same_shape("weights", weights, "rewards", rewards)
        w = _wide(weights).to(a.dtype)
        if bool((w < 0).any()) or not bool(w.sum() > 0):
            raise ValueError("batch_std_temperature: weights (response token counts) must be >= 0 with a positive sum")
    total = w.sum()
    m = (w * a).sum() / total
    var = (w * (a - m).square()).sum() / total
    return var.clamp(min=1e-8).sqrt().expand(r.shape[0], 1).clone()


@register_temperature("batch_std", weighted=True)
def _batch_std_temperature(rewards: Tensor, weights: Optional[Tensor] = None) -> Tensor:
    """Batch-level std of R minus its group mean, token-weighted as OpenRLHF whitens (``weights`` the
    responses' token counts; None: every response weighs 1): pairs with REINFORCE++-baseline
    (:func:`batch_std_temperature`)."""
    return batch_std_temperature(rewards, weights)


def parse_temperature(value: TemperatureSpec) -> TemperatureSpec:
    """Validate a temperature spec: a registered mode name or a positive float (also as text)."""
    if isinstance(value, bool):
        raise ValueError(f"temperature {value!r} is not valid")
    if isinstance(value, str):
        if value in TEMPERATURES:
            return value
        try:
            value = float(value)
        except ValueError:
            raise ValueError(
                f"unknown temperature {value!r}; valid: {', '.join(sorted(TEMPERATURES))} or a positive number"
            ) from None
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"temperature {value!r} must be a positive finite number")
        return float(value)
    raise ValueError(f"temperature must be a mode name or a positive number, got {type(value).__name__}")


def group_temperature(rewards: Tensor, mode: TemperatureSpec, weights: Optional[Tensor] = None) -> Tensor:
    """Per-group temperature tau [G,1] of the Gibbs target (Eq. 7-8).

    ``mode``: "std" (GRPO), "one" (Dr.GRPO), "mean" (MaxRL), any registered name, or a
    positive float. ``weights`` [G,K]: the responses' token counts, for the temperatures registered
    ``weighted`` (``batch_std``); the others ignore them. Degenerate groups may give tau = 0;
    ``gibbs_target`` handles them.
    """
    _check_groups("rewards", rewards)
    _check_finite("rewards", rewards)
    spec = parse_temperature(mode)
    r = _wide(rewards)
    if isinstance(spec, float):
        return torch.full_like(r[:, :1], spec)
    if spec in WEIGHTED_TEMPERATURES:
        return TEMPERATURES[spec](r, weights)
    return TEMPERATURES[spec](r)


def degenerate_groups(rewards: Tensor) -> Tensor:
    """[G] bool: groups whose K rewards are all equal (no learning signal on the simplex)."""
    return rewards.amax(dim=1) == rewards.amin(dim=1)


def _scaled_rewards(rewards: Tensor, temperature: Tensor) -> Tensor:
    """(R - mean)/tau per group, exactly 0 for degenerate groups; never inf or NaN.

    Centring before dividing keeps R/tau from swamping s_t in float arithmetic; the shift
    does not change a softmax.
    """
    r = _wide(rewards)
    tau = _wide(temperature).to(r.dtype)
    if tau.shape != (r.shape[0], 1):
        tau = tau.reshape(-1, 1) if tau.numel() == r.shape[0] else tau.expand(r.shape[0], 1)
    flat = degenerate_groups(r).unsqueeze(1)
    bad = (~flat) & ~(tau > 0)
    if bool(bad.any()):
        raise ValueError(
            "temperature must be positive for groups with distinct rewards; got "
            f"{tau[bad.squeeze(1)].flatten()[:4].tolist()}"
        )
    centred = r - r.mean(dim=1, keepdim=True)
    safe_tau = torch.where(flat, torch.ones_like(tau), tau)
    return torch.where(flat, torch.zeros_like(centred), centred / safe_tau)


# ----------------------------------------------------------------------------- Eq. 8: target


def gibbs_target(
    rewards: Tensor,
    temperature: Union[Tensor, TemperatureSpec],
    prev_log_ratio: Optional[Tensor] = None,
) -> Tensor:
    """Listwise Gibbs target w* = softmax(R/tau + s_t) (Theorem 1, Eq. 8), shape [G,K].

    ``temperature`` is a [G,1] tensor (see ``group_temperature``) or a mode/number.
    ``prev_log_ratio`` is s_t at the pre-update policy (None = on-policy, s_t = 0).
    Groups with all-equal rewards give exactly softmax(s_t).
    """
    _check_groups("rewards", rewards)
    _check_finite("rewards", rewards)
    if not isinstance(temperature, Tensor):
        temperature = group_temperature(rewards, temperature)
    logits = _scaled_rewards(rewards, temperature)
    if prev_log_ratio is not None:
        _check_same_shape("prev_log_ratio", prev_log_ratio, "rewards", rewards)
        logits = logits + _wide(prev_log_ratio).to(logits.dtype)
    return torch.softmax(logits, dim=-1)


def listwise_log_policy(log_ratio: Tensor) -> Tensor:
    """log P with P = softmax(s) over each group (Eq. 4), in float32 or wider."""
    _check_groups("log_ratio", log_ratio)
    return torch.log_softmax(_wide(log_ratio), dim=-1)


# ----------------------------------------------------------------------------- divergences


@dataclass(frozen=True)
class Divergence:
    """A divergence D(w*, P) on the simplex (Eq. 10/11; any divergence, App. C.6).

    ``value(log_p, target) -> [G]`` with ``log_p`` = log softmax(s) and ``target`` = w*;
    ``coefficients(log_p, target) -> [G,K]`` its closed-form c = dD/ds (None: autograd of
    ``value``); ``bound``: a proven bound on sum_k |c_k| (None: unbounded or not known), printed by
    ``lpo-explain`` and checked by the tests."""

    name: str
    value: Callable[[Tensor, Tensor], Tensor]
    coefficients: Optional[Callable[[Tensor, Tensor], Tensor]] = None
    bound: Optional[float] = None


@dataclass(frozen=True)
class DivergenceFamily:
    """Divergences named ``<prefix>:<parameter>`` (``alpha:0.5``): ``parse(text)`` validates the
    parameter (ValueError with a message) and returns its value, ``build(name, value)`` the
    :class:`Divergence`; ``usage`` is the form error messages list (``alpha:<a> (any real a)``)."""

    prefix: str
    parse: Callable[[str], object]
    build: Callable[[str, object], Divergence]
    usage: str


DIVERGENCES: Dict[str, Divergence] = {}
DIVERGENCE_FAMILIES: Dict[str, DivergenceFamily] = {}


def register_divergence(name: str, bound: Optional[float] = None):
    """Decorator: register ``fn(log_p[G,K], target[G,K]) -> Tensor[G]`` as a divergence.

    ``log_p`` is log softmax(s); ``target`` is w*. Coefficients come from autograd unless a
    closed form is attached with ``register_coefficients(name)``; ``bound`` states a proven bound
    on sum_k |c_k| (tests check it).
    """
    if ":" in name:
        raise ValueError(f"divergence name {name!r} must not contain ':' (reserved for families such as alpha:<a>)")

    def deco(fn):
        register_unique(DIVERGENCES, "divergence", name, Divergence(name, fn, bound=bound))
        return fn

    return deco


def register_coefficients(name: str):
    """Attach a closed-form ``c = dD/ds`` to an already registered divergence."""

    def deco(fn):
        div = lookup(DIVERGENCES, "divergence", name)
        DIVERGENCES[name] = Divergence(div.name, div.value, fn, div.bound)
        return fn

    return deco


def register_divergence_family(prefix: str, parse: Callable[[str], object], usage: str):
    """Decorator: register ``build(name, value) -> Divergence`` for the names ``<prefix>:<text>``,
    ``value = parse(text)``. Names are resolved on use (:func:`resolve_divergence`), so every
    parameter works wherever a divergence name does."""
    if not prefix or ":" in prefix:
        raise ValueError(f"divergence family prefix {prefix!r} must be non-empty and contain no ':'")

    def deco(build):
        register_unique(DIVERGENCE_FAMILIES, "divergence family", prefix, DivergenceFamily(prefix, parse, build, usage))
        return build

    return deco


def divergence_names() -> str:
    """The valid divergence names, for messages: the registered ones, then each family's form."""
    names = ", ".join(sorted(DIVERGENCES))
    forms = " or ".join(f.usage for _, f in sorted(DIVERGENCE_FAMILIES.items()))
    return f"{names} or {forms}" if forms else names


def resolve_divergence(name: str) -> Divergence:
    """The :class:`Divergence` called ``name``: a registered name or ``<family>:<parameter>``."""
    if isinstance(name, str):
        if name in DIVERGENCES:
            return DIVERGENCES[name]
        prefix, colon, text = name.partition(":")
        family = DIVERGENCE_FAMILIES.get(prefix) if colon else None
        if family is not None:
            try:
                value = family.parse(text.strip())
            except ValueError as e:
                raise ValueError(f"divergence {name!r}: {e}") from None
            return family.build(name, value)
    raise ValueError(f"unknown divergence {name!r}; valid: {divergence_names()}")


def parse_divergence(name: str) -> str:
    """Validate a divergence name (returned unchanged); ValueError listing the valid ones."""
    resolve_divergence(name)
    return name


def _kl(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """sum_k p_k (log p_k - log q_k) with 0 log 0 = 0 (xlogy-style)."""
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1)


def _log_target(target: Tensor) -> Tensor:
    """log w*, an exact 0 (softmax underflow) read as the dtype's smallest normal number: finite
    (a lower bound on the true gap) where log 0 would make values inf and coefficients NaN."""
    return torch.log(target.clamp_min(torch.finfo(target.dtype).tiny))


def _expm1_over(x: Tensor, t: float) -> Tensor:
    """expm1(t x) / t, and its limit x at t = 0 (a three-term series for |t| < 1e-8, where t x
    would lose digits or underflow in float32)."""
    if t == 0.0:
        return x
    if abs(t) < 1e-8:
        tx = t * x
        return x * (1.0 + tx / 2.0 + tx * tx / 6.0)
    return torch.expm1(t * x) / t


@register_divergence("fwd", bound=2.0)
def forward_kl(log_p: Tensor, target: Tensor) -> Tensor:
    """KL(w* || P) (Eq. 10): mode-covering."""
    return _kl(target, _log_target(target), log_p)


@register_coefficients("fwd")
def _forward_kl_coefficients(log_p: Tensor, target: Tensor) -> Tensor:
    """c_k = P_k - w*_k (Eq. 10): |c_k| <= 1, sum_k |c_k| <= 2 (Cor. 1)."""
    return log_p.exp() - target


@register_divergence("rev")
def reverse_kl(log_p: Tensor, target: Tensor) -> Tensor:
    """KL(P || w*) (Eq. 11): mode-seeking, equals PG at the on-policy point (Prop. 1)."""
    return _kl(log_p.exp(), log_p, _log_target(target))


@register_coefficients("rev")
def _reverse_kl_coefficients(log_p: Tensor, target: Tensor) -> Tensor:
    """c_k = P_k (d_k - E_P d), d = s - log w* (Eq. 11; log-partition constants cancel)."""
    p = log_p.exp()
    d = log_p - _log_target(target)
    return p * (d - (p * d).sum(dim=-1, keepdim=True))


@register_divergence("js")
def jensen_shannon(log_p: Tensor, target: Tensor) -> Tensor:
    """JS(P, w*) = (KL(P||M) + KL(w*||M))/2 with M = (P + w*)/2; bounded by log 2."""
    p = log_p.exp()
    log_m = torch.log((p + target) / 2)
    return 0.5 * (_kl(p, log_p, log_m) + _kl(target, _log_target(target), log_m))


@register_coefficients("js")
def _jensen_shannon_coefficients(log_p: Tensor, target: Tensor) -> Tensor:
    """c_k = P_k (l_k - E_P l) / 2 with l = log(P / M)."""
    p = log_p.exp()
    ell = log_p - torch.log((p + target) / 2)
    return 0.5 * p * (ell - (p * ell).sum(dim=-1, keepdim=True))


@register_divergence("hellinger", bound=2.0)
def squared_hellinger(log_p: Tensor, target: Tensor) -> Tensor:
    """Squared Hellinger distance sum_k (sqrt(w*_k) - sqrt(P_k))^2 (no 1/2) = 2 - 2 BC(P, w*);
    equals alpha:0.5 / 2."""
    return ((target.sqrt() - (0.5 * log_p).exp()) ** 2).sum(dim=-1)


@register_coefficients("hellinger")
def _squared_hellinger_coefficients(log_p: Tensor, target: Tensor) -> Tensor:
    """c_k = P_k BC - sqrt(w*_k P_k), BC = sum_j sqrt(w*_j P_j) <= 1 (from g = dD/dP = 1 - sqrt(w*/P)):
    sum_k |c_k| <= 2 BC <= 2."""
    root = (target * log_p.exp()).sqrt()
    return log_p.exp() * root.sum(dim=-1, keepdim=True) - root


def _tv_gap(log_p: Tensor, target: Tensor) -> Tensor:
    """P - w*, set to exactly 0 where the two agree up to rounding (|P - w*| <= 16 eps (P + w*)):
    there the subgradient of |P_k - w*_k| is taken as 0, in the value's autograd and in c alike
    (a group with flat rewards on-policy has P = w* = softmax(s_t), computed two ways)."""
    p = log_p.exp()
    gap = p - target
    close = gap.abs() <= 16 * torch.finfo(gap.dtype).eps * (p + target)
    return torch.where(close, torch.zeros_like(gap), gap)


@register_divergence("tv", bound=1.0)
def total_variation(log_p: Tensor, target: Tensor) -> Tensor:
    """Total variation 1/2 sum_k |w*_k - P_k| (the projection error of Theorem 2)."""
    return 0.5 * _tv_gap(log_p, target).abs().sum(dim=-1)


@register_coefficients("tv")
def _total_variation_coefficients(log_p: Tensor, target: Tensor) -> Tensor:
    """c_k = P_k (g_k - E_P g), g = sign(P - w*)/2 (subgradient 0 where P_k = w*_k): sum_k |c_k| <= 1."""
    p = log_p.exp()
    g = 0.5 * torch.sign(_tv_gap(log_p, target))
    return p * (g - (p * g).sum(dim=-1, keepdim=True))


def _parse_alpha(text: str) -> float:
    try:
        a = float(text)
    except ValueError:
        raise ValueError(f"the parameter {text!r} is not a number; write alpha:<a> with a real a, e.g. alpha:0.5")
    if not math.isfinite(a):
        raise ValueError(f"a = {text} must be a finite real number (alpha:1 is forward KL, alpha:0 reverse KL)")
    return a


@register_divergence_family("alpha", _parse_alpha, "alpha:<a> (any real a)")
def alpha_divergence(name: str, a: float) -> Divergence:
    """Amari's alpha-divergence D_a(w* || P) = (sum_k w*_k^a P_k^(1-a) - 1) / (a (a - 1)).

    alpha:1 is KL(w*||P) and alpha:0 is KL(P||w*) (the limits, computed as those divergences);
    alpha:0.5 is twice the squared Hellinger distance. Near the limits the value uses
    expm1 forms, D_a = sum_k P_k expm1(a l_k) / (a (a-1)) = sum_k w*_k expm1((a-1) l_k) / (a (a-1))
    with l = log(w*/P), continuous through a = 0 and a = 1. c_k = -P_k (e_k - E_P e) with
    e = expm1(a l)/a, i.e. -(w*^a P^(1-a) - P sum_j w*_j^a P_j^(1-a))/a (from g = dD/dP = -(w*/P)^a / a);
    for 0 < a <= 1 sum_k |c_k| <= 2/a (Hoelder: sum_j w*_j^a P_j^(1-a) <= 1), unbounded otherwise.
    """
    if a == 1.0:
        fwd = DIVERGENCES["fwd"]
        return Divergence(name, fwd.value, fwd.coefficients, fwd.bound)
    if a == 0.0:
        rev = DIVERGENCES["rev"]
        return Divergence(name, rev.value, rev.coefficients, rev.bound)

    def value(log_p: Tensor, target: Tensor) -> Tensor:
        ell = _log_target(target) - log_p
        if a < 0.5:  # P-weighted form: exact as a -> 0
            return -(log_p.exp() * _expm1_over(ell, a)).sum(dim=-1) / (1.0 - a)
        return (target * _expm1_over(ell, a - 1.0)).sum(dim=-1) / a  # w*-weighted form: exact as a -> 1

    def coefficients(log_p: Tensor, target: Tensor) -> Tensor:
        p = log_p.exp()
        e = _expm1_over(_log_target(target) - log_p, a)
        return -p * (e - (p * e).sum(dim=-1, keepdim=True))

    return Divergence(name, value, coefficients, 2.0 / a if 0.0 < a <= 1.0 else None)


def _divergence_inputs(log_ratio: Tensor, target: Tensor):
    _check_groups("log_ratio", log_ratio)
    _check_same_shape("target", target, "log_ratio", log_ratio)
    log_p = listwise_log_policy(log_ratio)
    return log_p, _wide(target).to(log_p.dtype)


def listwise_divergence(log_ratio: Tensor, target: Tensor, divergence: str = "fwd") -> Tensor:
    """Per-group divergence D(w*, P) with P = softmax(log_ratio), shape [G] (Eq. 10/11).

    ``divergence``: a registered name (fwd, rev, js, hellinger, tv, ...) or ``alpha:<a>``."""
    div = resolve_divergence(divergence)
    log_p, tgt = _divergence_inputs(log_ratio, target)
    return div.value(log_p, tgt)


def listwise_coefficients(log_ratio: Tensor, target: Tensor, divergence: str = "fwd") -> Tensor:
    """c = dD/ds per group, [G,K]: the listwise gradient is sum_k c_k grad s_k (Eq. 10/11).

    Closed form for the built-in divergences (fwd: P - w*; rev: P(d - E_P d); js, hellinger, tv,
    alpha:<a>), autograd otherwise. Always detached: these are the weights of the surrogate
    sum_k c_k s_k.
    """
    div = resolve_divergence(divergence)
    with torch.no_grad():
        log_p, tgt = _divergence_inputs(log_ratio.detach(), target.detach())
        if div.coefficients is not None:
            return div.coefficients(log_p, tgt)
    s = _wide(log_ratio.detach()).clone().requires_grad_(True)
    with torch.enable_grad():
        value = div.value(torch.log_softmax(s, dim=-1), tgt).sum()
        (grad,) = torch.autograd.grad(value, s)
    return grad


# ----------------------------------------------------------------------------- projections

PROJECTIONS: Dict[str, Callable[..., Tensor]] = {}


def register_projection(name: str):
    """Register ``fn(log_ratio[G,K], target[G,K], divergence) -> Tensor[G]`` (per-group loss)."""
    return registrar(PROJECTIONS, "projection", name)


@register_projection("listwise")
def _listwise_projection(log_ratio: Tensor, target: Tensor, divergence: str) -> Tensor:
    return listwise_divergence(log_ratio, target, divergence)


@register_projection("pointwise")
def _pointwise_projection(log_ratio: Tensor, target: Tensor, divergence: str) -> Tensor:
    """Weighted log-likelihood -sum_k w*_k s_k (MPO/AWR style; the paper's ablation)."""
    _check_groups("log_ratio", log_ratio)
    _check_same_shape("target", target, "log_ratio", log_ratio)
    s = _wide(log_ratio)
    return -(_wide(target).to(s.dtype) * s).sum(dim=-1)


def projection_coefficients(log_ratio: Tensor, target: Tensor, divergence: str = "fwd",
                            projection: str = "listwise") -> Tensor:
    """c = dL_g/ds per group, [G,K], for the projection's per-group loss L_g: the weights of the
    two-pass surrogate sum_k stopgrad(c_k) s_k, whose gradient then equals the projection's.

    ``listwise``: :func:`listwise_coefficients` (dD/ds); ``pointwise``: -w* (d/ds of -sum_k w*_k s_k);
    any other registered projection: autograd of its per-group loss. Detached.
    """
    if projection == "listwise":
        return listwise_coefficients(log_ratio, target, divergence)
    fn = lookup(PROJECTIONS, "projection", projection)
    _check_groups("log_ratio", log_ratio)
    _check_same_shape("target", target, "log_ratio", log_ratio)
    if projection == "pointwise":
        return -_wide(target.detach()).to(_wide(log_ratio).dtype)
    s = _wide(log_ratio.detach()).clone().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(fn(s, target.detach(), divergence).sum(), s)
    return grad


def listwise_loss(
    log_ratio: Tensor, target: Tensor, divergence: str = "fwd", projection: str = "listwise"
) -> Tensor:
    """LPO loss: the projection's per-group loss averaged over prompts (scalar)."""
    fn = lookup(PROJECTIONS, "projection", projection)
    return fn(log_ratio, target, divergence).mean()


def pointwise_projection_loss(log_ratio: Tensor, target: Tensor) -> Tensor:
    """Pointwise ablation: -sum_k w*_k s_k averaged over prompts (no listwise normalisation)."""
    return listwise_loss(log_ratio, target, projection="pointwise")


def listwise_surrogate(log_ratio: Tensor, coefficients: Tensor) -> Tensor:
    """sum_k stopgrad(c_k) s_k per group, [G] or [B] elementwise shapes alike.

    Its gradient equals the divergence's gradient when c was computed from all K members at
    the current parameters: this is how groups that straddle micro-batches stay exact.
    """
    _check_same_shape("coefficients", coefficients, "log_ratio", log_ratio)
    s = _wide(log_ratio)
    return (coefficients.detach().to(s.dtype) * s).sum(dim=-1)


# ----------------------------------------------------------------------------- PG baselines

PG_ESTIMATORS: Dict[str, Callable[[Tensor], Tensor]] = {}


def register_pg_estimator(name: str):
    """Register ``fn(rewards[G,K]) -> advantages[G,K]`` under ``name``."""
    return registrar(PG_ESTIMATORS, "PG estimator", name)


def _normalised_advantage(rewards: Tensor, temperature: str) -> Tensor:
    return _scaled_rewards(rewards, group_temperature(rewards, temperature))


@register_pg_estimator("grpo")
def _grpo_advantages(rewards: Tensor) -> Tensor:
    """GRPO: (R - mean)/std (unbiased std; 0 for groups with equal rewards). Eq. 2-3."""
    return _normalised_advantage(rewards, "std")


@register_pg_estimator("dr_grpo")
def _dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr.GRPO: R - mean."""
    return _normalised_advantage(rewards, "one")


@register_pg_estimator("maxrl")
def _maxrl_advantages(rewards: Tensor) -> Tensor:
    """MaxRL: (R - mean)/mean; all-zero groups give 0, never inf."""
    return _normalised_advantage(rewards, "mean")


@register_pg_estimator("rloo")
def _rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO (OpenRLHF ``rloo``): A_k = R_k - mean of the other K-1 rewards = K/(K-1) (R - mean); paired
    temperature ``loo`` = (K-1)/K. Groups with equal rewards give exactly 0."""
    k = rewards.shape[1]
    r = _wide(rewards)
    adv = r - (r.sum(dim=1, keepdim=True) - r) / (k - 1)
    return torch.where(degenerate_groups(r).unsqueeze(1), torch.zeros_like(adv), adv)


@register_pg_estimator("reinforce_pp")
def _reinforce_pp_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE++-baseline (OpenRLHF ``reinforce_baseline``) with every response weighing 1:
    A = (R - group mean)/sigma, sigma = the batch std of R - group mean (temperature ``batch_std``)."""
    return _normalised_advantage(rewards, "batch_std")


def cispo_token_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, eps_low: float,
                     eps_high: float, rollout_log_probs: Optional[Tensor] = None,
                     is_correction: Optional[tuple] = None):
    """CISPO's per-token loss (MiniMax-M1, arXiv 2506.13585, Eq. 4-5), the ``--actor.policy_loss_type cispo``
    of both backends:

        l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_theta(y_t),  r_t = pi_theta(y_t) / pi_old(y_t)

    i.e. REINFORCE whose importance ratio, clipped and detached, weighs each token: dl_t/dtheta =
    -clip(r_t) A_t grad log pi_theta(y_t), so every token keeps a gradient (PPO's clipped objective zeroes it
    outside the band; CISPO only caps its weight). ``eps_low`` >= 1 removes the lower bound (r >= 0).

    ``is_correction`` = (mode, low, high) with ``rollout_log_probs`` = log mu (the engine's): the token-level
    train/rollout correction (``--algo.advantage.is_correction_level token``) multiplies l_t by the detached
    c_t = clip(pi_old/mu, low, high) (``clip``, truncated IS) or by pi_old/mu where it lies in [low, high] and 0
    elsewhere (``mask``), as OpenRLHF does for PPO. Returns (l [B,T] in the dtype of ``log_probs``, clipped [B,T]
    bool: r_t outside the band, filtered [B,T] bool or None: tokens the correction truncated or dropped); the
    caller aggregates (token mean: the paper's 1/sum_i |o_i|)."""
    if not (math.isfinite(eps_low) and eps_low >= 0.0) or not (math.isfinite(eps_high) and eps_high > 0.0):
        raise ValueError(f"--actor.eps_clip_low_high ({eps_low}, {eps_high}): CISPO clips the importance weight to "
                         "[1 - low, 1 + high], so it needs low >= 0 (>= 1: no lower bound) and high > 0")
    _check_same_shape("old_log_probs", old_log_probs, "log_probs", log_probs)
    log_ratio = _wide(log_probs.detach()) - _wide(old_log_probs.detach())
    lo = math.log1p(-eps_low) if eps_low < 1.0 else -math.inf
    hi = math.log1p(eps_high)
    clipped = (log_ratio < lo) | (log_ratio > hi)
    weight = log_ratio.clamp(min=lo, max=hi).exp()
    correction, filtered = token_is_weight(old_log_probs, rollout_log_probs, is_correction)
    if correction is not None:
        weight = weight * correction
    return -weight.to(log_probs.dtype) * advantages.to(log_probs.dtype) * log_probs, clipped, filtered


def token_is_weight(old_log_probs: Tensor, rollout_log_probs: Optional[Tensor], is_correction: Optional[tuple]):
    """The token-level train/rollout correction of the registered policy-loss types (CISPO, Clip-Cov, KL-Cov), as
    OpenRLHF applies it to PPO: with ``is_correction`` = (mode, low, high) and ``rollout_log_probs`` = log mu, the
    detached weight c_t = clip(pi_old/mu, low, high) (``clip``, truncated IS) or pi_old/mu inside [low, high] and 0
    outside (``mask``). Returns (c [B,T] or None when off, filtered [B,T] bool or None: tokens truncated/dropped)."""
    if is_correction is None:
        return None, None
    mode, low, high = is_correction
    if rollout_log_probs is None:
        raise ValueError("--algo.advantage.is_correction_level token needs the rollout's log-probs (rollout_log_probs)")
    _check_same_shape("rollout_log_probs", rollout_log_probs, "old_log_probs", old_log_probs)
    is_ratio = (_wide(old_log_probs.detach()) - _wide(rollout_log_probs.detach())).exp()
    filtered = (is_ratio < low) | (is_ratio > high)
    if mode == "clip":
        return is_ratio.clamp(min=low, max=high), filtered
    if mode == "mask":
        return torch.where(filtered, torch.zeros_like(is_ratio), is_ratio), filtered
    raise ValueError(f"--algo.advantage.is_correction_mode {mode!r}: use clip or mask")


def pg_advantages(rewards: Tensor, estimator: str = "grpo") -> Tensor:
    """Paired policy-gradient baseline advantages A[G,K]; A = (R - mean)/tau of the paired
    temperature, so that w* = softmax(A) on-policy (Prop. 1)."""
    _check_groups("rewards", rewards)
    _check_finite("rewards", rewards)
    return lookup(PG_ESTIMATORS, "PG estimator", estimator)(rewards)


# ----------------------------------------------------------------------------- metrics


def listwise_group_sums(gids: Tensor, s: Tensor, target: Tensor, n_groups: int) -> Tensor:
    """Per-group sums [5, n_groups] (float64) over the members given: sum e^s, sum e^s s,
    sum w* s, sum w* log w*, member count. Members of one group may sit on different ranks:
    the sums add up (all-reduce) and :func:`listwise_stats_from_sums` finishes the softmax."""
    s = s.double()
    w = target.double().to(s.device)
    gids = gids.long().to(s.device)
    e = s.exp()  # s is a mean of clipped token log-ratios: bounded, no overflow
    w_log_w = torch.where(w > 0, w * torch.log(w), torch.zeros_like(w))
    rows = torch.stack([e, e * s, w * s, w_log_w, torch.ones_like(s)])
    out = torch.zeros(5, n_groups, dtype=torch.float64, device=s.device)
    return out.index_add_(1, gids, rows)


def listwise_stats_from_sums(sums: Tensor, group_size: int) -> Dict[str, float]:
    """Mean over groups of KL(w*||P) = sum w log w - sum w s + log Z, H(P) = log Z - sum e^s s / Z
    and H(w*), with P = softmax(s), Z = sum e^s (Eq. 10's divergence, Figure 5's entropies)."""
    z, zs, ws, wlogw, count = sums
    present = count > 0
    if bool((count[present] != group_size).any()):
        bad = sorted(set(int(c) for c in count[present].tolist()) - {group_size})
        raise ValueError(
            f"listwise metrics: groups with {bad} members, expected group_size={group_size} (K, "
            "--rollout.n_samples_per_prompt): a group is missing members on every rank"
        )
    log_z = torch.log(z[present])
    kl = wlogw[present] - ws[present] + log_z
    h_p = log_z - zs[present] / z[present]
    n = max(int(present.sum()), 1)
    return {"kl": float(kl.sum()) / n, "entropy_p": float(h_p.sum()) / n,
            "entropy_target": float(-wlogw[present].sum()) / n, "groups": float(present.sum())}


# ----------------------------------------------------------------------------- plugins


def load_plugins(spec: Optional[str] = None) -> List[str]:
    """Import the modules named in ``spec`` (default: ``$LPO_PLUGINS``, comma-separated), which
    register their own divergences, temperatures, projections or PG estimators (docs/divergences.md).

    Runs once when this module is imported, so every process that computes an LPO loss (the
    ``lpo-train`` driver, each Ray actor, a Megatron rank) sees the same registries. A module that
    cannot be imported raises ImportError naming ``LPO_PLUGINS``.
    """
    import importlib
    import os

    spec = os.environ.get("LPO_PLUGINS", "") if spec is None else spec
    loaded = []
    for module in (m.strip() for m in spec.split(",")):
        if not module:
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"LPO_PLUGINS names {module!r}, which cannot be imported ({e}); make it importable "
                              "(PYTHONPATH) in every process or drop it from LPO_PLUGINS") from e
        loaded.append(module)
    return loaded


load_plugins()
