"""A fleet report: many hosts' reports merged, one verdict per driver; what it refuses, by name.

The reports here are made as the recorder makes them (``make_results``), each with a host of
its own; tests/test_fleet_workflow.py merges reports of real runs, as the workflow does.
"""

from __future__ import annotations

import copy
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from conformance import fleet_render, identity, requirements
from conformance.fleet import Fleet, FleetError, load
from conformance.report import Entry, Results
from tests.conformance.test_report import (
    HOSTILE,
    REPORTS,
    chromium,
    headless,
    make_entry,
    make_results,
)

GPUS = [
    {
        "vendor": "nvidia",
        "model": "NVIDIA H100 80GB HBM3",
        "count": 8,
        "mig_gpus": 2,
        "mig_instances": {"1g.10gb": 8, "2g.20gb": 3},
        "driver": "nvidia 580.65.06",
    }
]


def host_report(
    name: str,
    tests: list[Entry],
    drivers: tuple[str, ...] = ("reference",),
    *,
    explicit: bool = False,
    gpus: list[dict[str, Any]] | None = None,
) -> Results:
    results = make_results(tests, drivers, explicit=explicit)
    results.header.update(
        hostname=name,
        simulated=False,
        catalogue=identity.catalogue_version(),
        host_id=identity.host_id("machine", name, [f"GPU-{name}"]),
        gpus=copy.deepcopy(GPUS if gpus is None else gpus),
    )
    return results


def passes(driver: str = "reference") -> list[Entry]:
    return [make_entry(req.id, driver) for req in requirements.load().requirements]


def fails(requirement: str, message: str, driver: str = "reference") -> list[Entry]:
    return [
        make_entry(entry["requirement"], driver, "failed", message)
        if entry["requirement"] == requirement
        else entry
        for entry in passes(driver)
    ]


def saved(tmp_path: Path, *reports: Results) -> list[Path]:
    paths = []
    for results in reports:
        path = tmp_path / f"{results.header['hostname']}.json"
        path.write_text(json.dumps(results.to_json()))
        paths.append(path)
    return paths


def merged(tmp_path: Path, *reports: Results) -> Fleet:
    return load(saved(tmp_path, *reports), "2026-11-28 06:00 UTC")


def verdict(fleet: Fleet, driver: str = "reference") -> str:
    return next(v.line for v in fleet.verdicts if v.driver == driver)


def test_a_driver_that_passes_every_host_it_ran_on_passes_naming_where_it_did_not_run(
    tmp_path: Path,
) -> None:
    unavailable = "needed NVIDIA GPUs (found none through NVML or nvidia-smi)"
    amd_only = [
        make_entry(req.id, "reference", "skipped", unavailable, unavailable=unavailable)
        for req in requirements.load().requirements
    ]
    fleet = merged(
        tmp_path,
        host_report("h100", passes()),
        host_report("l4", passes()),
        host_report("mi300", amd_only, gpus=[{**GPUS[0], "vendor": "amd", "mig_gpus": 0}]),
    )
    assert verdict(fleet) == (
        "reference: PASS (passed on every host it ran on, 2 of 3; not run on 1, not counted: "
        f"mi300 ({unavailable}))"
    )
    assert not fleet.gate_fails()
    on = fleet.to_json()["verdicts"]["reference"]["hosts"]
    assert on == {"h100": "PASS", "l4": "PASS", "mi300": "NOT RUN"}


def test_a_driver_that_fails_one_host_fails_the_fleet_naming_the_host(tmp_path: Path) -> None:
    fleet = merged(
        tmp_path,
        host_report("h100", passes()),
        host_report("a100-mig", fails("MIG-EXACT-01", "got the wrong instance")),
        host_report("l4", passes()),
    )
    line = verdict(fleet)
    assert line.startswith(
        "reference: FAIL — failed on 1 of the 3 hosts it ran on, first a100-mig: "
    )
    assert "MIG-EXACT-01" in line
    assert fleet.gate_fails()
    cell = fleet.cells["MIG-EXACT-01"]["reference"]
    assert cell.status == "failed"
    assert fleet_render.counts(cell) == "1 fail · 2 pass"
    assert fleet.cells["GPU-NONE-01"]["reference"].status == "passed"


def test_a_driver_named_where_it_could_not_run_fails_the_fleet(tmp_path: Path) -> None:
    reason = "needed podman 4.1+ with CDI (found: podman not on PATH)"
    skipped = [
        make_entry(req.id, "podman", "skipped", reason, unavailable=reason)
        for req in requirements.load().requirements
    ]
    fleet = merged(
        tmp_path,
        host_report("h100", passes("podman"), ("podman",), explicit=True),
        host_report("l4", skipped, ("podman",), explicit=True),
    )
    assert verdict(fleet, "podman") == (
        f"podman: FAIL — named but could not run on 1: l4 ({reason})"
    )
    assert fleet.gate_fails()


def test_a_driver_in_no_report_of_a_host_is_shown_there_never_passed(tmp_path: Path) -> None:
    fleet = merged(
        tmp_path,
        host_report("h100", [*passes(), *passes("docker")], ("reference", "docker")),
        host_report("l4", passes()),
    )
    assert verdict(fleet, "docker") == (
        "docker: PASS (passed on every host it ran on, 1 of 2; not run on 1, not counted: "
        "l4 (not in its report))"
    )
    cell = fleet.cells["GPU-NONE-01"]["docker"]
    assert cell.hosts["l4"] is None
    assert fleet_render.counts(cell) == "1 pass · 1 not in its report"
    assert fleet.to_json()["matrix"]["GPU-NONE-01"]["docker"]["hosts"]["l4"] == "not run"


def test_nothing_run_anywhere_fails_the_gate(tmp_path: Path) -> None:
    reason = "needed NVIDIA GPUs"
    skipped = [
        make_entry(req.id, "reference", "skipped", reason, unavailable=reason)
        for req in requirements.load().requirements
    ]
    fleet = merged(tmp_path, host_report("a", skipped), host_report("b", skipped))
    assert fleet.nothing_ran
    assert fleet.gate_fails()
    assert verdict(fleet).startswith("reference: NOT RUN — ran on none of the 2 hosts: a (")


def test_a_fleet_report_merges_again_host_by_host(tmp_path: Path) -> None:
    fleet = merged(tmp_path, host_report("h100", passes()), host_report("l4", passes()))
    written = fleet_render.write(fleet, tmp_path / "first")
    again = load([written[0], *saved(tmp_path, host_report("mi300", passes()))])
    assert [host.name for host in again.hosts] == ["h100", "l4", "mi300"]
    assert again.hosts[0].source == f"{written[0]} [h100]"
    with pytest.raises(FleetError, match=r"the same host as .*first/conformance.json \[l4\]"):
        load([written[0], tmp_path / "l4.json"])


def test_hosts_of_one_hostname_are_told_apart_by_their_identity(tmp_path: Path) -> None:
    one, two = host_report("node", passes()), host_report("node", passes())
    two.header["host_id"] = identity.host_id("other machine", "node", ["GPU-x"])
    paths = [tmp_path / "one.json", tmp_path / "two.json"]
    for path, results in zip(paths, (one, two), strict=True):
        path.write_text(json.dumps(results.to_json()))
    names = [host.name for host in load(paths).hosts]
    assert names == [f"node ({one.header['host_id'][:8]})", f"node ({two.header['host_id'][:8]})"]


def rewritten(tmp_path: Path, name: str, change: Any) -> Path:
    document = host_report(name, passes()).to_json()
    change(document)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (
            lambda d: d.update(catalogue="sha256:0000000000000000"),
            r"catalogue sha256:0000000000000000, not sha256:[0-9a-f]{16} as .*first.json",
        ),
        (lambda d: d.pop("host_id"), r"no host_id: a report of a suite that did not record"),
        (
            lambda d: d["gpus"][0].update(count="8"),
            r"not a conformance report: .*gpus.*'8' is not of type 'integer'",
        ),
        (
            lambda d: d["requirements"][0].update(statement="another"),
            r"requirements that are not .*first.json's, under the same catalogue",
        ),
        (lambda d: d.update(host_id="../../etc"), r"host_id.*does not match"),
    ],
)
def test_a_report_that_cannot_be_merged_is_refused_naming_it(
    tmp_path: Path, change: Any, refusal: str
) -> None:
    first = saved(tmp_path, host_report("first", passes()))[0]
    bad = rewritten(tmp_path, "bad", change)
    with pytest.raises(FleetError, match=refusal) as caught:
        load([first, bad])
    assert caught.value.source == str(bad)
    assert str(caught.value).startswith(f"{bad}: ")


@pytest.mark.parametrize(
    ("content", "field"),
    [
        (b'{"session": ', "is not valid JSON"),
        (b"\xff\xfe", "UTF-8"),
        (b"[]", "not a conformance report"),
        (
            b'{"catalogue": "sha256:0000000000000000", "hosts": [{"name": "x"}]}',
            "not a fleet report: hosts[0]: 'source' is a required",
        ),
    ],
)
def test_a_corrupt_file_is_refused_naming_it(tmp_path: Path, content: bytes, field: str) -> None:
    path = tmp_path / "corrupt.json"
    path.write_bytes(content)
    with pytest.raises(FleetError, match=f"^{re.escape(str(path))}: .*{re.escape(field)}"):
        load([path])


def test_the_same_host_twice_is_refused_naming_both_reports(tmp_path: Path) -> None:
    report = saved(tmp_path, host_report("h100", passes()))[0]
    copy = tmp_path / "copy.json"
    copy.write_bytes(report.read_bytes())
    with pytest.raises(FleetError, match=f"^{copy}: the same host as {report} \\(hostname 'h100'"):
        load([report, copy])


def test_the_pages_escape_what_hosts_and_drivers_said(tmp_path: Path) -> None:
    fleet = merged(
        tmp_path,
        host_report("h100", fails("GPU-NONE-01", HOSTILE)),
        host_report("l4", passes(), gpus=[{**GPUS[0], "model": HOSTILE}]),
    )
    html = fleet_render.to_html(fleet)
    assert "<script>" not in html
    assert "&lt;script&gt;" in html
    markdown = fleet_render.to_markdown(fleet)
    assert "<script>" not in markdown
    junit = fleet_render.to_junit(fleet).decode()
    assert "<script>" not in junit


class FleetCounter(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.table = ""
        self.rows: dict[str, int] = {"hosts": 0, "matrix": 0}
        self.cells = self.scripts = self.opened = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "table":
            self.table = classes[0] if classes else ""
        if tag == "tr" and self.table in self.rows:
            self.rows[self.table] += 1
        self.cells += tag == "td" and "cell" in classes
        self.scripts += tag == "script"
        self.opened += tag == "details" and "open" in dict(attrs)


def forty_hosts() -> list[Results]:
    """40 hosts of five shapes, every driver on some, failures on a few, as a fleet shows."""
    golden = requirements.load()
    shapes = [
        ("h100x8", GPUS),
        ("a100-mig", [{**GPUS[0], "model": "NVIDIA A100-SXM4-80GB", "mig_gpus": 8}]),
        ("l4", [{**GPUS[0], "model": "NVIDIA L4", "count": 1, "mig_gpus": 0, "mig_instances": {}}]),
        ("mi300", [{**GPUS[0], "vendor": "amd", "model": "AMD Instinct MI300X", "mig_gpus": 0,
                    "mig_instances": {}, "driver": "amdgpu in Linux 6.8.0-45-generic"}]),
        ("one-gpu", [{**GPUS[0], "count": 1, "mig_gpus": 0, "mig_instances": {}}]),
    ]  # fmt: skip
    reports = []
    for index in range(40):
        sku, gpus = shapes[index % len(shapes)]
        reference = (
            fails(golden.requirements[index % 20].id, HOSTILE) if index % 13 == 7 else passes()
        )
        podman = fails("GPU-EXACT-01", "got GPU-1 for GPU-0", "podman")
        tests = [*reference, *passes("docker"), *(podman if index % 9 == 4 else passes("podman"))]
        name = f"gpu-node-{index:02d}.{sku}.cluster.example.com"
        drivers = ("reference", "docker", "podman", "kubernetes")
        reports.append(host_report(name, tests, drivers, gpus=gpus))
    return reports


def test_forty_hosts_render_in_a_browser_one_row_per_host(tmp_path: Path) -> None:
    browser = chromium()
    fleet = merged(tmp_path, *forty_hosts())
    REPORTS.mkdir(exist_ok=True)
    out = REPORTS / "fleet-showcase"
    page = fleet_render.write(fleet, out)[2]
    dom = headless(browser, tmp_path / "profile-dom", "--dump-dom", page.as_uri())
    counter = FleetCounter()
    counter.feed(dom)
    assert counter.rows["hosts"] == 40 + 1
    assert counter.rows["matrix"] == len(fleet.requirement_ids) + 1
    assert counter.cells == len(fleet.requirement_ids) * len(fleet.drivers)
    assert counter.scripts == 0, "a hostile message became a script"
    assert counter.opened == 0, "details are one click away, closed"
    screenshot = out / "conformance.png"
    screenshot.unlink(missing_ok=True)
    headless(
        browser,
        tmp_path / "profile-shot",
        f"--screenshot={screenshot}",
        "--window-size=1400,2400",
        "--hide-scrollbars",
        page.as_uri(),
    )
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
