"""Rules the whole product keeps: one-way imports between rooms, no device names outside the CPU mode."""

import ast
import re
import sys
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


def _imports(path: Path, resolve: bool = False):
    """Modules ``path`` imports; ``resolve``: ``from package import module`` as ``package.module``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if node.module == "openrlhf_lpo" or (resolve and (REPO / (sub.replace(".", "/") + ".py")).exists()):
                    yield sub
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


# the leaves every room may import, each built on the standard library and the leaves before it alone: named
# registries (openrlhf_lpo/registry/), then the patch-point registry (openrlhf_lpo/upstream/), where every backend,
# the CPU mode and the CLI register how they touch the packages they extend
LEAVES = ("registry", "upstream")


def test_rooms_import_one_way():
    edges = room_graph()
    assert_acyclic(edges)  # no cycles between rooms
    for i, leaf in enumerate(LEAVES):
        below = set(LEAVES[:i])
        assert edges.get(leaf, set()) <= below, (leaf, edges.get(leaf))
        leaf_files = sorted(REPO.glob(f"openrlhf_lpo/{leaf}/**/*.py"))
        assert leaf_files and any(leaf in dst for dst in edges.values())  # the leaf is there, and in use
        for path in leaf_files:
            outside = {n for n in _imports(path) if n.split(".")[0] not in sys.stdlib_module_names and
                       _room(n) not in below}
            assert not outside, (path.name, outside)
    # every room that patches upstream registers through the leaf: the two backends, the CPU mode, the CLI, checks
    assert all("upstream" in edges[room] for room in ("openrlhf", "megatron", "cpu", "cli", "checks")), edges
    edges = defaultdict(set, {src: dst - set(LEAVES) for src, dst in edges.items()})  # the rules below: the rest
    # the project's layout rules (docs/architecture.md)
    assert not edges.get("listwise"), "listwise.py is pure torch: it imports nothing of ours but the leaf"
    # the backend-free core sits on listwise alone, and nothing in it imports OpenRLHF or megatron-core
    assert edges.get("core", set()) <= {"listwise"}, edges.get("core")
    for path in REPO.glob("openrlhf_lpo/core/*.py"):
        foreign = {n for n in _imports(path) if n.split(".")[0] in ("openrlhf", "megatron", "deepspeed", "vllm", "ray")}
        assert not foreign, (path.name, foreign)
    # the extension may call down into the evaluation package (training-time eval), never the reverse;
    # runtime/ (HF export rotation and the weight-sync parity probe, shared by both backends) sits on data alone; the rollout engines' per-sample
    # settings (engines/responses.py) are what vLLM's actor gets too (openrlhf/seeded_vllm.py)
    assert edges["openrlhf"] <= {"listwise", "core", "evaluation", "runtime", "engines", "rewards"}, \
        edges["openrlhf"]
    assert edges.get("runtime", set()) <= {"data"}, edges.get("runtime")  # the probe draws a geometry diagram
    assert not edges.get("engines"), edges.get("engines")
    # the two backends share the core, never each other
    assert not ({"cpu", "demo", "openrlhf", "checks", "testing"} & edges["megatron"]), edges["megatron"]
    assert "megatron" not in edges["openrlhf"], edges["openrlhf"]
    # evaluation reads benchmark data through the product's readers (data: code sets, Geometry3k with its
    # images) and grades with the shared grader (rewards); nothing else of the product
    assert edges["evaluation"] <= {"data", "rewards"}, edges["evaluation"]
    # every module sits in a room named by its concern: listwise.py (the public math) is the only loose one
    loose = sorted(p.name for p in (REPO / "openrlhf_lpo").glob("*.py") if p.name != "__init__.py")
    assert loose == ["listwise.py"], loose


def _code_lines(path: Path):
    for line in path.read_text().splitlines():
        code = line.split("#", 1)[0]
        if code.strip():
            yield code


def test_no_device_names_outside_the_cpu_mode():
    """Only the CPU-mode modules name a device; megatron/device.py calls megatron's seeding function,
    whose name contains the word. One table may name it as data: ``evaluation/dp.py``'s map from torch's
    accelerator type to the variable that restricts a process to some devices (no code path on it)."""
    allowed = {"openrlhf_lpo/cpu/mode.py", "openrlhf_lpo/cpu/megatron_redirect.py"}
    tables = {("evaluation/dp.py", "DEVICE_ENV = {"), ("openrlhf_lpo/cli/gpu_build.py", "BUILD_NAMES = {")}
    pattern = re.compile(r"""["']cuda|\.cuda\(|torch\.cuda\.""")
    offenders = []
    for path in PRODUCT:
        rel = str(path.relative_to(REPO))
        if rel in allowed:
            continue
        offenders += [f"{rel}: {c.strip()}" for c in _code_lines(path)
                      if pattern.search(c) and not any(rel == f and c.startswith(t) for f, t in tables)]
    assert offenders == []
    assert len(PRODUCT) > 60  # the scan covers the whole product


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def module_graph(paths):
    """Module -> modules of ours it imports (at any depth of the file, relative imports resolved)."""
    names = {_module_name(p): p for p in paths}
    edges = defaultdict(set)
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            edges[name] |= {t for t in targets if t in names and t != name}
    return edges


def test_product_modules_import_one_way():
    """No two modules of the product import each other, directly or around a loop (the CPU engine and its
    image backends did: cpu_engine -> cpu_vlm -> cpu_engine); evaluation/ is checked by its own rules."""
    edges = module_graph(sorted(REPO.glob("openrlhf_lpo/**/*.py")))
    assert_acyclic(edges)
    assert edges["openrlhf_lpo.engines.cpu_engine"] >= {"openrlhf_lpo.engines.cpu_vlm", "openrlhf_lpo.engines.backends"}
    assert edges["openrlhf_lpo.engines.cpu_vlm"] == {"openrlhf_lpo.engines.backends"}


def _evaluation_module_graph():
    """evaluation.<module> -> the evaluation modules it imports (relative or absolute, at any depth)."""
    edges = module_graph(sorted(REPO.glob("evaluation/*.py")))
    short = lambda module: module.rpartition(".")[2]  # noqa: E731
    return defaultdict(set, {short(m): {short(d) for d in dst} for m, dst in edges.items()})


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


def test_backends_are_looked_up_not_compared_by_name():
    """What differs between the training backends is an entry of the table (core/training_backends.py) or a flag
    group bound to a backend, never a comparison of ``--backend`` with a name."""
    pattern = re.compile(r"""[!=]=\s*["'](deepspeed|megatron)["']|["'](deepspeed|megatron)["']\s*[!=]=""")
    offenders = [f"{path.relative_to(REPO)}: {c.strip()}" for path in PRODUCT for c in _code_lines(path)
                 if pattern.search(c)]
    assert offenders == []
    assert pattern.search('if getattr(args, "backend", "deepspeed") == "megatron":')  # (the pattern sees the old form)
