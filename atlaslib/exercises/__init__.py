"""Graded exercises: one check module per chapter (``ch01`` ...), the notebook generator
(``python -m atlaslib.exercises.generate``) and the channel the grader
(``python -m atlaslib.grade``) reads the verdicts from (``checking.MIME``)."""
from .checking import MIME, Registry, Verdict

# chapter tag -> module with that chapter's checks (its ``EXERCISES`` registry)
CHAPTERS = {"ch01": "atlaslib.exercises.ch01", "ch02": "atlaslib.exercises.ch02",
            "ch03": "atlaslib.exercises.ch03", "ch04": "atlaslib.exercises.ch04"}


def registry(chapter: str) -> Registry:
    """The ``EXERCISES`` registry of a chapter, e.g. ``registry("ch01")``."""
    import importlib
    if chapter not in CHAPTERS:
        raise ValueError(f"unknown chapter {chapter!r}; known: {sorted(CHAPTERS)}")
    return importlib.import_module(CHAPTERS[chapter]).EXERCISES


__all__ = ["MIME", "Registry", "Verdict", "CHAPTERS", "registry"]
