"""Real builds for a GPU on this machine: a script of tests/ run with Triton's interpreter off."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def real_builds(script: str, cache) -> list[dict]:
    """The JSON lines that ``tests/<script>`` prints, run in a fresh process with ``TRITON_INTERPRET`` unset
    (the interpreter cannot build for a card) and an empty ``ATLAS_AOT_CACHE`` at ``cache``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(ATLAS_AOT_CACHE=str(cache), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / script)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
