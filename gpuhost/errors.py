"""The error hierarchy every driver maps its native failures to.

Conformance tests assert on these types, so each encodes one semantic the suite checks:
a bad request (``InvalidGpuRequest``), a request the driver cannot serve at all
(``UnsupportedGpuRequest``), and a request the host cannot serve right now
(``GpusExhausted``, ``GpuBusy``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

SHOWN_LIMIT = 80
"""How much of a value a message shows: enough to recognise it, on one line."""
FIELD_LIMIT = 200
"""A field (a path of keys) is named whole up to this length; the request's own are shorter."""
PATH_LIMIT = 4096
"""A file's path is named whole up to PATH_MAX: whoever reads the message must find the file."""
_SHORT_INT_BITS = 256
"""Integers below 2**256 (up to 78 digits) are shown whole; larger ones by their length."""


def shown(value: object, limit: int = SHOWN_LIMIT) -> str:
    """``value`` for a message: as ``repr`` writes it, on one line, cut to ``limit`` characters.

    What is cut says how long it was; an integer too long to show (or to convert to text at
    all, past Python's 4,300 digits) is shown by its number of digits.
    """
    if isinstance(value, int) and not isinstance(value, bool) and _too_long(value):
        return _integer_of(value)
    text = ""
    for piece in _pieces(value, limit):
        text += piece
        if len(text) > limit:
            return f"{text[:limit]}… ({_size(value)})"
    return text


def named(text: str, limit: int = SHOWN_LIMIT) -> str:
    """A name, a path or a field for a message: itself when short and printable, else ``shown``."""
    return text if text.isprintable() and len(text) <= limit else shown(text, limit)


def _pieces(value: object, limit: int) -> Iterator[str]:
    """``repr(value)`` in pieces, so that only what is shown is ever written out."""
    if isinstance(value, str):
        yield repr(value[: limit + 1])
    elif isinstance(value, bool) or not isinstance(value, int | list | tuple | Mapping):
        yield repr(value)
    elif isinstance(value, int):
        yield _integer_of(value) if _too_long(value) else repr(value)
    elif isinstance(value, Mapping):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield from (", " if i else "", *_pieces(key, limit), ": ")
            yield from _pieces(item, limit)
        yield "}"
    else:
        yield "["
        for i, item in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(item, limit)
        yield "]"


def _size(value: object) -> str:
    if isinstance(value, str):
        return f"{len(value)} characters"
    if isinstance(value, Mapping):
        return f"{len(value)} key{'s' if len(value) != 1 else ''}"
    if isinstance(value, list | tuple):
        return f"{len(value)} item{'s' if len(value) != 1 else ''}"
    return f"{len(repr(value))} characters"


def _too_long(value: int) -> bool:
    return value.bit_length() > _SHORT_INT_BITS


def _integer_of(value: int) -> str:
    return f"{'a negative' if value < 0 else 'an'} integer of {digits(value)} digits"


def digits(value: int) -> int:
    """How many decimal digits ``value`` has, without writing it out (past 4,300, str refuses)."""
    size = abs(value)
    count = max(1, int(size.bit_length() * 0.30103))
    while 10**count <= size:
        count += 1
    while count > 1 and 10 ** (count - 1) > size:
        count -= 1
    return count


class DriverError(Exception):
    """Base of every error a driver raises on purpose."""


class RequestError(DriverError):
    """A refused request: ``field`` is where the problem is, ``value`` what was found there."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(problem)
        self.field = field
        self.value = value


class InvalidGpuRequest(RequestError, ValueError):
    """A GPU request that is malformed or inconsistent; raised before anything is allocated."""


class InvalidDriverConfig(InvalidGpuRequest):
    """The driver_config envelope or the active driver's block is malformed."""


class InvalidGpuCount(InvalidGpuRequest):
    """``resource_requirements.gpu.count`` is not a positive integer."""


class InvalidGpuSharing(InvalidGpuRequest):
    """``resource_requirements.gpu.sharing`` is neither ``exclusive`` nor ``shared``."""


class DuplicateGpuDevice(InvalidGpuRequest):
    """The same device is named twice in ``gpu_device_ids``."""


class GpuDevicesWithoutRequest(InvalidGpuRequest):
    """Exact device IDs were given without ``resource_requirements.gpu``."""


class GpuCountMismatch(InvalidGpuRequest):
    """``gpu.count`` differs from the number of exact device IDs."""


class UnknownGpuDevice(InvalidGpuRequest):
    """An exact device ID names no GPU on this host."""


class UnsupportedGpuRequest(RequestError):
    """A well-formed request that this driver can never serve (a capability it lacks)."""


class GpuAllocationError(DriverError):
    """A valid request that cannot be served now because of what other sandboxes hold."""


class GpusExhausted(GpuAllocationError):
    """Fewer GPUs are free than were requested."""

    def __init__(self, requested: int, available: int, total: int, why: str = "") -> None:
        super().__init__(
            f"GPU sandbox requested {requested} GPUs, but only {available} selectable "
            f"of {total} devices are available" + (f" ({why})" if why else "")
        )
        self.requested = requested
        self.available = available
        self.total = total


class GpuBusy(GpuAllocationError):
    """An exactly requested GPU is held by another sandbox."""

    def __init__(self, device: str, holder: str) -> None:
        super().__init__(f"GPU {device} is already assigned to another sandbox ({holder})")
        self.device = device
        self.holder = holder


class UnknownImage(RequestError, ValueError):
    """The spec's (or ``--image``'s) image is not in the engine; nothing was allocated."""


class SandboxStartError(DriverError):
    """The sandbox could not be started; everything it took has been released."""


class SandboxExecError(DriverError):
    """A command could not be run inside the sandbox (not a non-zero exit of the command)."""


class ExecTimeout(SandboxExecError):
    """A command inside the sandbox ran past its timeout and was killed."""

    def __init__(self, argv: Sequence[str], timeout_s: float) -> None:
        super().__init__(f"{list(argv)!r} ran past its timeout of {timeout_s:g} s and was killed")
        self.argv = tuple(argv)
        self.timeout_s = timeout_s
