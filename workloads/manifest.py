"""The workload manifest: what runs inside the sandboxes, as data, checked strictly on load.

```yaml
workloads:
  - name: torch-matmul              # the test id: lower case, digits and dashes; unique
    requirement: WORKLOAD-TORCH-01  # an id of conformance/REQUIREMENTS.yaml
    payload: torch_checks.py        # a script under workloads/payloads/ ...
    args: [matmul]                  # ... and its arguments
    # command: [nvidia-smi, -L]     # ... or a command run as it is, instead of a payload
    gpus: 1                         # GPUs to request, 0 to 1024; 0 requests none
    expect: pass                    # pass or fail
    image: my/cuda-image:tag        # optional; else --image
    timeout_s: 300                  # optional (default 300), over 0 and at most 86400
    runs: 2                         # optional (default 1, at most 100): runs in one
                                    # sandbox, one after the other; each must end as expected
```

A name is at most 255 characters; a payload is a file name (letters, digits, ``_``, ``.``
and ``-``, at most 255); an image is printable ASCII without spaces, at most 512
characters; no string of ``args`` or ``command`` holds a NUL byte. The file is read by
``gpuhost.strict.read_yaml``: UTF-8, at most 64 KiB, no anchors, aliases or tags,
no key twice.

In ``args`` and ``command``, ``{gpu_uuids}`` becomes the sandbox's GPUs' UUIDs, comma
separated, and ``{gpu_count}`` their number. A payload passes when it prints a JSON line
with ``"ok": true`` and exits 0, and fails when it prints ``"ok": false``; anything else
(no JSON line, a crash) is an error, which no ``expect`` accepts. A command passes when it
exits 0 and fails otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.requirements import ID, listed
from gpuhost.errors import shown
from gpuhost.spec import NOT_TEXT
from gpuhost.strict import InvalidFile, member, read_yaml

MANIFEST = Path(__file__).parent / "manifest.yaml"
PAYLOADS = Path(__file__).parent / "payloads"
REQUIREMENT_PREFIX = "WORKLOAD-"
"""Requirements of the workload lane start with it; the conformance catalogue's do not."""
DEFAULT_TIMEOUT_S = 300.0
"""A cold host takes tens of seconds to import CUDA libraries and compile kernels."""
MAX_TIMEOUT_S = 86_400.0
"""A day: no workload of ours runs for hours, and a bound keeps a typo from meaning never."""
MAX_GPUS = 1024
"""More than any host has: a count above it is a typo, refused before a sandbox is asked for."""
MAX_RUNS = 100
OUTCOMES = ("pass", "fail")
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,254}")
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_IMAGE = re.compile(r"[!-~]{1,512}")
_KEYS = frozenset(
    {
        "name",
        "requirement",
        "payload",
        "command",
        "args",
        "gpus",
        "expect",
        "image",
        "timeout_s",
        "runs",
    }
)


class ManifestError(InvalidFile):
    """A manifest that cannot be used: ``field`` is where, ``value`` what was found there."""


class MissingField(ManifestError):
    """A required field is absent."""


class UnknownField(ManifestError):
    """A field the manifest format does not have (a typo, most likely)."""


class InvalidValue(ManifestError):
    """A field holds a value of the wrong type or out of range."""


class DuplicateName(ManifestError):
    """Two workloads have the same name, and so the same test id."""


@dataclass(frozen=True)
class Workload:
    name: str
    requirement: str
    expect: str
    gpus: int
    payload: Path | None = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    image: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    runs: int = 1
    """Runs in one sandbox: CUDA must work in every command, not only the first (a nested
    pid namespace per command broke every CUDA process after the first on an H100)."""

    def argv(self, python: str, gpu_uuids: Sequence[str], cpu: bool = False) -> list[str]:
        """The command line that runs this workload, payloads as ``python -c <source>``."""
        values = {"{gpu_uuids}": ",".join(gpu_uuids), "{gpu_count}": str(len(gpu_uuids))}

        def fill(arg: str) -> str:
            for placeholder, value in values.items():
                arg = arg.replace(placeholder, value)
            return arg

        if self.payload is None:
            return [fill(arg) for arg in self.command]
        source = self.payload.read_text()
        return [python, "-c", source, *(fill(arg) for arg in self.args), *(["--cpu"] * cpu)]

    def describe(self) -> str:
        """What runs, short enough for a message (a payload's source is not repeated)."""
        what = [self.payload.name, *self.args] if self.payload else list(self.command)
        return f"{self.name} ({' '.join(what)})"


def load_manifest(
    path: Path = MANIFEST, requirements: Collection[str] | None = None
) -> tuple[Workload, ...]:
    """Read and check a manifest; ``requirements``, when given, are the ids it may name."""
    document = read_yaml(path, InvalidValue)
    if not isinstance(document, dict) or set(document) != {"workloads"}:
        raise InvalidValue(
            path,
            "(document)",
            document,
            f"must be a mapping with one key, 'workloads', got {shown(document)}",
        )
    workloads: dict[str, Workload] = {}
    for index, entry in enumerate(listed(path, "workloads", document["workloads"], InvalidValue)):
        workload = _parse(_Entry(path, f"workloads[{index}]", entry), requirements)
        if workload.name in workloads:
            raise DuplicateName(
                path, f"workloads[{index}].name", workload.name, f"'{workload.name}' is used twice"
            )
        workloads[workload.name] = workload
    return tuple(workloads.values())


@dataclass(frozen=True)
class _Entry:
    source: Path
    where: str
    raw: Any

    def get(self, key: str, required: bool = True) -> Any:
        if key not in self.raw and required:
            raise MissingField(self.source, f"{self.where}.{key}", None, "is required")
        return self.raw.get(key)

    def invalid(self, key: str, problem: str) -> InvalidValue:
        value = self.raw.get(key)
        return InvalidValue(
            self.source, f"{self.where}.{key}", value, f"{problem}, got {shown(value)}"
        )


def _parse(entry: _Entry, requirements: Collection[str] | None) -> Workload:
    if not isinstance(entry.raw, dict):
        raise InvalidValue(
            entry.source, entry.where, entry.raw, f"must be a mapping, got {shown(entry.raw)}"
        )
    for key in entry.raw:
        if key not in _KEYS:
            raise UnknownField(
                entry.source,
                member(entry.where, key),
                entry.raw[key],
                f"unknown field {shown(key)}, set to {shown(entry.raw[key])} "
                f"(known: {', '.join(sorted(_KEYS))})",
            )
    name = entry.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise entry.invalid("name", "must be lower case letters, digits and dashes, 255 at most")
    requirement = entry.get("requirement")
    if not (isinstance(requirement, str) and ID.fullmatch(requirement)) or (
        requirements is not None and requirement not in requirements
    ):
        raise entry.invalid("requirement", "must be an id of conformance/REQUIREMENTS.yaml")
    gpus = _whole(entry, "gpus", 0, MAX_GPUS)
    expect = entry.get("expect")
    if not (isinstance(expect, str) and expect in OUTCOMES):
        raise entry.invalid("expect", "must be 'pass' or 'fail'")
    return Workload(
        name=name,
        requirement=requirement,
        expect=expect,
        gpus=gpus,
        payload=_payload(entry),
        command=_strings(entry, "command"),
        args=_strings(entry, "args"),
        image=_image(entry),
        timeout_s=_timeout(entry),
        runs=_whole(entry, "runs", 1, MAX_RUNS, default=1),
    )


def _whole(entry: _Entry, key: str, low: int, high: int, default: int | None = None) -> int:
    value = entry.get(key, required=default is None)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise entry.invalid(key, f"must be a whole number from {low} to {high}")
    return value


def _payload(entry: _Entry) -> Path | None:
    payload, command = entry.raw.get("payload"), entry.raw.get("command")
    if (payload is None) == (command is None):
        raise entry.invalid("payload", "give either a payload or a command, not both or neither")
    if payload is None:
        if "args" in entry.raw:
            raise entry.invalid("args", "args go with a payload; a command carries its own")
        return None
    if not (isinstance(payload, str) and _FILE.fullmatch(payload)):
        raise entry.invalid("payload", f"must name a file in {PAYLOADS}")
    path = PAYLOADS / payload
    if not path.is_file():
        raise entry.invalid("payload", f"must name a file in {PAYLOADS}")
    return path


def _strings(entry: _Entry, key: str) -> tuple[str, ...]:
    value = entry.raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise entry.invalid(key, "must be a list of strings")
    if key == "command" and key in entry.raw and not value:
        raise entry.invalid(key, "must not be empty")
    for index, item in enumerate(value):
        if NOT_TEXT.search(item):
            raise InvalidValue(
                entry.source,
                f"{entry.where}.{key}[{index}]",
                item,
                f"must be text without a NUL byte or a lone surrogate, got {shown(item)}",
            )
    return tuple(value)


def _image(entry: _Entry) -> str | None:
    image = entry.get("image", required=False)
    if image is not None and not (isinstance(image, str) and _IMAGE.fullmatch(image)):
        raise entry.invalid("image", "must be an image reference (printable ASCII, no spaces)")
    return image


def _timeout(entry: _Entry) -> float:
    timeout = entry.get("timeout_s", required=False)
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_TIMEOUT_S
    ):
        raise entry.invalid("timeout_s", f"must be seconds, over 0 and at most {MAX_TIMEOUT_S:g}")
    return float(timeout)
