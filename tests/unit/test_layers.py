"""The layer contract (dapo_megatron/tools/layers.py): the repository keeps it, and the checker catches
each way of breaking it (an upward import at module level or hidden in a function, a cycle, a package
in no layer, dapo_kernels importing dapo_megatron, siblings importing each other).

    pytest tests/unit/test_layers.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dapo_megatron.tools import layers

REPO = Path(__file__).resolve().parents[2]


def test_the_repository_keeps_the_layer_contract():
    report = layers.check(layers.read_graph(layers.repo_packages(REPO)))
    assert report.violations == [], "\n".join(report.violations)


def test_every_package_of_the_source_tree_is_in_a_layer_and_installed():
    """A new folder must be placed in LAYERS and be a package (setup.py's discovery installs folders
    with an __init__.py; tests/integration/test_wheel_install.py builds the wheel)."""
    mapped = {name for layer in layers.LAYERS for name in layer}
    folders = sorted({path.parent for path in (REPO / "dapo_megatron").rglob("*.py")} - {REPO / "dapo_megatron"})
    for folder in folders:
        if "__pycache__" in folder.parts:
            continue
        package = ".".join(folder.relative_to(REPO).parts)
        assert (folder / "__init__.py").is_file(), f"{package} has no __init__.py: setup.py would not install it"
        assert any(package == m or package.startswith(m + ".") for m in mapped), f"{package} is in no layer"


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"pkg": root}


LAYERS = (("pkg.top",), ("pkg.mid", "pkg.side"), ("pkg.low",), ("pkg",))
INDEPENDENT = (("pkg.mid", "pkg.side"),)


def _check(tmp_path, files):
    graph = layers.read_graph(
        _package(
            tmp_path,
            {
                "__init__.py": "",
                "top/__init__.py": "",
                "mid/__init__.py": "",
                "side/__init__.py": "",
                "low/__init__.py": "",
                **files,
            },
        )
    )
    return layers.check(graph, layers=LAYERS, independent=INDEPENDENT)


def test_a_clean_synthetic_package_passes(tmp_path):
    report = _check(
        tmp_path,
        {
            "top/a.py": "from pkg.mid import b\n",
            "mid/b.py": "from pkg.low.c import f\n",
            "low/c.py": "def f():\n    return 1\n",
        },
    )
    assert report.violations == []
    assert (report.module_imports, report.function_imports) == (2, 0)


def test_an_upward_import_is_flagged_at_module_level_and_inside_a_function(tmp_path):
    report = _check(
        tmp_path,
        {
            "top/a.py": "X = 1\n",
            "mid/b.py": "def g():\n    from pkg.top.a import X  # deferred: still upward\n    return X\n",
            "low/c.py": "from pkg.mid import b\n",
        },
    )
    flagged = sorted(
        (i.importer, layers.Graph.resolve(layers.read_graph({"pkg": tmp_path / "pkg"}), i.target), i.in_function)
        for i in report.upward
    )
    assert flagged == [("pkg.low.c", "pkg.mid.b", False), ("pkg.mid.b", "pkg.top.a", True)]
    assert len(report.violations) == 2 + len(report.package_cycles)


def test_a_cycle_is_flagged_for_packages_and_modules(tmp_path):
    """Two modules importing each other, one of them only inside a function (the console <-> metrics
    loop of the old layout): still a cycle."""
    report = _check(
        tmp_path,
        {
            "low/x.py": "from pkg.low import y\n",
            "low/y.py": "def f():\n    from pkg.low import x\n    return x\n",
        },
    )
    assert report.module_cycles == [["pkg.low.x", "pkg.low.y"]]
    assert any("module import cycle" in v for v in report.violations)


def test_siblings_of_one_layer_and_unmapped_packages_are_flagged(tmp_path):
    report = _check(
        tmp_path,
        {
            "mid/b.py": "from pkg.side import s\n",
            "side/s.py": "",
            "stray/__init__.py": "",
        },
    )
    assert [(i.importer, i.target) for i in report.same_layer] == [("pkg.mid.b", "pkg.side.s")]
    assert report.unmapped == ["pkg.stray"]


def test_an_upward_import_injected_into_a_copy_of_the_repository_is_caught(tmp_path):
    """The real tree, with one deferred import from algo/ (the bottom) up to trainer/: flagged, with its line."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "dapo_megatron", copy / "dapo_megatron", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "kernels", copy / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    kl = copy / "dapo_megatron" / "algo" / "kl.py"
    kl.write_text(
        kl.read_text() + "\n\ndef _sneaky():\n    from dapo_megatron.trainer import train\n    return train\n"
    )
    bench = copy / "kernels" / "bench" / "common.py"
    bench.write_text(bench.read_text() + "\nimport dapo_megatron\n")
    report = layers.check(layers.read_graph(layers.repo_packages(copy)))
    assert sorted((i.importer, i.target, i.in_function) for i in report.upward) == [
        ("dapo_kernels.bench.common", "dapo_megatron", False),
        ("dapo_megatron.algo.kl", "dapo_megatron.trainer.train", True),
    ]


def test_launch_parts_import_only_downward_through_the_documented_directions(tmp_path):
    """launch/ in three layers: a launcher importing the other (slurm/ -> local/), the shared level importing
    a launcher (run_dir -> slurm/), a launcher importing what is built on it (local/ -> experiments/) and
    one part built on a launcher importing another (experiments/ -> preflight/) are each flagged; the
    documented directions (experiments/ -> local/, preflight/ -> slurm/, run_status -> slurm/) are not."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "dapo_megatron", copy / "dapo_megatron", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "kernels", copy / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    package = copy / "dapo_megatron"
    injected = {
        "launch/slurm/submit.py": "from dapo_megatron.launch.local import launcher\n",
        "launch/run_dir.py": "def _f():\n    from dapo_megatron.launch.slurm import status\n    return status\n",
        "launch/local/stop.py": "from dapo_megatron.launch.experiments import gather\n",
        "launch/experiments/gather.py": "from dapo_megatron.launch.preflight import report\n",
    }
    for rel, text in injected.items():
        (package / rel).write_text((package / rel).read_text() + "\n" + text)
    report = layers.check(layers.read_graph(layers.repo_packages(copy)))
    assert sorted((i.importer, i.target) for i in report.upward) == [
        ("dapo_megatron.launch.local.stop", "dapo_megatron.launch.experiments.gather"),
        ("dapo_megatron.launch.run_dir", "dapo_megatron.launch.slurm.status"),
    ]
    assert sorted((i.importer, i.target) for i in report.same_layer) == [
        ("dapo_megatron.launch.experiments.gather", "dapo_megatron.launch.preflight.report"),
        ("dapo_megatron.launch.slurm.submit", "dapo_megatron.launch.local.launcher"),
    ]
    # the clean tree: which part of launch/ imports which other, the shared level left out
    graph = layers.read_graph(layers.repo_packages(REPO))
    shared = set(layers.LAUNCH_SHARED)
    part = {m: m.split(".")[2] for m in graph.modules if m.startswith("dapo_megatron.launch.")}
    crossing = {(part[a], part[b]) for a, b in graph.edges() if a in part and b in part and b not in shared}
    crossing = {(a, b) for a, b in crossing if a != b}
    assert crossing == {("experiments", "local"), ("preflight", "slurm"), ("run_status", "slurm")}


def test_the_whole_config_stops_at_the_trainer_and_the_command_line():
    """Files with a function taking the whole Config (`cfg` or `Config`): only trainer/, launch/, the
    command line, the config itself and the harness (benchmarks/, tools/); layers below get sections."""
    allowed = (
        "dapo_megatron/trainer/",
        "dapo_megatron/launch/",
        "dapo_megatron/benchmarks/",
        "dapo_megatron/tools/",
        "dapo_megatron/config.py",
        "dapo_megatron/cli.py",
    )
    files = layers.whole_config_files(REPO / "dapo_megatron")
    below = [f for f in files if not f.startswith(allowed)]
    assert below == sorted(KNOWN_BELOW), f"files below the trainer that take the whole Config: {below}"


# below the trainer and still taking the whole Config: the memory plan, which is the plan of a whole run
# (every section shapes some phase's bytes: actor layout, engines, batch sizes, the model or tiny.*)
KNOWN_BELOW = [
    "dapo_megatron/memplan/arch.py",
    "dapo_megatron/memplan/megatron_reference.py",
    "dapo_megatron/memplan/plan.py",
    "dapo_megatron/memplan/report.py",
]


def _architecture_layout() -> str:
    """The code block of docs/architecture.md "Layout"."""
    text = (REPO / "docs" / "architecture.md").read_text()
    layout = text[text.index("## Layout") :]
    layout = layout[layout.index("```") + 3 :]
    return layout[: layout.index("```")]


def _entries(layout: str, *, indent: int) -> list[str]:
    """The names the layout lists at `indent` spaces (continuation lines are indented further)."""
    return [
        line.split()[0].rstrip("/")
        for line in layout.splitlines()
        if line.startswith(" " * indent) and line[indent] != " "
    ]


def test_the_architecture_page_lists_every_package():
    """docs/architecture.md "Layout": one entry per package of dapo_megatron, in the layers' order."""
    layout = _architecture_layout()
    listed = _entries(layout, indent=2)
    packages = sorted(p.parent.name for p in (REPO / "dapo_megatron").glob("*/__init__.py"))
    assert sorted(name for name in listed if not name.endswith(".py")) == packages
    order = [name for layer in layers.LAYERS for name in layer if name.startswith("dapo_megatron.")]
    rank = {name.split(".")[1]: index for index, name in enumerate(order)}
    assert [rank[n] for n in listed if n in rank] == sorted(rank[n] for n in listed if n in rank)


def test_the_architecture_page_lists_every_launch_subpackage():
    """docs/architecture.md "Layout": launch/'s subpackages (by what they launch), one entry each under it."""
    layout = _architecture_layout()
    listed = _entries(layout[layout.index("  launch/") : layout.index("  trainer/")], indent=4)
    packages = sorted(p.parent.name for p in (REPO / "dapo_megatron" / "launch").glob("*/__init__.py"))
    assert packages == ["experiments", "local", "preflight", "slurm"]
    assert sorted(listed) == packages
