"""The graded Triton exercises' kernels built for real GPUs, on a machine without one: run as a script (with
``TRITON_INTERPRET`` unset) by tests/test_exercise_aot.py, it prints one JSON object per build.

The checks run a learner's kernel in Triton's interpreter when there is no GPU, and the interpreter takes
kernels that a card's compiler rejects. So every exercise's worked solution (``exercises/solutions/``) is
built for sm_80 and sm_90 at each launch its check makes (the check's own cases, found by running its body
with the launches intercepted), and the untouched stub of the learner's notebook (``exercises/``) at its
first one, whose failure a check on a GPU must read as "not implemented yet" (``checking.is_not_implemented``).
And one kernel the interpreter passes but a card's compiler rejects (chapter 7's score tile started at a scalar
-inf, which the slot loop turns into a block), whose error a check on a GPU must name (``checking.short``).
"""
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton

from atlaslib import aot
from atlaslib.exercises import CHAPTERS, checking, registry

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("sm_80", "sm_90")


def kernel_module(notebook: Path, folder: Path):
    """The notebook's cell that defines its @triton.jit kernel (and its launcher), imported from a file: the
    JIT reads a kernel's source with ``inspect``."""
    nb = json.loads(notebook.read_text())
    cells = ["".join(c["source"]) for c in nb["cells"]
             if c["cell_type"] == "code" and "@triton.jit" in "".join(c["source"])]
    assert len(cells) == 1, f"{notebook}: {len(cells)} cells define a @triton.jit kernel"
    path = folder / f"{notebook.parent.name}_{notebook.stem}.py"
    path.write_text("import math\nimport torch\nimport triton\nimport triton.language as tl\n\n" + cells[0])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def every_case(description):
    """``checking.case`` that goes on to the next case: the intercepted launches store nothing."""
    try:
        yield
    except (checking.CheckFailed, checking.LearnerError):
        pass


def check_launches(chapter: str, exercise, fn) -> list:
    """The launches ``fn`` makes when the exercise's check calls it, one per case, recorded, not run."""
    module = importlib.import_module(CHAPTERS[chapter])
    patches = {"triton_setup": lambda tol, gpu_tol=None: ("cpu", tol), "case": every_case,
               "call": lambda f, *args, **kwargs: f(*args, **kwargs)}
    saved = {name: getattr(module, name) for name in patches}
    try:
        for name, value in patches.items():
            setattr(module, name, value)
        with aot.intercepted_launches() as launches:
            exercise.body(fn, gen=torch.Generator().manual_seed(0))
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
    return launches


def compile_error(launch, target):
    """What a GPU's JIT raises at this launch (None: it compiles)."""
    source, options, _ = aot.specialised(launch, target)
    try:
        triton.compile(source, target=aot._target(target), options=options.__dict__)
    except Exception as e:
        return e
    return None


# a score tile started at a scalar: its type changes in the slot loop, which only the interpreter allows
SCALAR_START = ('b_r = tl.full([BT, BJ], float("-inf"), tl.float32)', 'b_r = float("-inf")')


def launch_label(launch) -> str:
    shapes = ",".join("x".join(map(str, a.shape)) for a in launch.args if isinstance(a, torch.Tensor))
    return f"{shapes} {launch.kwargs}"


def main():
    with tempfile.TemporaryDirectory() as tmp:
        for notebook in sorted((ROOT / "exercises" / "solutions").glob("ch*.ipynb")):
            chapter = notebook.stem.split("_")[0]
            (exercise,) = [e for e in registry(chapter) if e.needs_launch]
            (name,) = exercise.functions
            solution = kernel_module(notebook, Path(tmp))
            launches = check_launches(chapter, exercise, getattr(solution, name))
            for launch in launches:
                for target in TARGETS:
                    result = aot.build(launch, target, f"{chapter}: {launch_label(launch)}", full=False)
                    print(json.dumps(dict(dataclasses.asdict(result), fits=result.fits, chapter=chapter,
                                          kind="solution", cases=len(launches))), flush=True)
            stub = kernel_module(ROOT / "exercises" / notebook.name, Path(tmp))
            (launch,) = check_launches(chapter, exercise, getattr(stub, name))[:1]
            for target in TARGETS:
                e = compile_error(launch, target)
                print(json.dumps({"chapter": chapter, "kind": "stub", "target": target, "error": str(e or "")[-300:],
                                  "not_implemented": e is not None and checking.is_not_implemented(e)}), flush=True)
        notebook = ROOT / "exercises" / "solutions" / "ch07_caching.ipynb"
        variant = kernel_module(notebook, Path(tmp))
        path = Path(variant.__file__)
        assert SCALAR_START[0] in path.read_text()
        path.write_text(path.read_text().replace(*SCALAR_START))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        variant = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(variant)
        (exercise,) = [e for e in registry("ch07") if e.needs_launch]
        (launch,) = check_launches("ch07", exercise, getattr(variant, exercise.functions[0]))[:1]
        e = compile_error(launch, "sm_90")
        print(json.dumps({"chapter": "ch07", "kind": "scalar start", "target": "sm_90", "error": str(e or "")[-300:],
                          "message": "" if e is None else checking.short(e)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
