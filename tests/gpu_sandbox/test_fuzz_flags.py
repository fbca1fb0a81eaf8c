"""``gpu-sandbox spec`` on generated argument lists, in-process, on every built-in driver.

The flags, their values (odd digits, odd JSON, odd bytes in files and on stdin) and whole
requests: a property each. The command exits 0, or exits 2 with one line that names the
flag or the field (never a traceback, never another status), and nothing is taken; what
``spec --json`` prints is strict JSON, and the request it accepted reads back the same.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from gpu_sandbox.cli import main
from gpu_sandbox.options import EXIT_USAGE
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import parse_spec
from tests.gpuhost.test_fuzz_requests import ODD_TEXT, OfflineHost, json_values, requests
from tests.offline_drivers import OFFLINE

pytestmark = pytest.mark.fuzz

DRIVER_PATH = "tests.offline_drivers"
"""Where each built-in driver answering offline is (no engine, no cluster), for --driver."""
TYPED = re.compile(r"\((\w+) at (\S+)\)$")
"""How the line of a refused request ends: its error's type and field."""
NAMES_A_FLAG = re.compile(r"^gpu-sandbox(?: spec)?: error: (?:argument )?--[a-z-]+")
"""How the line of a refused flag begins."""


@dataclass
class Host:
    """The simulated host the commands run on, and a file for ``@FILE`` and ``--request``."""

    root: Path
    file: Path
    gpus: GpuHost
    """The host as this process sees it, for its leases (one: each holds files open)."""
    ids: dict[str, list[str]]
    """Each driver's exact IDs, their near misses, and odd text (``OfflineHost.ids``)."""


@dataclass(frozen=True)
class Ran:
    status: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """Four GPUs, the first in MIG mode with two instances, an AMD GPU beside them."""
    base = tmp_path_factory.mktemp("fuzz-flags")
    sim = simulated.setup(base / "sim", 4, mig={0: ["1g.10gb", "1g.10gb"]}, dri={"amd": 1})
    gpus = GpuHost.open(HostConfig(sim.root))
    yield Host(sim.root, base / "input", gpus, OfflineHost(gpus).ids)
    simulated.teardown(sim.root)


def spec(host: Host, argv: list[str], stdin: bytes = b"") -> Ran:
    """``gpu-sandbox spec ARGV --sim-root=…``, in this process."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(["spec", *argv, f"--sim-root={host.root}"])
            except SystemExit as exit_:  # argparse's refusals
                status = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.stdin = saved
    return Ran(status, out.getvalue(), err.getvalue())


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in what spec --json printed")

    return json.loads(text, parse_constant=refuse)


def assert_answered(host: Host, ran: Ran, as_json: bool) -> None:
    """Exit 0, or 2 with one line naming the flag or the field; strict JSON; nothing taken."""
    __tracebackhide__ = True
    assert ran.status in (0, EXIT_USAGE), ran
    assert "Traceback" not in ran.stderr, ran.stderr
    if ran.status == EXIT_USAGE:
        lines = ran.stderr.splitlines()
        assert len(lines) == 1, ran.stderr
        named = TYPED.search(lines[0]) or NAMES_A_FLAG.match(lines[0])
        assert named, lines[0]
        event(f"refused: {named[1] if named.re is TYPED else named[0].rsplit(' ', 1)[-1]}")
    else:
        assert ran.stderr == ""
        event("valid")
    if as_json and ran.stdout:
        report = _strict(ran.stdout)
        assert report["valid"] is (ran.status == 0)
        if report["valid"]:
            assert report["unresolved"] is None, report["unresolved"]
            assert parse_spec(json.dumps(report["spec"])) == parse_spec(report["spec"])
    assert host.gpus.leases.leases() == []


def _now_and_then(
    usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """Mostly ``usual``, one time in six ``odd``."""
    return st.integers(0, 5).flatmap(lambda n: odd if n == 0 else usual)


counts = _now_and_then(
    st.integers(-2, 9).map(str),
    st.sampled_from(["٣", "1_0", " 3", "+3", "3.0", "0x3", "9" * 5000, "", "-0"])
    | st.text(max_size=4),
)
odd_text = st.sampled_from(ODD_TEXT) | st.text(max_size=4)
block_texts = st.one_of(
    json_values.map(json.dumps),
    st.sampled_from(
        [
            '{"gpu_device_ids": ["0"], "gpu_device_ids": []}',
            '{"x": NaN}',
            '{"x": 1e400}',
            '{"x": %s}' % ("9" * 5000),
            "[" * 2000 + "]" * 2000,
            "{nope",
        ]
    ),
)


def arguments(ids: dict[str, list[str]]) -> st.SearchStrategy[tuple[list[str], bytes]]:
    """The flags of one command on each driver, and what it reads from a file or stdin."""
    contents = st.one_of(
        requests(ids).map(lambda request: json.dumps(request).encode()),
        block_texts.map(str.encode),
        st.binary(max_size=8),
    )
    images = st.sampled_from(["busybox", "gpu-sandbox-busybox:latest"])
    common = [
        st.just("--gpu"),
        counts.map(lambda count: f"--gpu-count={count}"),
        _now_and_then(st.sampled_from(["exclusive", "shared"]), odd_text).map(
            lambda mode: f"--gpu-sharing={mode}"
        ),
        block_texts.map(lambda block: f"--driver-config-json={block}"),
        st.just("--driver-config-json=@{file}"),
        _now_and_then(images, odd_text).map(lambda image: f"--image={image}"),
        _now_and_then(st.sampled_from(["A=1", "B_1="]), odd_text).map(lambda pair: f"--env={pair}"),
    ]
    whole = st.sampled_from(["--request=-", "--request={file}"])
    each = []
    for cls in OFFLINE:
        devices = _now_and_then(st.sampled_from(ids[cls.name]), odd_text)
        flag = st.one_of(*common, devices.map(lambda device: f"--gpu-device={device}"))
        flags = st.one_of(  # a whole request one time in five, now and then beside a flag
            *[st.lists(flag, max_size=4)] * 4,
            st.tuples(whole, st.lists(flag, max_size=1)).map(lambda r: [r[0], *r[1]]),
        )
        driver = [f"--driver={DRIVER_PATH}:{cls.__name__}"]
        each.append(st.tuples(st.just(driver), flags, st.sampled_from([[], ["--json"]])))
    argv = st.one_of(each).map(lambda parts: [arg for part in parts for arg in part])
    return st.tuples(argv, contents)


@pytest.fixture(scope="module")
def argv(host: Host) -> st.SearchStrategy[tuple[list[str], bytes]]:
    """The argument lists to try, made once."""
    return arguments(host.ids)


@given(data=st.data())
def test_spec_exits_0_or_2_naming_the_flag_and_takes_nothing(
    host: Host, argv: st.SearchStrategy[tuple[list[str], bytes]], data: st.DataObject
) -> None:
    args, contents = data.draw(argv, label="arguments")
    host.file.write_bytes(contents)
    args = [arg.replace("{file}", str(host.file)) for arg in args]
    assert_answered(host, spec(host, args, contents), "--json" in args)
