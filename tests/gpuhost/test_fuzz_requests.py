"""Requests, near misses and noise, through ``parse_spec`` and every built-in driver's plan.

A property each: a request is accepted, or refused with one of the project's typed errors
that names its field and shows its value, on one line, before anything is taken; an
accepted request is the same request after a round trip through its JSON form. The drivers
are the built-in ones answering offline (``tests.offline_drivers``): their ``create`` runs
up to ``start``, which stops it, so that what an accepted request took is given back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from gpuhost import cdi, simulated
from gpuhost.errors import GpuAllocationError, RequestError, shown
from gpuhost.host import GpuHost, HostConfig
from gpuhost.requestjson import MAX_DEPTH
from gpuhost.spec import (
    DEVICE_IDS_KEY,
    VENDORS,
    SandboxSpec,
    parse_spec,
    select,
)
from tests.offline_drivers import OFFLINE, NotStarted

pytestmark = pytest.mark.fuzz

FIELD_ROOTS = {"spec", "resource_requirements", "template", "driver_config", "image", "env"}
"""What a refused request's field starts with: a key of the request (or one it had before
seed 003), or ``spec``, the request as a whole."""
MESSAGE_LIMIT = 1000
"""A message is a line a person reads: the value is cut, the host's own lists are short."""
ODD_TEXT = ["", " ", "\n", "\x00", "\ud800", "a\x00b", " busybox\n", "٣", "1_0", "9" * 5000]
"""Strings that once went through unrefused, or whole into a message."""

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(70, 4300).map(lambda digits: 1 - 10**digits)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(ODD_TEXT),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
"""Any value a field may hold when it is not what the request model says (NaN too)."""


class OfflineHost:
    """The built-in drivers of one simulated host, and the exact IDs to try on each."""

    def __init__(self, host: GpuHost) -> None:
        self.host = host
        self.drivers = [cls(host, "fuzz") for cls in OFFLINE]
        pci = host.gpus[1].pci_bus_id
        misses = ["1\n", "01", "0001", f" {pci}", f"{pci}\t", pci.upper(), "99999999999"]
        self.ids = {
            driver.name: [
                *sorted(
                    {i for device in driver.exact_devices() for i in driver.device_ids(device)}
                ),
                cdi.all_devices(host.gpus[0].cdi_kind),
                *misses,
                *ODD_TEXT,
            ]
            for driver in self.drivers
        }
        """Each driver's exact IDs of every device, near misses, and odd text."""


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OfflineHost]:
    """Four GPUs, the first in MIG mode with two instances, an AMD and an Intel GPU beside."""
    root = tmp_path_factory.mktemp("fuzz-requests") / "sim"
    sim = simulated.setup(root, 4, mig={0: ["1g.10gb", "1g.10gb"]}, dri={"amd": 1, "intel": 1})
    yield OfflineHost(GpuHost.open(HostConfig(sim.root)))
    simulated.teardown(sim.root)


_ABSENT = object()


def _rarely(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly ``usual``, one time in sixteen ``odd``: most requests are near misses."""
    return st.integers(0, 15).flatmap(lambda n: odd if n == 0 else usual)


def _object(
    often: dict[str, st.SearchStrategy[Any]], seldom: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """An object with the ``often`` fields three times in four, the ``seldom`` one in eight.

    Now and then with a key nobody knows.
    """

    def maybe(value: st.SearchStrategy[Any], one_in: int, absent: bool) -> st.SearchStrategy[Any]:
        return st.integers(0, one_in - 1).flatmap(
            lambda n: st.just(_ABSENT) if (n == 0) == absent else value
        )

    there = {key: maybe(value, 4, True) for key, value in often.items()}
    there |= {key: maybe(value, 8, False) for key, value in seldom.items()}
    unknown = st.dictionaries(st.sampled_from(["bogus", "device_ids", "gpus"]), json_values)
    return st.builds(
        lambda obj, more: {**{k: v for k, v in obj.items() if v is not _ABSENT}, **more},
        st.fixed_dictionaries(there),
        _rarely(st.just({}), unknown),
    )


def _block(driver: str, ids: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A driver's block: mostly exact IDs of its own, or its options; others' now and then."""
    strings = st.sampled_from(ODD_TEXT) | st.text(max_size=5)
    id_lists = _rarely(st.lists(st.sampled_from(ids), min_size=1, max_size=3), json_values)
    selector = st.dictionaries(
        st.sampled_from(["gpu", "nvidia.com/gpu.product", ""]),
        st.sampled_from(["h100", "", "a b"]),
        max_size=2,
    )
    options = {
        "runtime_class_name": _rarely(st.sampled_from(["nvidia", "runc"]), strings),
        "node_selector": _rarely(selector, json_values),
        "image": _rarely(st.just("busybox:1.36"), strings),
    }
    choices = {
        "mig_profile": _rarely(st.sampled_from(["1g.10gb", "7g.80gb"]), json_values),
        "vendor": _rarely(st.sampled_from(VENDORS), json_values),
    }
    if driver == "kubernetes":
        return _object(options, {DEVICE_IDS_KEY: id_lists, **choices})
    return _object({DEVICE_IDS_KEY: id_lists}, {"cdi_devices": id_lists, **choices, **options})


def requests(ids: dict[str, list[str]]) -> st.SearchStrategy[Any]:
    """Requests in seed 003's shape, with each driver's exact IDs, and odd values here and there."""
    strings = st.sampled_from(ODD_TEXT) | st.text(max_size=5)
    envelope = _object(
        {name: _rarely(_block(name, names), json_values) for name, names in ids.items()},
        {"other": json_values},
    )
    gpu = _object(
        {"count": _rarely(st.none() | st.integers(-1, 9), json_values)},
        {"sharing": _rarely(st.sampled_from(["exclusive", "shared"]), json_values)},
    )
    template = _object(
        {"driver_config": _rarely(envelope, json_values)},
        {
            "image": _rarely(st.sampled_from(["busybox", "gpu-sandbox-busybox:latest"]), strings),
            "env": _rarely(st.dictionaries(st.sampled_from(["A", "B_1"]), strings), json_values),
        },
    )
    return _rarely(
        _object(
            {
                "resource_requirements": _rarely(
                    _object({"gpu": _rarely(gpu, json_values)}, {}), json_values
                ),
                "template": _rarely(template, json_values),
            },
            {},
        ),
        json_values,
    )


def texts(ids: dict[str, list[str]]) -> st.SearchStrategy[str]:
    """A request's JSON text, or that text with what JSON leaves open worked into it."""
    written = requests(ids).map(json.dumps)
    return st.one_of(
        written,
        written.map(lambda text: text.replace("{", '{"template": {}, ', 1)),  # a key twice
        written.map(lambda text: text.replace("null", "NaN", 1).replace("1", "1e400", 1)),
        written.map(lambda text: text.replace("0", "9" * 4400, 1)),
        st.integers(MAX_DEPTH - 2, 3000).map(lambda depth: "[" * depth + "]" * depth),
        st.text(max_size=20),
    )


def assert_named(error: RequestError) -> None:
    """A refusal names its field and shows its value, on one short line."""
    __tracebackhide__ = True
    message = str(error)
    assert error.field.split(".")[0].split("[")[0] in FIELD_ROOTS, error.field
    assert error.field.isprintable(), repr(error.field)
    assert "\n" not in message, message
    assert len(message) < MESSAGE_LIMIT, message
    assert shown(error.value) in message, (shown(error.value), message)


def accepted_or_refused(offline: OfflineHost, data: Any) -> SandboxSpec | None:
    """The spec each driver accepted or refused by name, nothing left taken; None if none."""
    __tracebackhide__ = True
    try:
        spec = parse_spec(data)
    except RequestError as refused:
        assert_named(refused)
        event(f"parse_spec: {type(refused).__name__}")
        return None
    for driver in offline.drivers:
        before = driver.allocations
        try:
            driver.create(spec)
        except RequestError as refused:
            assert_named(refused)
            assert driver.allocations == before, f"{driver.name} refused after taking GPUs"
            event(f"{driver.name}: {type(refused).__name__}")
        except (NotStarted, GpuAllocationError) as stopped:
            event(f"{driver.name}: {type(stopped).__name__}")
    assert offline.host.leases.leases() == [], "a lease was left"
    return spec


def assert_round_trips(offline: OfflineHost, spec: SandboxSpec) -> None:
    """The spec, and each driver's plan of it, after its JSON form is read back."""
    __tracebackhide__ = True
    again = parse_spec(json.dumps(spec.to_dict()))
    assert again == spec
    assert parse_spec(spec.to_dict()) == spec
    for driver in offline.drivers:
        try:
            plan = driver.plan(select(spec, driver.name))
        except RequestError:
            continue
        assert driver.plan(select(again, driver.name)) == plan


@pytest.fixture(scope="module")
def inputs(offline: OfflineHost) -> dict[str, st.SearchStrategy[Any]]:
    """The requests to try, made once: building them is most of an example's time."""
    return {"objects": requests(offline.ids), "json-text": texts(offline.ids)}


@pytest.mark.parametrize("form", ["objects", "json-text"])
@given(data=st.data())
def test_a_request_is_accepted_or_refused_by_name_and_round_trips(
    offline: OfflineHost, inputs: dict[str, st.SearchStrategy[Any]], form: str, data: st.DataObject
) -> None:
    """Requests as objects, and as JSON text with what JSON leaves open worked into it."""
    spec = accepted_or_refused(offline, data.draw(inputs[form], label="request"))
    if spec is not None:
        assert_round_trips(offline, spec)
