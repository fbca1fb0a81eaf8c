"""The GitHub workflows pass real linters, and those linters fail planted broken workflows.

check-jsonschema validates against the GitHub workflow schema it vendors; zizmor audits
for security holes, offline (no network to GitHub here).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
PLANTED = Path(__file__).parent / "data" / "workflows"
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def lint(tool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    executable = Path(sys.executable).parent / tool
    return subprocess.run(
        [str(executable), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def schema(*paths: Path) -> subprocess.CompletedProcess[str]:
    return lint("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *paths)


def audit(*paths: Path | str) -> subprocess.CompletedProcess[str]:
    return lint("zizmor", "--offline", *paths)


def test_the_workflows_pass_both_linters() -> None:
    assert WORKFLOWS, "no workflow found"
    checked = schema(*WORKFLOWS)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    audited = audit(".")
    assert audited.returncode == 0, audited.stdout + audited.stderr


def test_the_schema_linter_fails_a_workflow_github_would_reject() -> None:
    checked = schema(PLANTED / "broken-schema.yml")
    assert checked.returncode != 0
    assert "'runs-on' is a required property" in checked.stdout


def test_the_security_linter_fails_template_injection() -> None:
    planted = PLANTED / "broken-injection.yml"
    # Valid as a workflow: the failure below is the audit's alone.
    assert schema(planted).returncode == 0
    audited = audit(planted)
    assert audited.returncode != 0
    assert "error[template-injection]" in audited.stdout
    assert "github.event.pull_request.title" in audited.stdout
