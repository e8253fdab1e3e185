"""Rules the whole product keeps: one-way imports between rooms, no device names outside the CPU mode."""

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = sorted(REPO.glob("openrlhf_lpo/**/*.py")) + sorted(REPO.glob("evaluation/**/*.py"))


def _room(module: str):
    parts = module.split(".")
    if parts[0] == "evaluation":
        return "evaluation"
    if parts[0] != "openrlhf_lpo":
        return None
    return parts[1] if len(parts) > 1 else "listwise"  # `from openrlhf_lpo import listwise`


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "openrlhf_lpo":
                yield from (f"openrlhf_lpo.{a.name}" for a in node.names)
            else:
                yield node.module


def room_graph():
    edges = defaultdict(set)
    for path in PRODUCT:
        src = _room(".".join(path.relative_to(REPO).with_suffix("").parts))
        for name in _imports(path):
            dst = _room(name)
            if dst and dst != src:
                edges[src].add(dst)
    return edges


def assert_acyclic(edges):
    """No cycle in the import graph ``edges`` (node -> nodes it imports); the message shows one."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            assert state.get(nxt) != "open", f"import cycle: {' -> '.join(stack + [node, nxt])}"
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_rooms_import_one_way():
    edges = room_graph()
    assert_acyclic(edges)  # no cycles between rooms
    # the rules DESIGN.md states
    assert not edges.get("listwise"), "listwise.py is pure torch: it imports nothing of ours"
    # the extension may call down into the evaluation package (training-time eval), never the reverse
    assert edges["openrlhf"] <= {"listwise", "metrics", "evaluation"}, edges["openrlhf"]
    assert not edges.get("engines"), edges.get("engines")
    assert not ({"cpu", "cpu_megatron", "openrlhf", "demo"} & edges["megatron"]), edges["megatron"]
    # evaluation reads benchmark data through the product's readers (data: code sets, Geometry3k with its
    # images) and grades with the shared grader (rewards); nothing else of the product
    assert edges["evaluation"] <= {"data", "rewards"}, edges["evaluation"]


def _code_lines(path: Path):
    for line in path.read_text().splitlines():
        code = line.split("#", 1)[0]
        if code.strip():
            yield code


def test_no_device_names_outside_the_cpu_mode():
    """Only the CPU-mode modules name a device; megatron/device.py calls megatron's seeding function,
    whose name contains the word."""
    allowed = {"openrlhf_lpo/cpu.py", "openrlhf_lpo/cpu_megatron.py"}
    pattern = re.compile(r"""["']cuda|\.cuda\(|torch\.cuda\.""")
    offenders = []
    for path in PRODUCT:
        rel = str(path.relative_to(REPO))
        if rel in allowed:
            continue
        offenders += [f"{rel}: {c.strip()}" for c in _code_lines(path) if pattern.search(c)]
    assert offenders == []
    assert len(PRODUCT) > 60  # the scan covers the whole product


def _evaluation_module_graph():
    """evaluation.<module> -> the evaluation modules it imports (relative or absolute, at any depth)."""
    edges = defaultdict(set)
    for path in sorted(REPO.glob("evaluation/*.py")):
        src = path.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    names = [node.module] if node.module else [a.name for a in node.names]
                elif node.level == 0 and node.module and node.module.split(".")[0] == "evaluation":
                    parts = node.module.split(".")
                    names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
                else:
                    continue
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("evaluation.")]
            else:
                continue
            edges[src] |= {n.split(".")[0] for n in names if n and n.split(".")[0] != src}
    return edges


def test_evaluation_modules_import_one_way():
    """The house of the evaluation package: no import cycle between its modules (lazy imports count), and
    the benchmark families register into the registry while only evaluation.benchmarks imports them."""
    edges = _evaluation_module_graph()
    assert_acyclic(edges)
    families = {"text_benchmarks", "code_benchmarks", "vision"}
    assert families <= edges["benchmarks"], edges["benchmarks"]
    assert not (edges["benchmark_registry"] & (families | {"benchmarks"})), edges["benchmark_registry"]
    importers = {m for m, dst in edges.items() if dst & families}
    assert importers == {"benchmarks"}, importers
    assert all("benchmark_registry" in edges[f] and "benchmarks" not in edges[f] for f in families)
