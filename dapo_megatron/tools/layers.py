"""The layer contract of dapo_megatron and dapo_kernels, checked over the import graph (no import runs).

    python -m dapo_megatron.tools.layers              # the report: layers, cycles, upward imports, cfg files
    python -m dapo_megatron.tools.layers --check      # exit 1 on any violation (tests/unit/test_layers.py)

Packages sit in layers (LAYERS, top to bottom, the map of docs/architecture.md "Layout"); a module may
import only from its own package or a lower layer. The graph is read from the source with `ast`, so
every import counts, the ones inside functions too: an import inside a function may not reach a
package the module-level imports could not reach either. A function-level import of a package at or
below the importer's layer is allowed (start-up time: megatron-core alone takes seconds); a function-
level import of a *heavy optional dependency* is fine as well and is not our concern here.

What is checked:
  * no import of a higher layer (upward), at module or function level;
  * no cycle between packages (two packages importing each other, or a longer loop);
  * no cycle between modules, deferred (function-level) imports included;
  * packages on the same layer stay independent (INDEPENDENT) where the map says so;
  * dapo_kernels imports nothing from dapo_megatron (not even its top-level package).
A function-level import is checked like any other, so deferring an import never dodges a layer; what
may be imported lazily is a matter of start-up time only. The checker reports counts too (`report`), used for the
before/after of the
layout issue: cycles, upward imports, files with functions taking the whole Config.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

# launch/'s own modules (files in launch/, not its subpackages), shared by every part of it: the run directory
# and its lock, the tiny model's preparation, the prompt data's check, an engine's environment, how entry
# points end. A package with mapped subpackages covers only its __init__ (layer_of), so each is named here
# and a new one must be placed (as shared, or in a subpackage)
LAUNCH_SHARED: tuple[str, ...] = tuple(
    f"dapo_megatron.launch.{name}"
    for name in ("data_check", "engine_env", "prepare", "run_dir", "run_lock", "script_entry")
)

# top to bottom; each entry is one layer of packages (dotted, under dapo_megatron unless noted).
# Packages on one layer may not import each other unless they share a name prefix (a package and its
# own subpackages).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dapo_megatron.cli",),
    ("dapo_megatron.benchmarks", "dapo_megatron.tools"),  # harness: measures and checks everything below
    # launch/ by what it launches, in three layers (docs/architecture.md "Layout"): what is built on a
    # launcher (experiments/: the ladder runs `train` here under local/'s lifeline; preflight/: its job is
    # rendered by launch/slurm/render.py and runs as the Slurm jobs do; run_status: `status` of local and Slurm
    # runs), the two launchers (local/, slurm/), and what both use (launch/'s own modules)
    ("dapo_megatron.launch.experiments", "dapo_megatron.launch.preflight", "dapo_megatron.launch.run_status"),
    ("dapo_megatron.launch.local", "dapo_megatron.launch.slurm"),
    ("dapo_megatron.launch", *LAUNCH_SHARED),
    # the product's loop and the CPU stand-in for SGLang side by side: neither imports the other (the
    # stand-in plays the engine side of transfer/, so it sits above it; launch/ starts it)
    ("dapo_megatron.trainer", "dapo_megatron.cpu_engine"),
    ("dapo_megatron.transfer",),
    ("dapo_megatron.rollout",),
    ("dapo_megatron.actor",),
    ("dapo_megatron.weights",),
    ("dapo_megatron.dataplane", "dapo_megatron.memplan", "dapo_megatron.quant"),
    ("dapo_megatron.distributed",),  # layout, collectives, driver_decides, roles, routed addresses
    ("dapo_megatron.algo", "dapo_megatron.reward", "dapo_megatron.data"),
    ("dapo_megatron.config",),
    ("dapo_kernels",),
    ("dapo_megatron",),  # the package's own __init__ (a version string)
)
# same-layer packages that must not import each other
INDEPENDENT: tuple[tuple[str, ...], ...] = (
    ("dapo_megatron.benchmarks", "dapo_megatron.tools"),
    ("dapo_megatron.launch.experiments", "dapo_megatron.launch.preflight", "dapo_megatron.launch.run_status"),
    ("dapo_megatron.launch.local", "dapo_megatron.launch.slurm"),
    ("dapo_megatron.trainer", "dapo_megatron.cpu_engine"),
    ("dapo_megatron.dataplane", "dapo_megatron.memplan", "dapo_megatron.quant"),
    ("dapo_megatron.algo", "dapo_megatron.reward", "dapo_megatron.data"),
)


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    target: str  # module (or package) name, resolved
    line: int
    in_function: bool
    path: str


@dataclass
class Graph:
    modules: dict[str, Path]  # module name -> file
    imports: list[Import] = field(default_factory=list)

    def edges(self, *, module_level_only: bool = False) -> set[tuple[str, str]]:
        resolved = (
            (i.importer, self.resolve(i.target)) for i in self.imports if not (module_level_only and i.in_function)
        )
        return {(importer, target) for importer, target in resolved if target}

    def resolve(self, name: str) -> str | None:
        """The longest known module that `name` is or lies in (``a.b.c`` of ``from a.b import c``)."""
        while name:
            if name in self.modules:
                return name
            name = name.rpartition(".")[0]
        return None


def module_name(root: Path, path: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def read_graph(packages: dict[str, Path]) -> Graph:
    """packages: import name -> its folder (dapo_kernels -> kernels/)."""
    modules: dict[str, Path] = {}
    for package, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            if ".shim" in path.parts or "__pycache__" in path.parts:
                continue
            modules[module_name(root, path, package)] = path
    graph = Graph(modules)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, in_function in _walk(tree, False):
            for target in _targets(node, name, is_package):
                if target.split(".")[0] in packages:
                    graph.imports.append(Import(name, target, node.lineno, in_function, str(path)))
    return graph


def _walk(node: ast.AST, in_function: bool):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = importer.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([base] if base else []))
    return [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(layer index, package) of the longest package prefix of `module`; 0 is the top."""
    best = None
    everything = [name for names in layers for name in names]
    for index, names in enumerate(layers):
        for package in names:
            # a root with mapped subpackages (dapo_megatron) holds only its own __init__: a new folder
            # under it must be placed in a layer, not fall to the bottom
            is_root = any(other.startswith(package + ".") for other in everything)
            covers = module == package or (not is_root and module.startswith(package + "."))
            if covers and (best is None or len(package) > len(best[1])):
                best = (index, package)
    return best


def unit_edges(graph: Graph, layers=LAYERS) -> dict[tuple[str, str], list[Import]]:
    """package -> package edges (both in the layer map), with the imports behind each."""
    out: dict[tuple[str, str], list[Import]] = {}
    for imp in graph.imports:
        target = graph.resolve(imp.target)
        a, b = layer_of(imp.importer, layers), layer_of(target or "", layers)
        if a and b and a[1] != b[1]:
            out.setdefault((a[1], b[1]), []).append(imp)
    return out


def cycles(nodes, edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        if a != b and a in succ and b in succ:
            succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@dataclass
class Report:
    upward: list[Import]
    same_layer: list[Import]  # between INDEPENDENT packages
    package_cycles: list[list[str]]
    module_cycles: list[list[str]]
    unmapped: list[str]  # modules in no layer
    function_imports: int
    module_imports: int

    @property
    def violations(self) -> list[str]:
        out = [
            f"upward import: {i.importer} -> {i.target} ({i.path}:{i.line}{', in a function' if i.in_function else ''})"
            for i in self.upward
        ]
        out += [
            f"import between independent packages: {i.importer} -> {i.target} ({i.path}:{i.line})"
            for i in self.same_layer
        ]
        out += [f"package cycle: {' <-> '.join(c)}" for c in self.package_cycles]
        out += [f"module import cycle: {' <-> '.join(c)}" for c in self.module_cycles]
        out += [f"module in no layer (add its package to tools/layers.py LAYERS): {m}" for m in self.unmapped]
        return out


def check(graph: Graph, layers=LAYERS, independent=INDEPENDENT) -> Report:
    upward, same, seen = [], [], set()
    for imp in graph.imports:
        target = graph.resolve(imp.target)
        a, b = layer_of(imp.importer, layers), layer_of(target or "", layers)
        if not a or not b or not target or a[1] == b[1]:
            continue
        key = (imp.importer, target, imp.line)  # `from x import a, b`: one import statement, counted once
        if key in seen:
            continue
        seen.add(key)
        if b[0] < a[0] or (a[1] == "dapo_kernels" and target.startswith("dapo_megatron")):
            upward.append(imp)
        elif b[0] == a[0] and any(a[1] in g and b[1] in g for g in independent):
            same.append(imp)
    units = {layer[1] for m in graph.modules if (layer := layer_of(m, layers))}
    package_edges = set(unit_edges(graph, layers))
    return Report(
        upward=upward,
        same_layer=same,
        package_cycles=cycles(units, package_edges),
        module_cycles=cycles(graph.modules, graph.edges()),  # deferred imports too: a cycle is a cycle
        unmapped=sorted(m for m in graph.modules if layer_of(m, layers) is None),
        function_imports=sum(i.in_function for i in graph.imports),
        module_imports=sum(not i.in_function for i in graph.imports),
    )


def whole_config_files(root: Path) -> list[str]:
    """Files defining a function that takes the whole Config (a parameter named `cfg` or annotated
    `Config`): where the whole configuration travels."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(
                    a.arg == "cfg"
                    or (
                        a.annotation is not None
                        and ast.unparse(a.annotation).strip("'\"") in ("Config", "config.Config")
                    )
                    for a in args
                ):
                    out.append(str(path.relative_to(root.parent)))
                    break
    return out


def repo_packages(repo: Path) -> dict[str, Path]:
    return {"dapo_megatron": repo / "dapo_megatron", "dapo_kernels": repo / "kernels"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dapo_megatron.tools.layers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[2]))
    parser.add_argument("--check", action="store_true", help="exit 1 if the contract is broken")
    args = parser.parse_args(argv)
    repo = Path(args.repo)
    graph = read_graph(repo_packages(repo))
    report = check(graph)
    cfg_files = whole_config_files(repo / "dapo_megatron")
    print(
        f"modules: {len(graph.modules)}; imports of our own modules: {report.module_imports} at module "
        f"level, {report.function_imports} inside functions"
    )
    print(
        f"package cycles: {len(report.package_cycles)}; module import cycles: {len(report.module_cycles)}; "
        f"upward imports: {len(report.upward)}; between independent packages: {len(report.same_layer)}"
    )
    print(f"files with a function taking the whole Config: {len(cfg_files)}")
    for name in cfg_files:
        print(f"  {name}")
    for line in report.violations:
        print(line)
    return 1 if args.check and report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
