"""Every result file the repository cites exists: a ``benchmarks/results/NAME`` (or ``results/NAME``) path in
the README, docs/, benchmarks/, triton_ep/ and tests/ names a file of the tree, and a ``COMMIT:benchmarks/results/NAME``
citation (a file that has left the tree, as ``git show`` takes it: docs/history.md) names one of that commit.
Brace and ``*`` forms (``..._t{128,4096}.json``, ``..._sweep_*.json``) are expanded; each must match."""
from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: a cited result file: an optional commit, the folder, a name with braces or stars
CITE = re.compile(r"(?:\b([0-9a-f]{7,40}):)?(?:benchmarks/)?results/([A-Za-z0-9_{},*.-]+\.(?:json|png|txt))")
#: where citations live
PLACES = ("README.md", "docs", "benchmarks", "triton_ep", "tests", "scripts", "examples")


def expand(name: str) -> list:
    """``a{b,c}d`` -> ``[abd, acd]`` (nested braces expanded left to right)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for alt in m.group(1).split(",") for n in expand(name[:m.start()] + alt + name[m.end():])]


def citations() -> list:
    """``(file, commit or None, name)`` of every citation in the places above."""
    out = []
    for place in PLACES:
        path = ROOT / place
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".md", ".py", ".sh"))
        for f in files:
            if f == Path(__file__).resolve():
                continue
            for m in CITE.finditer(f.read_text(errors="replace")):
                for name in expand(m.group(2)):
                    out.append((str(f.relative_to(ROOT)), m.group(1), name))
    return out


def tree_at(commit: str) -> list:
    r = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", commit, "benchmarks/results/"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"git cannot list commit {commit} here (not a git checkout, or a shallow one)")
    return [Path(p).name for p in r.stdout.split()]


def test_there_are_citations():
    found = citations()
    assert any(c is None for _, c, _ in found) and any(c for _, c, _ in found), found


def test_cited_results_in_the_tree_exist():
    have = sorted(p.name for p in RESULTS.iterdir())
    missing = [(f, n) for f, c, n in citations() if c is None and not fnmatch.filter(have, n)]
    assert not missing, f"cited result files that are not in benchmarks/results/: {missing}"


def test_cited_results_of_a_commit_exist_there():
    missing = []
    by_commit = {}
    for f, c, n in citations():
        if c is not None:
            by_commit.setdefault(c, []).append((f, n))
    for commit, cited in by_commit.items():
        have = tree_at(commit)
        missing += [(f, f"{commit}:{n}") for f, n in cited if not fnmatch.filter(have, n)]
    assert not missing, f"cited result files that commit does not hold: {missing}"
