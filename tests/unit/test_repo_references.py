"""Every file the repository's code, configs and docs refer to exists in the repository: repo paths
(docs/..., configs/..., dapo_megatron/...), relative markdown links, and bare *.md names.

    pytest tests/unit/test_repo_references.py
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {
    ".git",
    ".venv",
    "venv",
    "outputs",
    "runs",
    "results",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    "wandb",
    ".whl",
    ".gl",
}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".txt", ".cfg"}
ROOTS = ("docs", "configs", "slurm", "tests", "kernels", "dapo_megatron", ".ci")
# a path under one of the repository's top-level folders, ending in a file suffix
REPO_PATH = re.compile(
    r"(?<![\w/.<$-])((?:"
    + "|".join(re.escape(r) for r in ROOTS)
    + r")/[\w./-]*\w\.(?:md|py|yaml|sh|sbatch|json|toml))\b"
)
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
BARE_MD = re.compile(r"(?<![\w/.-])([A-Za-z_][\w-]*\.md)\b")
# files a run or a job writes (relative to a run directory), named in code and docs: not repo files
GENERATED = {"slurm/config.yaml", "slurm/eval_config.yaml", "slurm/jobs.json", "results.md", "ablation_summary.md"}


def _files() -> list[Path]:
    out = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            out.append(path)
    return out


def test_every_referenced_file_exists():
    files = _files()
    names = {p.name for p in files}
    missing = []
    for path in files:
        text = path.read_text(errors="replace")
        rel = path.relative_to(REPO)
        for number, line in enumerate(text.splitlines(), start=1):
            for ref in REPO_PATH.findall(line):
                if ref not in GENERATED and not (REPO / ref).exists():
                    missing.append(f"{rel}:{number}: {ref}")
            if path.suffix == ".md":
                for link in MD_LINK.findall(line):
                    if "://" in link or link.startswith("mailto:"):
                        continue
                    if not (path.parent / link).resolve().exists():
                        missing.append(f"{rel}:{number}: link {link}")
            for name in BARE_MD.findall(line):
                if name not in names and name not in GENERATED:
                    missing.append(f"{rel}:{number}: {name}")
    assert not missing, "references to files that are not in the repository:\n" + "\n".join(missing)
