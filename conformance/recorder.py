"""The run's per-requirement results: each test's entry, the reports, the matrix, the verdicts.

One ``Recorder`` per run, registered by the plugin when the run is configured: the state
of a run is the object's, so that runs in one process (pytester) never mix.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from conformance import identity, requirements
from conformance.render import NOTHING_RAN, matrix_lines, skip_lines, to_markdown, write
from conformance.report import Entry, Results, entry
from conformance.settings import Settings, driver_of, gpu_model, gpu_properties, settings_key
from drivers.base import Driver, Elsewhere


class Recorder:
    """Collects each test's entry; at the end, writes the reports and sets the exit status."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.results: Results | None = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        """Mark the tests of a driver that could not run with the reason, for the report."""
        try:
            return (yield)
        finally:
            reason = item.config.stash[settings_key].unavailable.get(driver_of(item) or "")
            if reason is not None:
                item.user_properties.append(("unavailable", reason))

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        found = entry(report)
        if found is not None:
            self.entries.append(found)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = session.config
        if hasattr(config, "workerinput") or not self.entries:
            return
        results = self.results = results_of(config, self.entries)
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            # A run in which every driver was skipped checked nothing: it must not pass. A
            # lane is one driver of such a run: conformance.lanes judges the whole.
            lane = config.getoption("--lane") is not None
            if (results.nothing_ran and not lane) or results.gate_fails():
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        elif (
            session.exitstatus == pytest.ExitCode.TESTS_FAILED
            and not results.gate_fails()
            and session.testsfailed == results.optional_failures()
        ):
            # Only optional requirements failed: reported, but they do not gate.
            session.exitstatus = pytest.ExitCode.OK
        markdown = config.getoption("--conformance-markdown")
        write(
            results,
            config.getoption("--conformance-json"),
            config.getoption("--conformance-html"),
            markdown,
        )
        step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if markdown and step_summary:
            with open(step_summary, "a", encoding="utf-8") as summary:
                summary.write(to_markdown(results))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> Iterator[None]:
        """The matrix and the verdicts, last: after pytest's failures and short summary."""
        yield
        results = self.results
        if results is None:
            return
        config = terminalreporter.config
        write_line = terminalreporter.write_line
        _skips_by_reason(terminalreporter)
        terminalreporter.section("conformance by requirement")
        for line in matrix_lines(results):
            write_line(line)
        terminalreporter.section("verdict")
        if results.nothing_ran and config.getoption("--lane") is None:
            write_line(NOTHING_RAN, red=True)
        for verdict in results.verdicts:
            write_line(verdict.line, red=verdict.status != "PASS", green=verdict.status == "PASS")


def results_of(config: pytest.Config, entries: list[Entry]) -> Results:
    """The run's results: its header, drivers, requirements and every test's entry."""
    settings = config.stash[settings_key]
    host = settings.host
    golden = requirements.load()
    gpus = gpu_properties(host)
    header = {
        "session": settings.session_id,
        "simulated": host.simulated is not None,
        "host": host.describe(),
        "hostname": socket.gethostname(),
        "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu_model": gpus["gpu_model"],
        "gpu_count": gpus["gpu_count"],
        "require_complete": config.getoption("--require-complete"),
        **identity.header(host),
    }
    place = _runs_on(settings)
    if place is not None:
        header.update(
            simulated=place.simulated,
            host=place.description,
            runs_on=place.description,
            hostname=place.name,
            gpu_model=gpu_model(place.gpus),
            gpu_count=len(place.gpus),
            **identity.header_elsewhere(place),
        )
    return Results(
        header=header,
        drivers={
            name: {"version": _version(cls, settings), "explicit": settings.explicit}
            for name, cls in settings.drivers.items()
        },
        requirements=[
            {
                "id": req.id,
                "statement": req.statement,
                "levels": {name: golden.level(req.id, name) for name in settings.drivers},
            }
            for req in golden.requirements
        ],
        tests=list(entries),
    )


def _runs_on(settings: Settings) -> Elsewhere | None:
    """Where the one driver a run judged runs its sandboxes, when that is not this host."""
    if len(settings.drivers) != 1:
        return None
    (cls,) = settings.drivers.values()
    try:
        return cls(settings.host, settings.session_id, settings.image).runs_on()
    except Exception as exc:  # a report must not be lost to a driver's bug
        sys.stderr.write(f"gpu-sandbox: where {cls.name} runs is unknown: {exc}\n")
        return None


def _version(cls: type[Driver], settings: Settings) -> str:
    try:
        return cls(settings.host, settings.session_id, settings.image).version()
    except Exception as exc:  # a report must not be lost to a driver's bug
        return f"unknown ({type(exc).__name__}: {exc})"


def _skips_by_reason(terminalreporter: pytest.TerminalReporter) -> None:
    reasons = [
        str(report.longrepr[2]).removeprefix("Skipped: ")
        if isinstance(report.longrepr, tuple)
        else ""
        for report in terminalreporter.stats.get("skipped", [])
    ]
    lines = skip_lines(reasons)
    if lines:
        terminalreporter.section("skipped, by reason")
    for line in lines:
        terminalreporter.write_line(line)
