"""The protocol of an evaluation: generation presets, and the settings header every report prints.

**Presets** (``lpo-eval generate|run --preset NAME``, :data:`PRESETS`) set the prompt template, the
sampling, the response budget and the per-benchmark k (n = k) in one flag; an explicit flag beats the
preset (``--preset paper --temperature 0.6`` samples at 0.6), per benchmark for ``--n`` / ``--k``.

* ``paper``: the LPO paper's protocol (arXiv 2605.06139, Appendix D.3 / E.5): verl's MATH prompt
  (``--template verl-math``), its rollout sampling (temperature 1.0, top-p 1.0, top-k off), 4096-token
  responses, Pass@k at the paper's k (32 AIME24/AIME25/AMC23, 4 Minerva, 1 MATH500/OlympiadBench, 8 PRIME
  code, 16 Geometry3k) with n = k (Pass@1 = Avg@k), and the Pass@k average over the benchmarks with k > 1.
* ``r1``: DeepSeek-R1's evaluation convention: the question and the boxed instruction through the chat
  template (``--template chat``, no system prompt), temperature 0.6, top-p 0.95, 32768 tokens.

**Header.** ``score`` records each job's settings in ``metrics.json`` (:func:`job_protocol`: template,
sampling, budget, seed, engine, data source, the data notes of
:class:`evaluation.benchmark_registry.LoadedBenchmark`); ``report`` gathers them
(:func:`table_protocol`) and prints them above the tables (:func:`header_lines`): every setting (one
value, or each value with its benchmarks), the preset the settings match, the grading policy (box rule,
box required, choice extraction per benchmark), how the Pass@k average is taken, GPQA's option
orderings, and a **warning for every subset** (the staged 300-row MMLU-Pro sample, a shorter file,
``--limit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .benchmarks import BENCHMARKS

# The paper's k per benchmark (n = k: Pass@1 is Avg@k); other benchmarks keep the registry's k.
PAPER_K = {"aime24": 32, "aime25": 32, "amc23": 32, "minerva": 4, "math500": 1, "olympiadbench": 1,
           "prime_code": 8, "geometry3k": 16}
# What generation uses without a preset or a flag.
GENERATION_DEFAULTS: dict[str, Any] = {"template": "qwen-boxed", "temperature": 0.6, "top_p": 0.95, "top_k": -1,
                                       "max_tokens": 8192}
PASSK_AVERAGES = ("auto", "all", "k>1")


@dataclass(frozen=True)
class Preset:
    """A named protocol: generation settings (GenOptions fields), the k per benchmark, the Pass@k average."""

    name: str
    summary: str
    settings: dict[str, Any]
    k: dict[str, int] = field(default_factory=dict)
    passk_average: str = "all"


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("paper", "the LPO paper's protocol: verl-math prompt, temperature 1.0, top-p 1.0, 4096 tokens, the "
               "paper's k with n = k, Pass@k averaged over the benchmarks with k > 1",
               {"template": "verl-math", "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4096},
               PAPER_K, "k>1"),
        Preset("r1", "DeepSeek-R1's convention: chat template, temperature 0.6, top-p 0.95, 32768 tokens",
               {"template": "chat", "temperature": 0.6, "top_p": 0.95, "top_k": -1, "max_tokens": 32768}),
    )
}


def get_preset(name: str | None) -> Preset | None:
    if name is None:
        return None
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is not a preset; choose from {', '.join(PRESETS)}")
    return PRESETS[name]


def resolve_settings(preset: str | None, given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Generation settings from the flags given (``None`` = not given), the preset, then the defaults.

    Returns ``(settings, origin)`` with origin ``"flag"``, ``"preset <name>"`` or ``"default"`` per setting.
    """
    p = get_preset(preset)
    settings, origin = {}, {}
    for key, default in GENERATION_DEFAULTS.items():
        if given.get(key) is not None:
            settings[key], origin[key] = given[key], "flag"
        elif p is not None and key in p.settings:
            settings[key], origin[key] = p.settings[key], f"preset {p.name}"
        else:
            settings[key], origin[key] = default, "default"
    return settings, origin


def merge_per_benchmark(preset_values: dict[str, int], explicit: dict[str, int]) -> dict[str, int]:
    """A preset's per-benchmark values under the flag's: ``--k 8`` (every benchmark) drops the preset's."""
    if "*" in explicit:
        return dict(explicit)
    return {**preset_values, **explicit}


def describe_settings(preset: str | None, settings: dict[str, Any], origin: dict[str, str]) -> str:
    """One line for stderr: the settings a ``generate`` uses and where each came from."""
    parts = [f"{k}={settings[k]}" + ("" if origin[k] == "default" else f" ({origin[k]})") for k in settings]
    head = f"preset {preset}: " if preset else "settings: "
    return head + ", ".join(parts)


# -- what a job and a table record ------------------------------------------------------------------

def job_protocol(cfg: dict) -> dict:
    """The settings of one job (from its ``config.json``) that a report prints."""
    sampling = cfg.get("sampling") or {}
    return {
        "template": cfg.get("template"),
        "system_prompt": cfg.get("system_prompt"),
        "chat_template_kwargs": cfg.get("chat_template_kwargs") or {},
        "temperature": sampling.get("temperature"),
        "top_p": sampling.get("top_p"),
        "top_k": sampling.get("top_k"),
        "max_tokens": sampling.get("max_tokens"),
        "seed": cfg.get("seed"),
        "engine": cfg.get("engine"),
        "data_source": cfg.get("data_source"),
        "n_problems": cfg.get("n_problems"),
        "data_notes": cfg.get("data_notes") or {},
    }


GENERATION_KEYS = ("template", "system_prompt", "chat_template_kwargs", "temperature", "top_p", "top_k", "max_tokens",
                   "seed", "engine")


def _values(ms: list[dict], get) -> dict[str, list[str]]:
    """JSON-ish value -> benchmarks, over the jobs of a table (each benchmark once)."""
    out: dict[str, list[str]] = {}
    for m in ms:
        v = get(m)
        key = "unknown (scored before protocols were recorded)" if v is _UNKNOWN else _show(v)
        if m["benchmark"] not in out.setdefault(key, []):
            out[key].append(m["benchmark"])
    return out


_UNKNOWN = object()


def _show(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in sorted(v.items())) or "none"
    return str(v)


def _subset(m: dict) -> dict | None:
    """``{questions, size, rows, source}`` when a job used fewer questions than its benchmark's test set."""
    prot = m.get("protocol") or {}
    notes = prot.get("data_notes") or {}
    size = notes.get("size") or getattr(BENCHMARKS.get(m["benchmark"]), "size", None)
    questions = notes.get("questions", m.get("n_problems", prot.get("n_problems")))
    if size is None or questions is None:
        return None
    subset = notes["subset"] if "subset" in notes else questions < size
    if not subset:
        return None
    return {"questions": questions, "size": size, "rows": notes.get("rows", questions), "source": prot.get("data_source")}


def matching_preset(ms: list[dict]) -> str | None:
    """The preset whose settings every job of the table has (k per benchmark with n = k included)."""
    for p in PRESETS.values():
        ok = bool(ms)
        for m in ms:
            prot = m.get("protocol")
            if not prot or any(prot.get(key) != value for key, value in p.settings.items()):
                ok = False
                break
            want = p.k.get(m["benchmark"])
            if want is not None and (m["k"] != want or m["n"] != want):
                ok = False
                break
        if ok:
            return p.name
    return None


def table_protocol(ms: list[dict], passk_average: str = "auto") -> dict:
    """The settings a table was made with (JSON-serialisable; ``summary.json`` holds it)."""
    if passk_average not in PASSK_AVERAGES:
        raise ValueError(f"--passk-average must be one of {', '.join(PASSK_AVERAGES)}, got {passk_average!r}")
    order = {name: i for i, name in enumerate(BENCHMARKS)}
    ms = sorted(ms, key=lambda m: (order.get(m["benchmark"], len(order)), m["benchmark"]))
    preset = matching_preset(ms)
    rule = passk_average
    if rule == "auto":
        rule = PRESETS[preset].passk_average if preset else "all"
    settings = {key: _values(ms, lambda m, key=key: (m.get("protocol") or {}).get(key, _UNKNOWN))
                for key in GENERATION_KEYS}
    grading = {
        "boxes": _values([m for m in ms if _kind(m) == "math"], lambda m: (m.get("grader") or {}).get("boxes")),
        "require_box": _values([m for m in ms if _kind(m) == "math"],
                               lambda m: (m.get("grader") or {}).get("require_box", "never")),
        "choice_extraction": _values([m for m in ms if _kind(m) == "choice"], _choice_chain),
    }
    grading = {k: v for k, v in grading.items() if v}
    orderings = {m["benchmark"]: ((m.get("protocol") or {}).get("data_notes") or {}).get("orderings")
                 for m in ms if ((m.get("protocol") or {}).get("data_notes") or {}).get("orderings")}
    subsets = {}
    for m in ms:
        sub = _subset(m)
        if sub is not None:
            subsets.setdefault(m["benchmark"], sub)
    return {"preset": preset, "passk_average": rule, "settings": settings, "grading": grading,
            "orderings": orderings, "subsets": subsets,
            "samples": {m["benchmark"]: {"n": m["n"], "k": m["k"]} for m in ms}}


def _kind(m: dict) -> str | None:
    spec = BENCHMARKS.get(m["benchmark"])
    return spec.kind if spec is not None else ("math" if m.get("group") == "custom" else None)


def _choice_chain(m: dict) -> str:
    return (m.get("grader") or {}).get("choice_extraction", "explicit")


def _line(name: str, values: dict[str, list[str]]) -> str:
    if len(values) == 1:
        return f"- {name}: {next(iter(values))}"
    return f"- {name}: **mixed**: " + "; ".join(f"{v} ({', '.join(bs)})" for v, bs in values.items())


REQUIRE_BOX_TEXT = {"truncated": "truncated responses (hit --max-tokens) are graded by their boxes only",
                    "all": "every response is graded by its boxes only", "never": "unboxed text is graded too"}


def header_lines(protocol: dict) -> list[str]:
    """The markdown header of ``summary.md``: warnings first, then every setting."""
    out = []
    for bench, sub in protocol.get("subsets", {}).items():
        rows = sub.get("rows", sub["questions"])
        where = sub.get("source") or "unknown source"
        where = f"the first {sub['questions']:,} of the {rows:,} rows of {where}" if sub["questions"] < rows else where
        out.append(f"> **WARNING: {bench} is a SUBSET: {sub['questions']:,} of its {sub['size']:,} test questions** "
                   f"({where}); its numbers are not comparable with published ones.")
    if out:
        out.append("")
    out.append("### Protocol\n")
    preset = protocol.get("preset")
    out.append(f"- preset: {preset} (every setting below matches it)" if preset else
               "- preset: none (the settings match no preset)")
    for key in GENERATION_KEYS:
        out.append(_line(key.replace("_", " "), protocol["settings"][key]))
    samples = protocol.get("samples", {})
    out.append("- samples per problem / Pass@k: " + ", ".join(f"{b} n={v['n']} k={v['k']}" for b, v in samples.items()))
    rule = protocol.get("passk_average")
    out.append("- Pass@k average: " + ("over the benchmarks with k > 1 (the paper's)" if rule == "k>1" else
                                       "over every benchmark of the group (a k = 1 benchmark enters with its Pass@1)"))
    grading = protocol.get("grading", {})
    if "boxes" in grading:
        out.append(_line("math box rule", {("last box; a list of boxes for a multi-part gold" if v == "last" else
                                            "every box as a set (math-verify)" if v == "all" else v): bs
                                           for v, bs in grading["boxes"].items()}))
    if "require_box" in grading:
        out.append(_line("box required", {REQUIRE_BOX_TEXT.get(v, v): bs for v, bs in grading["require_box"].items()}))
    if "choice_extraction" in grading:
        out.append(_line("choice extraction", {(v + (" (MMLU-Pro's chain: also the last standalone letter)"
                                                     if v == "mmlu-pro" else " (the last explicit answer)")): bs
                                               for v, bs in grading["choice_extraction"].items()}))
    for bench, count in protocol.get("orderings", {}).items():
        out.append(f"- {bench}: {count} option ordering{'s' if count != 1 else ''} per question "
                   "(Pass@1 is their mean; Pass@k the mean of each ordering's)")
    out.append("")
    return out


def data_warnings(opts) -> list[str]:
    """Lines ``generate`` prints before it starts: every benchmark that is a subset, GPQA's orderings.

    Reads each benchmark once (as ``generate`` will); one that cannot be read is left to ``generate``,
    which reports it per checkpoint.
    """
    from .benchmarks import load_benchmark

    lines = []
    for bench in opts.benchmarks:
        try:
            loaded = load_benchmark(bench, opts.data.get(bench), opts.limit, opts.benchmark_options.get(bench))
        except ValueError:
            continue
        notes = loaded.notes
        if notes.get("subset"):
            why = [f"{loaded.source} holds {notes['rows']:,}"] if notes["rows"] < notes["size"] else []
            why += [f"--limit {opts.limit}"] if opts.limit and notes["questions"] < notes["rows"] else []
            lines.append(f"WARNING: {bench} is a SUBSET: {notes['questions']:,} of its {notes['size']:,} test questions "
                         f"({'; '.join(why)}): not comparable with published numbers"
                         + (f"; {loaded.spec.note}" if notes["rows"] < notes["size"] and loaded.spec.note else ""))
        if notes.get("orderings", 1) > 1:
            lines.append(f"{bench}: {notes['orderings']} option orderings per question ({len(loaded.problems)} problems)")
    return lines
