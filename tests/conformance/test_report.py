"""The report: cells, verdicts and gating from test entries; the HTML and Markdown pages."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conformance import requirements
from conformance.render import matrix_lines, skip_lines, to_html, to_markdown, write
from conformance.report import Entry, InvalidResults, Results, entry, main

ROOT = Path(__file__).parents[2]
REPORTS = ROOT / "reports"
HOSTILE = "<script>alert('x')</script> | `&` \"quoted\""


def make_entry(
    requirement: str,
    driver: str,
    outcome: str = "passed",
    message: str = "",
    *,
    level: str = "mandatory",
    unavailable: str = "",
) -> Entry:
    return Entry(
        nodeid=f"conformance/test_x.py::test_{requirement.lower()}[{driver}]",
        requirement=requirement,
        driver=driver,
        level=level,
        outcome=outcome,
        message=message,
        unavailable=unavailable,
        gpu_model="NVIDIA H100 80GB HBM3",
        gpu_count=8,
        simulated=True,
    )


def make_results(
    tests: list[Entry],
    drivers: tuple[str, ...] = ("reference",),
    *,
    explicit: bool = False,
    golden: requirements.GoldenList | None = None,
) -> Results:
    golden = golden or requirements.load()
    return Results(
        header={
            "session": "s1",
            "simulated": True,
            "host": "8 x NVIDIA H100 80GB HBM3 (simulated GPUs under /run/sim)",
            "hostname": "gpu-box",
            "generated": "2026-11-22 06:00 UTC",
            "gpu_model": "NVIDIA H100 80GB HBM3",
            "gpu_count": 8,
        },
        drivers={name: {"version": f"{name} 1.0", "explicit": explicit} for name in drivers},
        requirements=[
            {
                "id": req.id,
                "statement": req.statement,
                "levels": {name: golden.level(req.id, name) for name in drivers},
            }
            for req in golden.requirements
        ],
        tests=tests,
    )


def all_passed(driver: str) -> list[Entry]:
    return [make_entry(req.id, driver) for req in requirements.load().requirements]


def test_a_driver_that_passes_every_mandatory_requirement_passes() -> None:
    results = make_results(all_passed("reference"))
    levels = requirements.load().profile("reference").values()
    total = sum(level == "mandatory" for level in levels)
    assert [v.line for v in results.verdicts] == [
        f"reference: PASS ({total}/{total} mandatory passed; 0 optional failed)"
    ]
    assert set(results.matrix) == set(requirements.load().by_id)
    assert not results.gate_fails()


def test_a_failed_mandatory_requirement_fails_the_driver_naming_it() -> None:
    tests = all_passed("docker")
    tests[2] = make_entry(tests[2]["requirement"], "docker", "failed", "shared GPU 0")
    tests[5] = make_entry(tests[5]["requirement"], "docker", "error", "setup crashed")
    results = make_results(tests, ("docker",))
    first, second = tests[2]["requirement"], tests[5]["requirement"]
    assert results.verdicts[0].line == (
        f"docker: FAIL — {first} failed: shared GPU 0 (and 1 more: {second})"
    )
    assert results.matrix[first]["docker"] == "failed"
    assert results.gate_fails()


def test_an_optional_failure_is_reported_but_does_not_gate() -> None:
    golden = requirements.parse(
        {
            "drivers": ["kubernetes"],
            "requirements": [
                {"id": "A-01", "statement": "MUST", "drivers": ["kubernetes"]},
                {"id": "B-01", "statement": "MUST", "drivers": ["kubernetes"]},
                {"id": "C-01", "statement": "MUST", "drivers": [], "optional": []},
                {
                    "id": "D-01",
                    "statement": "MUST",
                    "drivers": ["kubernetes"],
                    "optional": ["kubernetes"],
                },
            ],
        }
    )
    tests = [
        make_entry("A-01", "kubernetes"),
        make_entry("B-01", "kubernetes", "passed"),
        make_entry("B-01", "kubernetes", "skipped", "needs 4 GPUs (host has 2)"),
        make_entry("C-01", "kubernetes", "skipped", "C-01 does not apply to kubernetes"),
        make_entry("D-01", "kubernetes", "failed", "pod outlived", level="optional"),
    ]
    results = make_results(tests, ("kubernetes",), golden=golden)
    assert results.matrix == {
        "A-01": {"kubernetes": "passed"},
        "B-01": {"kubernetes": "partial"},
        "C-01": {"kubernetes": "not applicable"},
        "D-01": {"kubernetes": "failed"},
    }
    assert results.verdicts[0].line == (
        "kubernetes: PASS (1/2 mandatory passed, 1 not fully checked: B-01; 1 optional failed)"
    )
    assert not results.gate_fails()
    assert results.optional_failures() == 1


def test_the_verdict_counts_what_applies_and_what_ran() -> None:
    """A cell the tests found not applicable is not counted; nor is one no test covered."""
    golden = requirements.parse(
        {
            "drivers": ["mydriver"],
            "requirements": [
                {"id": f"{name}-01", "statement": "MUST", "drivers": ["mydriver"]}
                for name in ("A", "B", "SHARED", "WORKLOAD-CUDA", "WORKLOAD-TORCH")
            ],
        }
    )
    tests = [
        make_entry("A-01", "mydriver"),
        make_entry("B-01", "mydriver", "skipped", "needs 4 GPUs (host has 2)"),
        # The tests' own finding: the driver declares it never shares.
        make_entry("SHARED-01", "mydriver", "skipped", "not applicable: shared=False",
                   level="not applicable"),
    ]  # fmt: skip
    tests[-1]["declared"] = "shared=False"
    results = make_results(tests, ("mydriver",), golden=golden)
    assert results.matrix["SHARED-01"]["mydriver"] == "not applicable"
    assert results.verdicts[0].line == (
        "mydriver: PASS (1/2 mandatory passed, 1 not fully checked: B-01; 2 not run (no test "
        "selected): WORKLOAD-CUDA-01, WORKLOAD-TORCH-01; 1 left out by its declarations: "
        "SHARED-01 (shared=False); 0 optional failed)"
    )


def test_a_driver_none_of_whose_mandatory_requirements_ran_is_not_run() -> None:
    """Its "not applicable" cells, judged without it, do not make a PASS of nothing."""
    reason = "needed a kubeconfig (found none at /root/.kube/config)"
    golden = requirements.load()
    tests = [
        make_entry(req.id, "kubernetes", "skipped", "not applicable", level="not applicable")
        if golden.level(req.id, "kubernetes") == "not applicable"
        else make_entry(req.id, "kubernetes", "skipped", reason, unavailable=reason)
        for req in golden.requirements
    ]
    results = make_results(tests, ("kubernetes",))
    assert results.verdicts[0].line == f"kubernetes: NOT RUN — {reason}"
    assert not results.gate_fails()  # not named in --driver: a skip, not a failure
    assert '<span class="version">not running</span>' in to_html(results)
    assert "| kubernetes | not running | NOT RUN — needed a kubeconfig" in to_markdown(results)
    skipped = make_results([make_entry("GPU-NONE-01", "reference", "skipped", "needs 2 GPUs")])
    line = skipped.verdicts[0].line
    assert line.startswith("reference: NOT RUN — no mandatory requirement passed; "), line
    assert line.endswith(" not checked, first: needs 2 GPUs"), line


@pytest.mark.parametrize("explicit", [True, False])
def test_a_driver_that_could_not_run_is_not_run_with_the_reason(explicit: bool) -> None:
    reason = "needed dockerd answering on /var/run/docker.sock (found: no such file)"
    outcome = "error" if explicit else "skipped"
    tests = [
        make_entry(req.id, "docker", outcome, reason, unavailable=reason)
        for req in requirements.load().requirements
    ]
    drivers = ("reference", "docker")
    results = make_results([*all_passed("reference"), *tests], drivers, explicit=explicit)
    assert results.verdicts[1].line == f"docker: NOT RUN — {reason}"
    assert {row["docker"] for row in results.matrix.values()} == {"not run"}
    # A driver named in --driver must run: its not running fails the gate.
    assert results.gate_fails() is explicit


def test_cells_a_run_did_not_reach_are_not_run() -> None:
    results = make_results([make_entry("GPU-NONE-01", "reference")])
    assert results.matrix["GPU-NONE-01"]["reference"] == "passed"
    assert results.matrix["GPU-COUNT-01"]["reference"] == "not run"
    assert results.cells["GPU-COUNT-01"]["reference"].message == "no selected test covers it"
    applying = [req for req, level in requirements.load().profile("reference").items()
                if level == "mandatory"]  # fmt: skip
    unreached = len(applying) - 1
    assert f"{unreached} not run (no test selected): GPU-DEFAULT-01" in results.verdicts[0].line


def test_json_round_trip_and_the_command_line_regenerate_the_same_pages(tmp_path: Path) -> None:
    results = make_results([*all_passed("reference")[1:], make_entry("GPU-NONE-01", "x", "failed")])
    write(results, json_path=tmp_path / "run.json")
    document = json.loads((tmp_path / "run.json").read_text())
    # The keys the first version of the report had keep their meaning.
    assert {"session", "simulated", "host", "tests", "matrix"} <= set(document)
    again = Results.from_json(document)
    assert again.to_json() == document
    assert main([str(tmp_path / "run.json")]) == 0
    assert (tmp_path / "run.html").read_text() == to_html(results)
    assert (tmp_path / "run.md").read_text() == to_markdown(results)


def test_pages_escape_everything_they_show() -> None:
    tests = all_passed("reference")
    tests[0] = make_entry(tests[0]["requirement"], "reference", "failed", HOSTILE)
    results = make_results(tests)
    results.header["hostname"] = "<b>host</b>"
    page = to_html(results)
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "<b>host</b>" not in page
    markdown = to_markdown(results)
    assert "<script>" not in markdown
    assert "\\|" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| GPU-")]
    assert all(line.count(" | ") == 1 for line in table), table


LIVE = {
    "a link": "see [the fix](https://evil.example/x)",
    "an image": "![pixel](https://evil.example/track.png)",
    "HTML": '<img src="https://evil.example/t.png">',
    "an autolink": "<https://evil.example>",
    "a bare URL": "https://evil.example/x and www.evil.example",
    "an address": "mail root@evil.example",
    "a table break": "a | b | c",
    "code and emphasis": "`x` *y* _z_ ~~w~~ $m$",
    "a line break": "first\n| GPU-FORGED-01 | ✅ pass |",
}
"""Driver- and payload-provided text that Markdown (GitHub's) would make live."""


@pytest.mark.parametrize("text", LIVE.values(), ids=list(LIVE))
def test_markdown_makes_no_link_image_html_or_table_break_of_what_drivers_said(text: str) -> None:
    tests = all_passed("reference")
    tests[0] = make_entry(tests[0]["requirement"], "reference", "failed", text)
    results = make_results(tests)
    results.header["hostname"] = text
    results.drivers["reference"]["version"] = text
    markdown = to_markdown(results)
    # What is left once every backslash-escaped character is taken out is no syntax at all.
    live = re.compile(r"\[|\]|<img|<https|https?:/|www\.|@evil|`x`|\*y\*|_z_|~~w|\$m|\| b \|")
    for line in markdown.splitlines():
        assert not live.search(re.sub(r"\\.", "", line)), line
    table = [line for line in markdown.splitlines() if line.startswith("| GPU-")]
    assert all(line.count(" | ") == 1 for line in table), table
    assert "GPU-FORGED-01" not in [line.split(" | ")[0].strip("| ") for line in table]


CONTROL = "\x1b[2J\x1b[1;1Hreference: PASS\r\x9b31m\x07"
"""An escape sequence that clears the terminal and writes a forged verdict, a CR, C1 and BEL."""


def test_the_terminal_gets_what_drivers_said_with_its_control_characters_written_out() -> None:
    tests = all_passed("reference")
    tests[0] = make_entry(tests[0]["requirement"], "reference", "failed", CONTROL)
    results = make_results(tests)
    results.header["host"] = CONTROL
    results.drivers["reference"]["version"] = CONTROL
    lines = [*matrix_lines(results), *(v.line for v in results.verdicts)]
    lines += skip_lines([CONTROL])
    for line in lines:
        assert not re.search(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]", line), repr(line)
    assert "\\x1b[2J\\x1b[1;1Hreference: PASS\\x0d\\x9b31m\\x07" in results.verdicts[0].line


FORGED = {
    "not an object": ([], "(document)"),
    "a test's outcome": ({"tests": [{"outcome": "PASSED!"}]}, "tests[0]"),
    "a driver's version": (
        {"drivers": {"reference": {"version": 1, "explicit": False}}},
        "drivers.reference.version",
    ),
    "an unknown key": ({"verdict": "PASS"}, "(document)"),
    "a level": (
        {"requirements": [{"id": "A-01", "statement": "s", "levels": {"x": "ok"}}]},
        "requirements[0].levels.x",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("change", "field"), FORGED.values(), ids=list(FORGED))
def test_a_results_document_read_back_is_held_to_what_the_recorder_writes(
    change: object, field: str
) -> None:
    document = make_results(all_passed("reference")).to_json()
    forged = {**document, **change} if isinstance(change, dict) else change
    with pytest.raises(InvalidResults) as refused:
        Results.checked(forged)
    assert refused.value.field == field, refused.value
    assert Results.checked(document).to_json() == document


def test_a_report_is_written_as_a_new_file_never_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's own\n")
    planted = tmp_path / "out" / "conformance.json"
    planted.parent.mkdir()
    planted.symlink_to(victim)
    write(make_results(all_passed("reference")), json_path=planted)
    assert victim.read_text() == "root's own\n"
    assert not planted.is_symlink()
    assert json.loads(planted.read_text())["session"] == "s1"


# -- the page in a real browser ---------------------------------------------------------


def showcase() -> Results:
    """Every golden driver, and every kind of cell, as a release run could show them."""
    golden = requirements.load()
    tests: list[Entry] = []
    for index, req in enumerate(golden.requirements):
        tests.append(make_entry(req.id, "reference"))
        failed = index == 2
        tests.append(make_entry(req.id, "docker", "failed" if failed else "passed", HOSTILE))
        reason = "needed podman 4.1+ with CDI (found: podman not on PATH)"
        tests.append(make_entry(req.id, "podman", "skipped", reason, unavailable=reason))
        outcome = "skipped" if index % 4 == 3 else "passed"
        tests.append(make_entry(req.id, "kubernetes", outcome, "needs 2 GPUs (host has 1)"))
        if index % 5:
            tests.append(make_entry(req.id, "vm"))
    return make_results(tests, golden.drivers, golden=golden)


def chromium() -> str:
    """$CHROMIUM, else the first of Debian's, Ubuntu's or Google's build on PATH."""
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name) if name else None
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("chromium is missing: make test installs it (apt-get install chromium)")
    pytest.skip("needed chromium to render the matrix (found none; apt-get install chromium)")


def headless(browser: str, profile: Path, *args: str) -> str:
    """Run chromium headless with nothing that reaches the network; return its stdout."""
    flags = [
        "--headless",
        "--no-sandbox",  # CI runs the suite as root, where chromium's sandbox will not start
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ]
    done = subprocess.run(
        [browser, *flags, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


class CellCounter(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.cells = self.rows = self.opened = 0
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        self.cells += tag == "td" and "cell" in classes
        self.rows += tag == "tr"
        self.scripts += tag == "script"
        self.opened += tag == "details" and "open" in dict(attrs)


def test_the_matrix_renders_in_a_browser_one_cell_per_requirement_and_driver(
    tmp_path: Path,
) -> None:
    browser = chromium()
    results = showcase()
    REPORTS.mkdir(exist_ok=True)
    page = REPORTS / "conformance-showcase.html"
    screenshot = REPORTS / "conformance-showcase.png"
    write(results, html_path=page)
    dom = headless(browser, tmp_path / "profile-dom", "--dump-dom", page.as_uri())
    counter = CellCounter()
    counter.feed(dom)
    requirement_count = len(requirements.load().requirements)
    assert counter.cells == requirement_count * len(results.drivers)
    assert counter.rows == requirement_count + 1
    assert counter.scripts == 0, "the hostile message became a script"
    assert counter.opened == 0, "details are one click away, closed"
    screenshot.unlink(missing_ok=True)
    headless(
        browser,
        tmp_path / "profile-shot",
        f"--screenshot={screenshot}",
        "--window-size=1400,1600",
        "--hide-scrollbars",
        page.as_uri(),
    )
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_passed_test_that_dropped_a_case_leaves_its_requirement_partial_naming_it() -> None:
    """A case the host could not show is never reported passed (fixtures.dropped)."""
    whole = make_entry("GPU-NONE-01", "reference")
    short = Entry(
        **make_entry("GPU-HOSTWIDE-01", "reference"),
        dropped="an earlier boot's holder (needs 2 GPUs, host has 1)",
    )
    results = make_results([whole, short])
    assert results.matrix["GPU-NONE-01"]["reference"] == "passed"
    assert results.matrix["GPU-HOSTWIDE-01"]["reference"] == "partial"
    cell = results.cells["GPU-HOSTWIDE-01"]["reference"]
    assert cell.message == (
        "cases not tried here: an earlier boot's holder (needs 2 GPUs, host has 1)"
    )
    assert "1 not fully checked: GPU-HOSTWIDE-01" in results.verdicts[0].line
    assert Results.checked(results.to_json()).matrix == results.matrix


def test_a_dropped_case_reaches_the_entry_from_the_tests_properties() -> None:
    report = pytest.TestReport(
        "conformance/test_x.py::test_y[reference]", ("x", 1, "y"), {}, "passed", None, "call",
        user_properties=[
            ("requirement", "GPU-HOSTWIDE-01"), ("driver", "reference"),
            ("dropped", "a zombie holder (no)"), ("dropped", "an earlier boot (no)"),
        ],
    )  # fmt: skip
    found = entry(report)
    assert found is not None
    assert found["dropped"] == "a zombie holder (no); an earlier boot (no)"
