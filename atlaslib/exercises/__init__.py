"""Graded exercises: one check module per chapter (``ch01`` ...), the notebook generator
(``python -m atlaslib.exercises.generate``) and the channel the grader
(``python -m atlaslib.grade``) reads the verdicts from (``checking.MIME``)."""
from .. import CHAPTERS as _BOOK_CHAPTERS
from ..core.dispatch import interpreter_on
from .checking import MIME, Registry, Verdict

if interpreter_on():    # a learner's kernel meets the interpreter the library's kernels meet
    from ..core.interpreter import as_a_gpu
    as_a_gpu()

# chapter tag -> module with that chapter's checks (its ``EXERCISES`` registry), one per book chapter
CHAPTERS = {f"ch{n:02d}": f"atlaslib.exercises.ch{n:02d}" for n in sorted(_BOOK_CHAPTERS.values())}


def registry(chapter: str) -> Registry:
    """The ``EXERCISES`` registry of a chapter, e.g. ``registry("ch01")``."""
    import importlib
    if chapter not in CHAPTERS:
        raise ValueError(f"unknown chapter {chapter!r}; known: {sorted(CHAPTERS)}")
    return importlib.import_module(CHAPTERS[chapter]).EXERCISES


__all__ = ["MIME", "Registry", "Verdict", "CHAPTERS", "registry"]
