"""Forms of a name: every spelling that names a device, and every near miss that names none.

GPU-VALIDATE-03: an ID is one of the spellings a driver lists for a device (``device_ids``; a
PCI address in either letter case), and any other spelling is unknown. A driver that takes
more (a unique prefix of a UUID, as ``CUDA_VISIBLE_DEVICES`` abbreviates it; a CDI name of
another kind; a MIG profile matched by its slice alone) serves a device nobody named.

The forms and the transforms are enumerations the tests and the planted breakers share: the
tests (conformance/test_validation.py) try every transform of every form each device has,
and tests/breakers/forms.py generates, from the same tuples, one breaker per value.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Collection, Iterable

from drivers.base import Driver
from gpuhost.devices import GpuDevice, normalize_pci_bus_id, pci_spellings

FORMS = (
    "index",
    "UUID",
    "CDI name by index",
    "CDI name by UUID",
    "PCI address",
    "DRI node",
    "MIG UUID",
    "MIG CDI name by index",
    "MIG CDI name by UUID",
)
"""What an ID of a device is, by what of the device it spells (``form_of``)."""
ANOTHER_FORM = "another form"
"""An ID a driver lists that spells none of the device's own names (a name of its own)."""
A_NODE = "a device node's path"
"""Where one of the device's nodes is: no ID, unless a driver lists it (a DRI node)."""

EXACT_FORMS = ("index", "UUID", "CDI name by index", "CDI name by UUID", "PCI address")
"""The forms of a whole GPU's ID that a driver may list (GPU-EXACT-01 asks each GPU by all)."""

DEVICES = ("a whole GPU", "a MIG instance", "an AMD or Intel GPU")
"""The kinds of device whose names are tried: one of each the host has (``representatives``)."""

PCI_CASES = ("lower case", "upper case")
"""A PCI address names its device in either letter case (the kernel's, NVML's)."""


def form_of(device: GpuDevice, device_id: str) -> str:
    """The form of ``device_id``, one of ``device``'s IDs: one of ``FORMS``, or another."""
    mig = "MIG " if device.is_mig else ""
    if device_id == device.uuid:
        return f"{mig}UUID"
    if device_id in device.cdi_names:
        by = "index" if device_id == device.cdi_names[0] else "UUID"
        return f"{mig}CDI name by {by}"
    if not device.is_mig:
        if device.vendor == "nvidia" and device_id == str(device.index):
            return "index"
        if is_pci_address(device_id) and normalize_pci_bus_id(device_id) == device.pci_bus_id:
            return "PCI address"
        if device_id in device.dri_paths:
            return "DRI node"
    if device_id in {path for node in device.nodes for path in (node.path, node.source)}:
        return A_NODE
    return ANOTHER_FORM


def is_pci_address(device_id: str) -> bool:
    """Whether ``device_id`` is a PCI address, in any letter case or form (``0000:c1:00.0``)."""
    try:
        normalize_pci_bus_id(device_id)
    except ValueError:
        return False
    return device_id == device_id.strip()


def pci_case(address: str, case: str) -> str:
    """``address`` written in ``case``, one of ``PCI_CASES``."""
    return address.lower() if case == PCI_CASES[0] else address.upper()


def representatives(driver: Driver) -> dict[str, GpuDevice]:
    """One device of each kind of ``DEVICES`` the host has, whether the driver takes it or not.

    The second whole NVIDIA GPU (not only the first), the last MIG instance, the last AMD or
    Intel GPU (an AMD GPU's PCI address has letters, on the simulated host as on real ones).
    """
    host = driver.host
    whole = [gpu for gpu in host.gpus if not gpu.mig_enabled]
    found = {
        DEVICES[0]: whole[min(1, len(whole) - 1)] if whole else None,
        DEVICES[1]: host.mig_devices[-1] if host.mig_devices else None,
        DEVICES[2]: host.dri_gpus[-1] if host.dri_gpus else None,
    }
    return {kind: device for kind, device in found.items() if device is not None}


# -- the near misses ------------------------------------------------------------------------

Known = Collection[str]
Spell = Callable[[str, GpuDevice, Known], tuple[str, ...]]
"""A transform: the spellings it makes of one of the device's IDs, given every ID the driver
takes (a unique prefix is unique among them). Which of them are IDs after all, the test
decides (``near_misses``)."""

OTHER_KINDS = ("amd.com/gpu", "intel.com/gpu", "nvidia.com/gpu", "sim-00000000.nvidia.com/gpu")
"""CDI kinds no device of a simulated host has (each has a kind of its own): another vendor's,
NVIDIA's where the host's is another, another simulated host's. On a host whose kind is one
of them, that one is the host's, and no near miss."""

PREFIX_LENGTHS = (
    "the shortest unique prefix",
    "the UUID's first group",
    "half",
    "all but the last character",
)
"""How much of an ID a prefix keeps: the shortest that only this ID starts with, a UUID to the
end of its first group (``GPU-8932f937``, as CUDA_VISIBLE_DEVICES and nvidia-smi abbreviate
it), half of it, all of it but its last character."""

_UUID_FIRST_GROUP = re.compile(r"^.*?(?:GPU|MIG)-[0-9a-fA-F]+")


def _case(upper: bool) -> Spell:
    def spell(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
        if is_pci_address(device_id):
            return ()  # either case of a PCI address is an ID
        return (device_id.upper() if upper else device_id.lower(),)

    return spell


def shortest_unique_prefix(device_id: str, known: Known) -> str | None:
    """The shortest prefix of ``device_id`` that no other of ``known`` starts with, if shorter."""
    others = sorted(set(known) - {device_id})
    at = bisect.bisect_left(others, device_id)
    neighbours = [others[i] for i in (at - 1, at) if 0 <= i < len(others)]
    shared = max((_common(device_id, other) for other in neighbours), default=0)
    return device_id[: shared + 1] if shared + 1 < len(device_id) else None


def _common(one: str, other: str) -> int:
    """How many characters ``one`` and ``other`` share from their start."""
    pairs = zip(one, other, strict=False)
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], pairs))


def _prefix(length: str) -> Spell:
    def spell(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
        if length == PREFIX_LENGTHS[0]:
            prefix = shortest_unique_prefix(device_id, known)
        elif length == PREFIX_LENGTHS[1]:
            match = _UUID_FIRST_GROUP.match(device_id)
            prefix = match[0] if match else None
        elif length == PREFIX_LENGTHS[2]:
            prefix = device_id[: len(device_id) // 2]
        else:
            prefix = device_id[:-1]
        return (prefix,) if prefix and prefix != device_id else ()

    return spell


def _kind(kind: str) -> Spell:
    def spell(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
        form = form_of(device, device_id)
        if kind == device.cdi_kind or form in ("PCI address", "DRI node", ANOTHER_FORM):
            return ()
        name = device_id.partition("=")[2] if "CDI name" in form else device_id
        return (f"{kind}={name}",)

    return spell


INDEX_SPELLINGS = (
    "a leading zero",
    "a sign",
    "white space before",
    "a line break after",
    "an underscore",
    "other decimal digits",
)
"""How ``int()`` reads an index that is not its decimal written plainly (``03``, ``+3``, `` 3``,
``3\\n``, ``0_3``, fullwidth digits): a driver that parses the index of an ID (a bare index, a
CDI name's) with it takes each for the index."""
_LAST_NUMBER = re.compile(r"^(?P<head>.*?)(?P<number>[0-9]+)$")
_BY_INDEX = ("index", "CDI name by index", "MIG CDI name by index")


def _index_spelled(how: str) -> Spell:
    def spell(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
        match = _LAST_NUMBER.match(device_id)
        if match is None or form_of(device, device_id) not in _BY_INDEX:
            return ()
        head, number = match["head"], match["number"]
        spelled = {
            INDEX_SPELLINGS[0]: (f"0{number}",),
            INDEX_SPELLINGS[1]: (f"+{number}", *(("-0",) if number == "0" else ())),
            INDEX_SPELLINGS[2]: (f" {number}", f"\t{number}"),
            INDEX_SPELLINGS[3]: (f"{number}\n",),
            INDEX_SPELLINGS[4]: (f"{number[0]}_{number[1:]}" if number[1:] else f"0_{number}",),
            INDEX_SPELLINGS[5]: ("".join(chr(0xFF10 + int(digit)) for digit in number),),
        }[how]
        return tuple(head + number_spelled for number_spelled in spelled)

    return spell


PCI_FORMS = (
    "NVML's: an 8-digit domain",
    "lspci's: no domain",
    "a domain of another width",
    "white space around",
)
"""How else a PCI address can be written (``normalize_pci_bus_id`` reads each): as NVML and
nvidia-smi write it (``00000000:C1:00.0``), as lspci does (``c1:00.0``), with a domain of 5 to 7
digits, with white space around. Each in either letter case: no ID unless the driver lists
it (``device_index``)."""


def _pci_form(how: str) -> Spell:
    def spell(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
        if not is_pci_address(device_id):
            return ()
        address = normalize_pci_bus_id(device_id)
        domain, _, rest = address.partition(":")
        spelled = {
            PCI_FORMS[0]: (f"0000{domain}:{rest}",),
            PCI_FORMS[1]: (rest,),
            PCI_FORMS[2]: (f"0{domain}:{rest}", f"000{domain}:{rest}"),
            PCI_FORMS[3]: (f" {address}", f"{address}\n"),
        }[how]
        return tuple(dict.fromkeys(pci_case(s, case) for s in spelled for case in PCI_CASES))

    return spell


UUID_SPELLINGS = ("bare: without its kind", "bare, without hyphens", "under the other kind")
"""How else a UUID can be written: without its ``GPU-`` or ``MIG-`` (as NVML's bytes, DCGM and
some tools print it), as hex digits alone, under the other kind (``MIG-`` for ``GPU-``). In a
UUID, and in a CDI name by UUID."""
_UUID = re.compile(r"(?P<kind>GPU|MIG)-(?P<hex>[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12})", re.I)


def _uuid_spelled(how: str) -> Spell:
    def spell(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
        match = _UUID.search(device_id)
        if match is None:
            return ()
        other = "MIG" if match["kind"] == "GPU" else "GPU"
        respelled = {
            UUID_SPELLINGS[0]: match["hex"],
            UUID_SPELLINGS[1]: match["hex"].replace("-", ""),
            UUID_SPELLINGS[2]: f"{other}-{match['hex']}",
        }[how]
        return (device_id[: match.start()] + respelled + device_id[match.end() :],)

    return spell


def _node_paths(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
    return tuple(node.path for node in device.nodes)


def _node_sources(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
    return tuple(node.source for node in device.nodes if node.source != node.path)


def host_names(device: GpuDevice) -> tuple[str, ...]:
    """What the host calls ``device``: its index, UUID, CDI names and PCI address."""
    index = (str(device.index),) if device.vendor == "nvidia" and not device.is_mig else ()
    pci = () if device.is_mig else pci_spellings(device.pci_bus_id)
    return (*index, device.uuid, *device.cdi_names, *pci)


def _unlisted(device_id: str, device: GpuDevice, known: Known) -> tuple[str, ...]:
    return host_names(device)


TRANSFORMS: dict[str, Spell] = {
    "another letter case: upper": _case(upper=True),
    "another letter case: lower": _case(upper=False),
    **{f"a prefix: {length}": _prefix(length) for length in PREFIX_LENGTHS},
    **{f"a CDI name of another kind: {kind}": _kind(kind) for kind in OTHER_KINDS},
    **{f"an index as int() reads it: {how}": _index_spelled(how) for how in INDEX_SPELLINGS},
    **{f"a PCI address in another form: {how}": _pci_form(how) for how in PCI_FORMS},
    **{f"a UUID spelled otherwise: {how}": _uuid_spelled(how) for how in UUID_SPELLINGS},
    "the device node's path": _node_paths,
    "the device node's path on the host": _node_sources,
    "a name of the host's that the driver does not list": _unlisted,
}
"""Every transform of an ID that must name no device, by its label: the dimension's values."""
OF_THE_DEVICE = frozenset(list(TRANSFORMS)[-3:])
"""The transforms that spell the device itself, not one of its IDs."""

PREFIX_FORMS = ("UUID", "CDI name by UUID", "PCI address", "MIG UUID", "MIG CDI name by UUID")
"""The forms an ID has a prefix only it starts with (an index's is another index, or none)."""
CASE_FORMS = (
    "UUID", "CDI name by index", "CDI name by UUID", "MIG UUID", "MIG CDI name by index",
    "MIG CDI name by UUID", "DRI node",
)  # fmt: skip
"""The forms whose letter case a driver could fold (a PCI address is an ID in either case)."""


def near_misses(driver: Driver, device: GpuDevice, transform: str) -> list[tuple[str, str, str]]:
    """Each spelling ``transform`` makes of ``device``'s IDs that names no device, once.

    As ``(spelling, form, what)``: the form of the ID it was made from, and the ID (for
    transforms of the device itself, ``OF_THE_DEVICE``: the spelling's form, the device). A
    spelling that is an ID of the driver (every form of a PCI address it takes, it lists:
    ``device_index``) is left out.
    """
    index = driver.device_index()
    known = list(index)
    of_device = transform in OF_THE_DEVICE
    sources = [device.uuid] if of_device else [i for i in driver.device_ids(device) if i in index]
    made: dict[str, tuple[str, str]] = {}
    for device_id in sources:
        for spelling in TRANSFORMS[transform](device_id, device, known):
            if spelling in index or not spelling.strip():
                continue
            form = form_of(device, spelling if of_device else device_id)
            made.setdefault(spelling, (form, device.describe() if of_device else device_id))
    return [(spelling, form, source) for spelling, (form, source) in made.items()]


def respellings(
    index: Iterable[str], device_of: Callable[[str], GpuDevice], spell: Spell
) -> dict[str, str]:
    """Each spelling ``spell`` makes of an ID of ``index``, with the ID (the first, if several).

    What a driver that takes the transform for the ID itself looks up: the planted breakers.
    """
    known = list(index)
    found: dict[str, str] = {}
    for device_id in known:
        for spelling in spell(device_id, device_of(device_id), known):
            found.setdefault(spelling, device_id)
    return found


# -- a MIG profile's near misses -----------------------------------------------------------

PROFILE_TRANSFORMS = (
    "another memory size",
    "another slice count",
    "the slice alone",
    "the memory alone",
    "upper case",
    "all but the last character",
    "a variant's suffix",
    "NVML's name",
    "the k8s resource",
    "the k8s resource's name",
    "a product name's suffix",
    "white space before",
)
"""How a MIG profile the host lacks can look like one it has (``1g.20gb`` where it has
``1g.10gb``, ``1g``, ``1G.10GB``, ``1g.10gb+me``), or spell it as another tool does (NVML's
and nvidia-smi's ``MIG 1g.10gb``, the k8s resource ``nvidia.com/mig-1g.10gb`` and its name
``mig-1g.10gb``, a product name's ``MIG-1g.10gb``, `` 1g.10gb``): each must be refused, not
served by a driver that matches the slice alone, a prefix, folds case or reads the others'
spellings."""
_PROFILE = re.compile(r"(?P<slices>\d+)g\.(?P<memory>\d+)gb(?P<rest>.*)")


def profile_near_miss(profile: str, have: Collection[str], transform: str) -> str | None:
    """``profile`` (one the host has) as ``transform`` spells it; None if that is one too."""
    match = _PROFILE.fullmatch(profile)
    if match is None:
        return None
    slices, memory, rest = int(match["slices"]), int(match["memory"]), match["rest"]
    candidates: Iterable[str] = {
        "another memory size": (f"{slices}g.{memory * 2**k}gb{rest}" for k in range(1, 8)),
        "another slice count": (f"{slices + k}g.{memory}gb{rest}" for k in range(1, 8)),
        "the slice alone": (f"{slices}g",),
        "the memory alone": (f"{memory}gb",),
        "upper case": (profile.upper(),),
        "all but the last character": (profile[:-1],),
        "a variant's suffix": (f"{profile}+me",),
        "NVML's name": (f"MIG {profile}",),
        "the k8s resource": (f"nvidia.com/mig-{profile}",),
        "the k8s resource's name": (f"mig-{profile}",),
        "a product name's suffix": (f"MIG-{profile}",),
        "white space before": (f" {profile}",),
    }[transform]
    return next((spelled for spelled in candidates if spelled not in have), None)
