"""Imports point down: core <- chapter 1 <- chapter 2 <- ... and nothing in the library imports the benchmark.

Read from the source with ``ast`` (function-level imports included), so a cycle hidden inside
a function body is caught as well as one at the top of a module.
"""
import ast
import pathlib
import subprocess
import sys

import pytest

import atlaslib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "atlaslib"

# Chapter packages still being written, not yet in atlaslib.CHAPTERS (which needs the notebook and the
# exercises): their imports are checked here all the same.
IN_PROGRESS = {}
CHAPTERS = {"core": 0, **atlaslib.CHAPTERS, **IN_PROGRESS}                   # package -> chapter
TOOLS = {"bench", "bench_fla", "aot", "grade", "train"}          # top-level tools, never imported by chapters


def package_of(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "atlaslib" else None


def imports_of(path: pathlib.Path, root: pathlib.Path = ROOT.parent):
    """Absolute names of the atlaslib modules that ``path`` (a file under ``root``/atlaslib) imports,
    anywhere in the file."""
    rel = path.relative_to(root).with_suffix("")
    here = list(rel.parts if rel.name != "__init__" else rel.parts[:-1])
    pkg = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("atlaslib")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
                found += names
            elif node.module and node.module.startswith("atlaslib"):
                found.append(node.module)
    return found


def library_files():
    return sorted(p for p in ROOT.rglob("*.py"))


def test_import_atlaslib_in_a_fresh_interpreter():
    out = subprocess.run([sys.executable, "-c", "import atlaslib, atlaslib.nn, atlaslib.tasks; print('ok')"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def violation(src: str, target: str) -> str | None:
    """Why a module of chapter package ``src`` may not import ``target`` (None: it may)."""
    dst = package_of(target)
    if dst in TOOLS:
        return f"imports the tool {target}"
    if dst in CHAPTERS and CHAPTERS[dst] > CHAPTERS[src]:
        return f"(chapter {CHAPTERS[src]}) imports {target} (chapter {CHAPTERS[dst]})"
    if dst not in CHAPTERS and dst is not None:
        return f"imports {target}, above the chapters"
    return None


def test_imports_point_down():
    wrong = []
    for path in library_files():
        src = package_of(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
        if src not in CHAPTERS:
            continue
        for target in imports_of(path):
            why = violation(src, target)
            if why:
                wrong.append(f"{path.relative_to(ROOT.parent)} {why}")
    assert not wrong, "\n".join(wrong)


def test_every_package_has_a_chapter_number():
    """A new chapter package must be placed in the order above (and so in the check)."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - set(CHAPTERS) <= {"nn", "tasks", "exercises"}, sorted(packages - set(CHAPTERS))


@pytest.mark.parametrize("src, target, ok", [("omega", "atlaslib.miras", True),
                                             ("miras", "atlaslib.omega.chunk", False),
                                             ("linear", "atlaslib.bench", False)])
def test_the_check_can_fail(src, target, ok, tmp_path):
    """The parser sees a relative import of a later chapter, or of the benchmark, for what it is
    (the probe is written to a copy of the package layout under tmp_path, never into atlaslib/)."""
    fake = tmp_path / "atlaslib" / src / "_probe_import.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"def f():\n    from ..{target.split('.', 1)[1]} import something\n")
    names = imports_of(fake, root=tmp_path)
    assert names == [target]
    assert (violation(src, target) is None) == ok


def test_production_code_does_not_import_the_test_helpers():
    """``core.testing`` (poisoning, random inputs, tolerances) is for tests, exercises and notebooks:
    only the exercises and ``core/__init__.py`` (which re-exports it) may import it."""
    wrong = [f"{path.relative_to(ROOT.parent)} imports {target}" for path in library_files()
             if "exercises" not in path.parts and path != ROOT / "core" / "__init__.py"
             for target in imports_of(path) if target.startswith("atlaslib.core.testing")]
    assert not wrong, "\n".join(wrong)


# Internals a chapter teaches by name, which exercise checks may use (CONTRIBUTING.md lists them).
STABLE_INTERNALS = {
    "atlaslib.linear.chunk": {"chunk_step"}, "atlaslib.core.chunking": {"causal_decay"},
    "atlaslib.delta.chunk": {"decayed_products"}, "atlaslib.miras.optimizer": {"build_optimizer"},
    "atlaslib.miras.retention": {"build_retention"}, "atlaslib.core.windows": {"band_gates"},
    "atlaslib.omega.chunk": {"window_weights"}, "atlaslib.omega.recurrent": {"window_gradient"},
    "atlaslib.tasks.capacity": {"least_squares_memory"},
}


def imported_names(path: pathlib.Path):
    """(module, name) for every ``from atlaslib... import name`` in ``path`` (relative ones resolved)."""
    pkg = list(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("atlaslib")):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                yield mod, alias.name


def test_exercise_checks_use_public_functions_or_stable_internals():
    import importlib
    wrong = []
    for path in sorted((ROOT / "exercises").glob("ch[0-9][0-9].py")):
        for mod, name in imported_names(path):
            if mod.startswith("atlaslib.exercises") or mod in ("atlaslib.core.testing", "atlaslib.core.dispatch"):
                continue                                   # the exercises' own helpers, test inputs, interpreter check
            public = getattr(importlib.import_module(mod), "__all__", None)
            if name in STABLE_INTERNALS.get(mod, ()) or (public is not None and name in public):
                continue
            wrong.append(f"{path.name}: from {mod} import {name}")
    assert not wrong, "not public and not a listed stable internal:\n" + "\n".join(wrong)


def test_stable_internals_are_named_in_the_chapters_contributing_cites():
    """CONTRIBUTING.md's table of internals matches STABLE_INTERNALS, and the chapter each row cites names
    every internal of the row, so that a learner meets it by name before an exercise imports it."""
    import json
    import re
    text = (ROOT.parent / "CONTRIBUTING.md").read_text()
    table = text[text.index("## Internals the exercises may use"):].split("\n## ")[0]
    listed, unnamed = {}, []
    for row in re.findall(r"^\| (`atlaslib.*?) \| chapter (\d+)", table, flags=re.M):
        names, chapter = re.findall(r"`(atlaslib\.[\w.]+)`", row[0]), int(row[1])
        (book,) = (ROOT.parent / "book").glob(f"ch{chapter:02d}_*.ipynb")
        cells = "\n".join("".join(c["source"]) for c in json.loads(book.read_text())["cells"])
        for full in names:
            mod, name = full.rsplit(".", 1)
            listed.setdefault(mod, set()).add(name)
            if not re.search(rf"\b{name}\b", cells):
                unnamed.append(f"{full} (chapter {chapter})")
    assert listed == STABLE_INTERNALS
    assert not unnamed, "not named in the chapter CONTRIBUTING.md cites: " + ", ".join(unnamed)


def test_an_installed_copy_keeps_its_builds_in_the_users_cache(tmp_path):
    """``atlaslib.aot`` caches builds in the checkout's ``_build/aot``; a copy installed without the repository
    (no pyproject.toml beside it) uses the user's cache, not a folder next to the installed packages."""
    import os
    import shutil
    site = tmp_path / "site"
    shutil.copytree(ROOT, site / "atlaslib", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("ATLAS_AOT_CACHE", "XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), HOME=str(tmp_path / "home"))
    code = "import atlaslib.aot as a; print(a.__file__); print(a.CACHE_DIR)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(site / "atlaslib" / "aot.py"), str(tmp_path / "home" / ".cache" / "atlaslib" / "aot")]
    from atlaslib import aot
    assert aot.default_cache_dir() == ROOT.parent / "_build" / "aot"       # this checkout


def test_the_package_says_it_is_typed():
    import tomllib
    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    assert (ROOT / "py.typed").is_file() and "py.typed" in config["tool"]["setuptools"]["package-data"]["atlaslib"]
