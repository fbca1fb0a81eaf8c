"""Parsers of recorded command output the tests read: lspci and ``ls -l`` of /dev/dri.

The suite itself reads sysfs and /dev/dri directly; these turn the recorded captures of
real hosts (tests/data) into the same records, so that discovery is tested on them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath

from gpuhost.devices import normalize_pci_bus_id
from gpuhost.discovery import PciDevice

_NAME_AND_CODE = re.compile(r"^(?P<name>.*?)\s*\[(?P<code>[0-9a-fA-F]{4})\]$")


def _name_and_code(record: Mapping[str, str], key: str) -> tuple[str, str]:
    value = record.get(key)
    if value is None:
        raise ValueError(f"lspci record has no {key}: {dict(record)!r}")
    match = _NAME_AND_CODE.match(value)
    if not match:
        raise ValueError(f"lspci {key} {value!r} carries no [code]: run lspci with -nn")
    return match["name"], match["code"].lower()


def parse_lspci_vmm(text: str) -> list[PciDevice]:
    """Parse ``lspci -Dvmmnn`` (``-k`` adds the driver; without ``-D`` the domain is 0000)."""
    devices = []
    for block in re.split(r"\n[ \t]*\n", text.strip()):
        if not block.strip():
            continue
        record = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            record[key.strip()] = value.strip()
        if "Slot" not in record:
            raise ValueError(f"lspci record has no Slot (run lspci with -mm): {block!r}")
        class_name, class_code = _name_and_code(record, "Class")
        vendor_name, vendor_id = _name_and_code(record, "Vendor")
        device_name, device_id = _name_and_code(record, "Device")
        devices.append(
            PciDevice(
                slot=normalize_pci_bus_id(record["Slot"]),
                class_code=class_code,
                class_name=class_name,
                vendor_id=vendor_id,
                vendor_name=vendor_name,
                device_id=device_id,
                device_name=device_name,
                driver=record.get("Driver", ""),
            )
        )
    return devices


_LISTING_LINK = re.compile(
    r"\spci-(?P<bus>[0-9a-fA-F:.]+)-(?P<kind>card|render) -> (?P<target>\S+)$"
)


def parse_dri_by_path_listing(text: str) -> dict[str, dict[str, str]]:
    """Bus id to ``{"card": "card1", "render": "renderD129"}`` from ``ls -l /dev/dri/by-path``."""
    links: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if match := _LISTING_LINK.search(line.rstrip()):
            bus = normalize_pci_bus_id(match["bus"])
            links.setdefault(bus, {})[match["kind"]] = PurePosixPath(match["target"]).name
    return links
