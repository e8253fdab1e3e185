"""Per-problem views: ``lpo-eval show`` (one checkpoint's problems, samples and verdicts) and
``lpo-eval compare`` (two checkpoints problem by problem: which problems flipped), as text/markdown and
as one self-contained HTML page (inline CSS, no scripts, every model output HTML-escaped: model output
is hostile input).

A checkpoint is named by its id under ``--runs`` or any unique substring of it (``global_step20``).
A problem's accuracy is c/n over its samples; in ``compare`` a problem is *gained* when the first
checkpoint solved none of its samples and the second at least one, *lost* the other way round, and
*changed* when its accuracy moved otherwise. Each benchmark's difference in Pass@1 (and in Pass@k at
the jobs' k) comes with its paired bootstrap interval and p-value over the shared problems
(:func:`evaluation.stats.paired_bootstrap`).

A long gold (a code problem's tests JSON) is cut to :data:`GOLD_INLINE` characters in headers, summaries
and the compare table, and shown whole in its own block of the problem.
"""

from __future__ import annotations

import html
from pathlib import Path

from .generate import CONFIG_FILE, GEN_FILE, PROBLEMS_FILE
from .io import read_json, read_jsonl
from .metrics import pass_at_k
from .score import METRICS_FILE, SAMPLES_FILE
from .stats import paired_bootstrap


def checkpoint_dirs(runs: str | Path) -> list[Path]:
    root = Path(runs)
    if not root.is_dir():
        raise ValueError(f"--runs {str(root)!r} is not a directory")
    return sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob(f"*/{GEN_FILE}")))


def find_checkpoint(runs: str | Path, name: str) -> Path:
    """The checkpoint directory under ``runs`` whose id is ``name`` or uniquely contains it."""
    dirs = checkpoint_dirs(runs)
    exact = [d for d in dirs if d.name == name]
    if exact:
        return exact[0]
    hits = [d for d in dirs if name in d.name]
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(d.name for d in dirs) or "none"
    if not hits:
        raise ValueError(f"no checkpoint under --runs matches {name!r} (known: {known})")
    raise ValueError(f"{name!r} matches several checkpoints ({', '.join(d.name for d in hits)}); be more specific")


def find_job(ckpt_dir: Path, benchmark: str, config_sha: str | None = None) -> Path:
    """The scored job of ``benchmark`` in ``ckpt_dir`` (the latest config unless ``config_sha`` picks one)."""
    jobs = [p.parent for p in ckpt_dir.glob(f"{benchmark}-*/{SAMPLES_FILE}")]
    if config_sha:
        jobs = [j for j in jobs if read_json(j / CONFIG_FILE)["config_sha"].startswith(config_sha)]
    if not jobs:
        raise ValueError(f"{ckpt_dir.name} has no scored {benchmark!r} job (run `lpo-eval score`)")
    return max(jobs, key=lambda j: ((j / GEN_FILE).stat().st_mtime_ns, j.name))


def scored_benchmarks(ckpt_dir: Path) -> list[str]:
    return sorted({read_json(p)["benchmark"] for p in ckpt_dir.glob(f"*/{METRICS_FILE}")})


def problem_records(job: Path) -> list[dict]:
    """Per problem: id, question, prompt, gold, samples (with verdicts) and accuracy, in benchmark order."""
    samples = read_jsonl(job / SAMPLES_FILE)
    meta = {str(p["problem_id"]): p for p in read_jsonl(job / PROBLEMS_FILE)} if (job / PROBLEMS_FILE).exists() else {}
    recs: dict[str, dict] = {}
    for s in samples:
        pid = str(s["problem_id"])
        m = meta.get(pid, {})
        rec = recs.setdefault(pid, {"problem_id": pid, "question": m.get("question"), "prompt": m.get("prompt"),
                                    "gold": s["gold"], "samples": []})
        rec["samples"].append(s)
    for rec in recs.values():
        rec["samples"].sort(key=lambda s: s["sample_idx"])
        rec["accuracy"] = sum(bool(s["correct"]) for s in rec["samples"]) / len(rec["samples"])
    return list(recs.values())


# -- show ------------------------------------------------------------------------------------------


def select_records(recs: list[dict], problems: list[str] | None = None, only: str | None = None) -> list[dict]:
    if problems:
        wanted = set(problems)
        missing = wanted - {r["problem_id"] for r in recs}
        if missing:
            raise ValueError(f"--problem {', '.join(sorted(missing))}: no such problem id in this job")
        recs = [r for r in recs if r["problem_id"] in wanted]
    if only == "correct":
        recs = [r for r in recs if r["accuracy"] > 0]
    elif only == "wrong":
        recs = [r for r in recs if r["accuracy"] < 1]
    elif only not in (None, "all"):
        raise ValueError(f"--only must be all, correct or wrong, got {only!r}")
    return recs


GOLD_INLINE = 80


def _brief(gold: str) -> str:
    """``gold`` on one line, cut to :data:`GOLD_INLINE` characters."""
    one = gold.replace("\n", " ")
    return one if len(one) <= GOLD_INLINE else one[:GOLD_INLINE] + f"... [{len(one) - GOLD_INLINE} more chars]"


def show_text(title: str, recs: list[dict], max_chars: int = 2000) -> str:
    out = [title, ""]
    for r in recs:
        out.append(f"=== problem {r['problem_id']}  gold: {_brief(r['gold'])}  accuracy: {r['accuracy']:.2f}")
        if _brief(r["gold"]) != r["gold"]:
            out += ["--- gold", r["gold"]]
        if r["question"] is not None:
            out += ["--- question", r["question"]]
        if r["prompt"] is not None:
            out += ["--- prompt", r["prompt"]]
        for s in r["samples"]:
            verdict = "correct" if s["correct"] else ("wrong" if s["grader_status"] == "ok" else s["grader_status"])
            out.append(f"--- sample {s['sample_idx']}: {verdict}, extracted {s['extracted']!r}, {s['n_tokens']} tokens, "
                       f"finish {s['finish_reason']}")
            resp = s["response"]
            out.append(resp if len(resp) <= max_chars else resp[:max_chars] + f"... [{len(resp) - max_chars} more chars]")
        out.append("")
    return "\n".join(out)


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}
details{margin:.4em 0;border:1px solid #ddd;border-radius:4px;padding:.3em .6em}
summary{cursor:pointer}pre{white-space:pre-wrap;word-break:break-word;background:#fafafa;padding:.4em;margin:.2em 0}
.ok{color:#17702a;font-weight:600}.bad{color:#a11;font-weight:600}.na{color:#666;font-weight:600}
.gained{background:#e6f6e6}.lost{background:#fbe3e3}.cols{display:grid;grid-template-columns:1fr 1fr;gap:1em}
"""


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


def _verdict(s: dict) -> str:
    if s["correct"]:
        return '<span class="ok">correct</span>'
    if s["grader_status"] == "ok":
        return '<span class="bad">wrong</span>'
    return f'<span class="na">{html.escape(s["grader_status"])}</span>'


def _samples_html(rec: dict) -> str:
    parts = []
    for s in rec["samples"]:
        parts.append(f"<div>sample {s['sample_idx']}: {_verdict(s)}, extracted <code>{html.escape(str(s['extracted']))}</code>, "
                     f"{s['n_tokens']} tokens, finish {html.escape(s['finish_reason'])}"
                     f"<pre>{html.escape(s['response'])}</pre></div>")
    return "".join(parts)


def _problem_head_html(rec: dict) -> str:
    out = ""
    if rec["question"] is not None:
        out += f"<div><b>question</b><pre>{html.escape(rec['question'])}</pre></div>"
    if rec["prompt"] is not None:
        out += f"<details><summary>prompt</summary><pre>{html.escape(rec['prompt'])}</pre></details>"
    if _brief(rec["gold"]) != rec["gold"]:
        return out + f"<div><b>gold</b><pre>{html.escape(rec['gold'])}</pre></div>"
    return out + f"<div><b>gold</b> <code>{html.escape(rec['gold'])}</code></div>"


def show_html(title: str, recs: list[dict]) -> str:
    body = []
    for r in recs:
        body.append(f"<details><summary>problem {html.escape(r['problem_id'])}: accuracy {r['accuracy']:.2f} "
                    f"(gold <code>{html.escape(_brief(r['gold']))}</code>)</summary>{_problem_head_html(r)}{_samples_html(r)}</details>")
    return _page(title, "\n".join(body))


# -- compare ---------------------------------------------------------------------------------------


def _passk_values(rec: dict, k: int) -> float:
    n = len(rec["samples"])
    return pass_at_k(n, sum(bool(s["correct"]) for s in rec["samples"]), k)


def compare(runs: str | Path, a: str, b: str, benchmarks: list[str] | None = None, resamples: int = 10000,
            seed: int = 0) -> dict:
    """Problem-by-problem comparison of checkpoints ``a`` and ``b`` on the benchmarks both were scored on,
    with a paired bootstrap (``resamples``, ``seed``) of each difference."""
    da, db = find_checkpoint(runs, a), find_checkpoint(runs, b)
    common = sorted(set(scored_benchmarks(da)) & set(scored_benchmarks(db)))
    if benchmarks:
        unknown = [x for x in benchmarks if x not in common]
        if unknown:
            raise ValueError(f"--benchmarks {', '.join(unknown)}: not scored for both checkpoints (common: {', '.join(common) or 'none'})")
        common = list(benchmarks)
    if not common:
        raise ValueError(f"{da.name} and {db.name} share no scored benchmark")
    out = {"a": da.name, "b": db.name, "benchmarks": {}}
    for bench in common:
        ja, jb = find_job(da, bench), find_job(db, bench)
        ra = {r["problem_id"]: r for r in problem_records(ja)}
        rb = {r["problem_id"]: r for r in problem_records(jb)}
        ids = [pid for pid in ra if pid in rb]
        rows = []
        for pid in ids:
            x, y = ra[pid]["accuracy"], rb[pid]["accuracy"]
            change = ("gained" if x == 0 and y > 0 else "lost" if x > 0 and y == 0 else
                      "same" if x == y else "changed")
            rows.append({"problem_id": pid, "a": x, "b": y, "change": change, "gold": ra[pid]["gold"],
                         "record_a": ra[pid], "record_b": rb[pid]})
        n = max(1, len(rows))
        entry = {
            "problems": len(rows),
            "pass@1_a": sum(r["a"] for r in rows) / n,
            "pass@1_b": sum(r["b"] for r in rows) / n,
            "gained": sum(r["change"] == "gained" for r in rows),
            "lost": sum(r["change"] == "lost" for r in rows),
            "changed": sum(r["change"] == "changed" for r in rows),
            "rows": rows,
            "pass@1_test": paired_bootstrap([r["a"] for r in rows], [r["b"] for r in rows], resamples, seed) if rows else None,
        }
        # Pass@k at the jobs' k (the smaller one when they differ), when both have k samples
        k = min(read_json(ja / CONFIG_FILE)["k"], read_json(jb / CONFIG_FILE)["k"])
        if rows and k > 1 and all(len(r[x]["samples"]) >= k for r in rows for x in ("record_a", "record_b")):
            pa = [_passk_values(r["record_a"], k) for r in rows]
            pb = [_passk_values(r["record_b"], k) for r in rows]
            entry.update({"k": k, "pass@k_a": sum(pa) / n, "pass@k_b": sum(pb) / n,
                          "pass@k_test": paired_bootstrap(pa, pb, resamples, seed)})
        out["benchmarks"][bench] = entry
    return out


def _delta(t: dict | None) -> str:
    """``+1.2 [-0.4, +2.8]``: the difference (B - A) and its bootstrap interval, in points."""
    if t is None:
        return ""
    lo, hi = t["ci"]
    return f"{100 * t['delta']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _p(t: dict | None) -> str:
    return "" if t is None else f"{t['p']:.2g}"


def compare_markdown(cmp: dict, max_rows: int = 50) -> str:
    out = [f"### {cmp['a']} (A) vs {cmp['b']} (B)\n",
           "| benchmark | problems | A pass@1 (%) | B pass@1 (%) | delta [95% CI] | p | gained | lost | changed |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for bench, s in cmp["benchmarks"].items():
        out.append(f"| {bench} | {s['problems']} | {100 * s['pass@1_a']:.1f} | {100 * s['pass@1_b']:.1f} | "
                   f"{_delta(s['pass@1_test'])} | {_p(s['pass@1_test'])} | {s['gained']} | {s['lost']} | {s['changed']} |")
    out.append("")
    withk = {bench: s for bench, s in cmp["benchmarks"].items() if "pass@k_test" in s}
    if withk:
        out += ["| benchmark | k | A pass@k (%) | B pass@k (%) | delta [95% CI] | p |", "|---|---:|---:|---:|---:|---:|"]
        for bench, s in withk.items():
            out.append(f"| {bench} | {s['k']} | {100 * s['pass@k_a']:.1f} | {100 * s['pass@k_b']:.1f} | "
                       f"{_delta(s['pass@k_test'])} | {_p(s['pass@k_test'])} |")
        out.append("")
    any_test = next((s["pass@1_test"] for s in cmp["benchmarks"].values() if s["pass@1_test"]), None)
    if any_test:
        out += [f"delta = B - A in points, with its paired bootstrap 95% interval over the shared problems and the "
                f"two-sided p of no difference ({any_test['resamples']} resamples, seed {any_test['seed']}).", ""]
    for bench, s in cmp["benchmarks"].items():
        moved = sorted((r for r in s["rows"] if r["change"] != "same"), key=lambda r: (-abs(r["b"] - r["a"]), r["problem_id"]))
        if not moved:
            continue
        out += [f"#### {bench}: problems whose accuracy moved (largest first)\n",
                "| problem | gold | A acc | B acc | change |", "|---|---|---:|---:|---|"]
        for r in moved[:max_rows]:
            gold = _brief(r["gold"]).replace("|", "\\|")
            out.append(f"| {r['problem_id']} | `{gold}` | {r['a']:.2f} | {r['b']:.2f} | {r['change']} |")
        if len(moved) > max_rows:
            out.append(f"\n({len(moved) - max_rows} more in the HTML page)")
        out.append("")
    return "\n".join(out)


def compare_html(cmp: dict) -> str:
    title = f"{cmp['a']} (A) vs {cmp['b']} (B)"
    body = ["<table><tr><th class=l>benchmark</th><th>problems</th><th>A pass@1 %</th><th>B pass@1 %</th>"
            "<th>delta [95% CI]</th><th>p</th><th>gained</th><th>lost</th><th>changed</th></tr>"]
    for bench, s in cmp["benchmarks"].items():
        body.append(f"<tr><td class=l>{html.escape(bench)}</td><td>{s['problems']}</td><td>{100 * s['pass@1_a']:.1f}</td>"
                    f"<td>{100 * s['pass@1_b']:.1f}</td><td>{_delta(s['pass@1_test'])}</td><td>{_p(s['pass@1_test'])}</td>"
                    f"<td>{s['gained']}</td><td>{s['lost']}</td><td>{s['changed']}</td></tr>")
    body.append("</table>")
    for bench, s in cmp["benchmarks"].items():
        body.append(f"<h2>{html.escape(bench)}</h2>")
        rows = sorted(s["rows"], key=lambda r: (r["change"] == "same", -abs(r["b"] - r["a"]), r["problem_id"]))
        for r in rows:
            cls = r["change"] if r["change"] in ("gained", "lost") else ""
            body.append(
                f"<details class=\"{cls}\"><summary>problem {html.escape(r['problem_id'])}: A {r['a']:.2f} &rarr; B {r['b']:.2f} "
                f"({html.escape(r['change'])})</summary>{_problem_head_html(r['record_a'])}"
                f"<div class=cols><div><h4>A: {html.escape(cmp['a'])}</h4>{_samples_html(r['record_a'])}</div>"
                f"<div><h4>B: {html.escape(cmp['b'])}</h4>{_samples_html(r['record_b'])}</div></div></details>")
    return _page(title, "\n".join(body))
