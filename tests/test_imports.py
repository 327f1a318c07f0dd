"""Who may import whom (DESIGN.md): server -> engine core -> model -> kernels -> numerics.

Checked statically with `ast` over every import in engine/ (module level and inside functions;
relative imports resolved), so a lazy in-function import cannot hide a cycle:
(a) engine/kernels/* import only torch, triton, the stdlib, engine.numerics and engine.kernels.*;
    engine/numerics.py imports only torch and the stdlib.
(b) no import cycle among the modules of engine/. An import of a package (engine.model) counts
    as an edge to its __init__ module; `from pkg import name` counts as an edge to pkg.name when
    that is a module, else to pkg itself.
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ENGINE.rglob("*.py")}


def _is_package(mod: str) -> bool:
    return MODULES.get(mod, Path()).name == "__init__.py"


def imports_of(mod: str) -> set[str]:
    """Every module name `mod` imports (absolute, resolved; not only engine's)."""
    path = MODULES[mod]
    pkg = mod if _is_package(mod) else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            out.update(subs)
            if len(subs) < len(node.names):      # names defined in target itself
                out.add(target)
    return out


def _engine_edges(mod: str) -> set[str]:
    """Imports of engine modules, each mapped to the module that exists (engine.a.b.c -> engine.a.b)."""
    edges = set()
    for name in imports_of(mod):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != mod:
            edges.add(name)
    return edges


def test_kernels_are_a_leaf():
    bad = []
    for mod in sorted(MODULES):
        if mod == "engine.kernels" or mod.startswith("engine.kernels."):
            for name in imports_of(mod):
                top = name.split(".")[0]
                if top == "engine":
                    if not (name == "engine.numerics" or name == "engine.kernels" or name.startswith("engine.kernels.")):
                        bad.append(f"{mod} imports {name}")
                elif top not in ("torch", "triton") and top not in sys.stdlib_module_names:
                    bad.append(f"{mod} imports {name}")
    assert "engine.numerics" in MODULES
    for name in imports_of("engine.numerics"):
        if name.split(".")[0] != "torch" and name.split(".")[0] not in sys.stdlib_module_names:
            bad.append(f"engine.numerics imports {name}")
    assert not bad, "\n".join(bad)


def find_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (or a self-loop), each sorted."""
    graph = {m: _engine_edges(m) for m in MODULES}
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):                                   # Tarjan, recursive (the graph is small)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(comps)


def test_import_graph_helpers():
    """The resolver itself: relative imports, in-function imports, package vs module targets."""
    assert "engine.kernels.common" in imports_of("engine.kernels.fp8_gemm")
    assert "engine.numerics" in imports_of("engine.model.compressor")            # from ..numerics import ...
    assert "engine.kernels.fused_moe" in imports_of("engine.model.moe")          # from ..kernels.fused_moe import ...
    assert "engine.kernels.split_bf16" not in imports_of("engine.model.block")   # a name, resolved to its module
    assert "engine.kernels.bf16_gemm" in imports_of("engine.model.block")


def test_no_import_cycles():
    """Before engine/kernels became a leaf this found the five kernels <-> model pairs (act_sim,
    fused_moe, indexer, rms_norm, sparse_attn). Importing engine.x.y also runs engine/__init__
    (which imports engine.llm) at runtime; those implicit parent-package imports are not edges here."""
    cycles = find_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)
