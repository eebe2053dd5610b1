"""Which imported modules Python compiled from source at this start: no cached bytecode.

Python caches a module's compiled bytecode beside its source (`__pycache__/*.pyc`), and pip
writes it at install time. Where none was written (an install made with `--no-compile`, a
read-only or bytecode-less image) and PYTHONDONTWRITEBYTECODE is set, every process compiles
what it imports again: torch, Inductor and sympy are thousands of modules, seconds of a cold
start (`fuser serve` prints them under its cold-start table: `note`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from dataclasses import dataclass

__all__ = ["Uncached", "uncached_modules"]


@dataclass(frozen=True)
class Uncached:
    """Imported source modules without cached bytecode: how many per top-level package, and
    per package the fewest directories that hold them all (what `python -m compileall`
    takes)."""

    counts: dict[str, int]
    directories: dict[str, list[str]]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def note(self, most: int = 4) -> str | None:
        """One line for a person, or None when every imported module had its bytecode."""
        if not self.total:
            return None
        largest = sorted(self.counts.items(), key=lambda kv: -kv[1])[:most]
        packages = ", ".join(f"{name} {count:,}" for name, count in largest)
        dirs = " ".join(dict.fromkeys(d for name, _ in largest for d in self.directories[name]))
        why = " (PYTHONDONTWRITEBYTECODE is set)" if sys.flags.dont_write_bytecode else ""
        return (f"{self.total:,} imported modules had no cached bytecode and were compiled at "
                f"this start{why}: {packages}; `python -m compileall -q {dirs}` once makes "
                f"later starts skip that")


def uncached_modules(modules: dict[str, object] | None = None) -> Uncached:
    """The imported modules (default sys.modules) loaded from a .py source whose cached
    bytecode file does not exist, by top-level package."""
    counts: Counter[str] = Counter()
    found: dict[str, set[str]] = {}
    for name, module in list((sys.modules if modules is None else modules).items()):
        path = getattr(module, "__file__", None)
        spec = getattr(module, "__spec__", None)
        if not path or not path.endswith(".py") or spec is None \
                or not getattr(spec, "cached", None) or name == "__main__":
            continue
        try:
            cached = importlib.util.cache_from_source(path)
        except (NotImplementedError, ValueError):  # (no cache tag: bytecode never cached)
            continue
        if os.path.exists(cached):
            continue
        top = name.partition(".")[0]
        counts[top] += 1
        found.setdefault(top, set()).add(os.path.dirname(path))
    return Uncached(dict(counts), {top: _roots(dirs) for top, dirs in found.items()})


def _roots(directories: set[str]) -> list[str]:
    """The directories of `directories` that lie under none of the others, sorted."""
    roots: list[str] = []
    for d in sorted(directories):  # (a parent sorts before its children)
        if not any(d == r or d.startswith(r + os.sep) for r in roots):
            roots.append(d)
    return roots
