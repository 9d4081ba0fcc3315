"""The GitHub Actions workflows are valid before GitHub ever runs them.

Two layers: check-jsonschema validates each file against the GitHub workflow schema it
vendors (SchemaStore's, so no network is needed): unknown or misspelled keys, bad permission
values, a job with no `runs-on`, a step that neither `uses` nor `run`s. The schema sees one
object at a time, so the cross-references it cannot see are checked here: every `needs`
names a job of the same file, every `steps.<id>` an expression reads is a step of that job,
and every action is pinned to a version. Then the gate: `make test` runs on pushes and pull requests
(test.yml), and the book is published only after it succeeds on main (book.yml).

(actionlint would be the fuller linter, but its PyPI wrapper downloads the binary from
GitHub while it installs, which fails where `make test` has only the package index.)
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
BOOK = ROOT / ".github" / "workflows" / "book.yml"
TESTS = ROOT / ".github" / "workflows" / "test.yml"


def schema_errors(path: Path) -> str:
    """check-jsonschema's report on `path` ('' when the file fits the workflow schema)."""
    run = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
         "--output-format", "text", str(path)],
        capture_output=True, text=True)
    if "No module named check_jsonschema" in run.stderr:
        pytest.fail("check-jsonschema is missing: `make venv` installs it from requirements-dev.txt")
    return "" if run.returncode == 0 else (run.stdout + run.stderr)


def jobs_of(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8")).get("jobs") or {}


def undefined_needs(jobs: dict) -> list[str]:
    found = []
    for name, job in jobs.items():
        needs = job.get("needs") or []
        for need in [needs] if isinstance(needs, str) else needs:
            if need not in jobs:
                found.append(f"job {name} needs {need}, which is not a job of this workflow")
    return found


STEP_REF = re.compile(r"\bsteps\.([A-Za-z_][\w-]*)\.")


def undefined_step_refs(jobs: dict) -> list[str]:
    """`steps.<id>.…` in a job's expressions, where no step of that job has that id."""
    found = []
    for name, job in jobs.items():
        ids = {step.get("id") for step in job.get("steps") or []}
        for ref in sorted(set(STEP_REF.findall(yaml.safe_dump(job)))):
            if ref not in ids:
                found.append(f"job {name} reads steps.{ref}, which no step of it defines")
    return found


PINNED = re.compile(r"^[\w.-]+/[\w./-]+@(v\d+(\.\d+){0,2}|[0-9a-f]{40})$")


def unpinned_actions(jobs: dict) -> list[str]:
    """Actions used without a version tag or commit (local ./ actions and docker:// excepted)."""
    return [f"job {name}: {step['uses']}"
            for name, job in jobs.items() for step in job.get("steps") or []
            if "uses" in step and not step["uses"].startswith(("./", "docker://"))
            and not PINNED.match(step["uses"])]


def findings(path: Path) -> list[str]:
    jobs = jobs_of(path)
    problems = [schema_errors(path)] + undefined_needs(jobs) + undefined_step_refs(jobs) \
        + unpinned_actions(jobs)
    return [p for p in problems if p]


def test_there_are_workflows():
    assert BOOK in WORKFLOWS and TESTS in WORKFLOWS


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_has_no_findings(path):
    problems = findings(path)
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_book_workflow_builds_with_make_and_deploys_the_html():
    text = BOOK.read_text(encoding="utf-8")
    workflow = yaml.safe_load(text)
    jobs = workflow["jobs"]
    build_steps = jobs["build"]["steps"]
    assert any(step.get("run", "").strip() == "make book" for step in build_steps)
    upload = [s for s in build_steps if s.get("uses", "").startswith("actions/upload-pages-artifact@")]
    assert upload and upload[0]["with"]["path"] == "_build/html"
    assert jobs["deploy"]["environment"]["name"] == "github-pages"
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in jobs["deploy"]["steps"])
    assert workflow["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}


# Each a small edit of book.yml that GitHub would refuse or run wrongly.
BREAKAGES = {
    "permission value": ("pages: write", "pages: writ"),
    "misspelled step key": ("- uses: actions/checkout@v4", "- use: actions/checkout@v4"),
    "job without runs-on": ("    needs: build\n    runs-on: ubuntu-latest\n", "    needs: build\n"),
    "undefined job dependency": ("needs: build", "needs: biuld"),
    "undefined step id": ("steps.deployment.outputs", "steps.deploy.outputs"),
    "unpinned action": ("actions/setup-node@v4", "actions/setup-node"),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_checks_catch_a_broken_workflow(name, tmp_path):
    old, new = BREAKAGES[name]
    text = BOOK.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"book.yml changed: update the '{name}' breakage"
    broken = tmp_path / "broken.yml"
    broken.write_text(text.replace(old, new), encoding="utf-8")
    assert findings(broken), f"the checks passed a workflow with a broken {name}"


def test_config_points_the_buttons_at_the_branch_the_workflow_publishes():
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    repo = config["repository"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repo["url"]), repo["url"]
    # the header's buttons link to repo["url"]: off while it is the placeholder, on once it is a repository
    placeholder = repo["url"].endswith("/OWNER/REPO")
    for button in ("use_repository_button", "use_issues_button"):
        assert config["html"][button] is not placeholder, f"{button} with repository.url {repo['url']}"
    assert config["html"]["use_download_button"]
    assert triggers_of(BOOK.read_text(encoding="utf-8"))["workflow_run"]["branches"] == [repo["branch"]]


def triggers_of(text: str) -> dict:
    """The `on:` mapping of a workflow (PyYAML reads the bare key `on` as True, YAML 1.1)."""
    workflow = yaml.safe_load(text)
    on = workflow.get(True, workflow.get("on"))
    return {on: None} if isinstance(on, str) else {name: None for name in on} if isinstance(on, list) else on


def test_the_test_workflow_runs_make_test_on_pushes_and_pull_requests():
    text = TESTS.read_text(encoding="utf-8")
    triggers = triggers_of(text)
    assert "push" in triggers and "pull_request" in triggers
    for event in ("push", "pull_request"):                      # no branch filter: every push, every PR
        assert not (triggers[event] or {}).get("branches"), f"test.yml runs on {event} to some branches only"
    steps = [step for job in jobs_of(TESTS).values() for step in job.get("steps") or []]
    assert any(step.get("run", "").strip() == "make test" for step in steps)


GREEN = "github.event.workflow_run.conclusion == 'success'"


def gate_problems(book_text: str, tests_text: str) -> list[str]:
    """Why the book workflow could publish without a green `make test` ([] when it cannot)."""
    problems = []
    triggers = triggers_of(book_text)
    if set(triggers) != {"workflow_run"}:
        problems.append(f"book.yml must run only after the tests (workflow_run), not on {sorted(set(triggers))}")
    run = triggers.get("workflow_run") or {}
    test_name = yaml.safe_load(tests_text)["name"]
    if run.get("workflows") != [test_name]:
        problems.append(f"book.yml follows {run.get('workflows')}, not the test workflow {test_name!r}")
    if run.get("types") != ["completed"]:
        problems.append("book.yml must follow completed test runs")
    jobs = yaml.safe_load(book_text).get("jobs") or {}

    def gated(name, seen=()):
        job = jobs.get(name) or {}
        if GREEN in " ".join(str(job.get("if", "")).split()):
            return True
        needs = job.get("needs") or []
        needs = [needs] if isinstance(needs, str) else needs
        return any(gated(n, seen + (name,)) for n in needs if n not in seen)
    problems += [f"job {name} runs whatever the tests concluded" for name in jobs if not gated(name)]
    checkouts = [step for job in jobs.values() for step in job.get("steps") or []
                 if step.get("uses", "").startswith("actions/checkout@")]
    if any((step.get("with") or {}).get("ref") != "${{ github.event.workflow_run.head_sha }}" for step in checkouts):
        problems.append("book.yml must check out the commit the tests passed (workflow_run.head_sha)")
    return problems


def test_the_book_is_published_only_after_the_tests_pass():
    problems = gate_problems(BOOK.read_text(encoding="utf-8"), TESTS.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


# Each a small edit of book.yml that would publish a book whose tests failed or never ran.
GATE_BREAKAGES = {
    "published on push": ("on:\n  workflow_run:\n", "on:\n  push:\n    branches: [main]\n  workflow_run:\n"),
    "no success check": (GREEN + " &&", "true &&"),
    "follows another workflow": ("workflows: [test]", "workflows: [lint]"),
    "a job outside the gate": ("  deploy:\n    needs: build\n", "  deploy:\n"),
    "builds the branch tip": ("ref: ${{ github.event.workflow_run.head_sha }}", "ref: main"),
}


@pytest.mark.parametrize("name", GATE_BREAKAGES)
def test_the_gate_check_can_fail(name):
    old, new = GATE_BREAKAGES[name]
    text = BOOK.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"book.yml changed: update the '{name}' breakage"
    assert gate_problems(text.replace(old, new), TESTS.read_text(encoding="utf-8")), \
        f"the gate check passed a book workflow with {name}"
