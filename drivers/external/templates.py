"""Rendering a manifest's argv templates: variables, and fragments spliced in.

A variable is ``{name}`` inside an element; an element that is exactly ``{@name}`` is
replaced by the fragment ``name``'s arguments, once per item (each device, each env var),
or by nothing when the request does not set that field. A fragment's argument may be a
JSON element (``{json: VALUE}``): one word, VALUE's JSON text, each string in it rendered,
``{@device_ids}`` the list of devices. Nothing goes through a shell, no value may begin a
word of the argv with ``-`` before a ``--`` of the template (``_Argv``), and the rendered
argv is held to the manifest's ``limits`` (``drivers.external.limits``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drivers.external import limits as flag_limits
from drivers.external.manifest import COMMON, SPLICE, VARIABLE, Arg, FlagRule, JsonArg, Manifest
from gpuhost.errors import shown

Items = tuple[Mapping[str, str], ...]
"""One fragment's renderings: the variables of each time it is emitted."""


@dataclass(frozen=True)
class CreateRequest:
    """What a create hands the driver's CLI, in the template's terms.

    Each fragment's items: ``devices`` one per GPU (the leased GPUs' IDs, or the user's own
    IDs under ``allocation: driver``), ``env`` one per variable; the others once or never.
    """

    image: str
    """The image: the request's, ``--image``'s or the manifest's ``defaultImage``; "" none."""
    count: int | None = None
    """The number of GPUs asked, where it is known: the count given, or the number of
    ``devices``. None for the driver's default request (``allocation: driver``)."""
    gpu: int | None = None
    """A GPU request whose devices the driver chooses (``allocation: driver``, no IDs)."""
    default_gpu: bool = False
    """The default request: a GPU request naming no count and no device."""
    devices: tuple[tuple[str, str], ...] = ()
    """(device ID, UUID or "") per device."""
    dri_nodes: tuple[tuple[str, str], ...] = ()
    """(path inside, source on the host) per node of the leased AMD and Intel GPUs."""
    tool_mounts: tuple[tuple[str, str], ...] = ()
    """(host path, sandbox path) of the GPU tools, when no CDI device brings them."""
    shared: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    mig_profile: str | None = None
    vendor: str | None = None
    config: Mapping[str, object] = field(default_factory=dict)


class RefusedValue(ValueError):
    """A rendered word the CLI must not be given; what of the request or driver it came from.

    ``variable`` is the template's name for the value responsible ("" when the word is the
    manifest's own text, or made of the driver's own variables), ``value`` that value,
    ``item`` the variables of the fragment item it was in (``env_key`` of an ``env_value``),
    ``key`` the ``driverConfig`` key of a ``{value}``, ``element`` the template's text.
    """

    def __init__(
        self, message: str, variable: str, value: str, element: str, item: Mapping[str, str],
        key: str = "",
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.variable = variable
        self.value = value
        self.element = element
        self.item = dict(item)
        self.key = key


class OptionLike(RefusedValue):
    """A value that would begin a word of the argv with ``-``, where a CLI reads options."""

    def __init__(
        self, variable: str, value: str, element: str, item: Mapping[str, str], key: str = ""
    ) -> None:
        super().__init__(
            f"{{{variable}}} = {shown(value)} begins with '-' at the start of the argv word "
            f"{shown(element)}: a CLI would read it as an option",
            variable, value, element, item, key,
        )  # fmt: skip


class LimitBroken(RefusedValue):
    """The rendered argv breaks a rule of the manifest's ``limits``: the CLI would refuse it."""

    def __init__(
        self, broken: flag_limits.Broken, argv: Sequence[str], variable: str, value: str,
        element: str, item: Mapping[str, str], key: str = "",
    ) -> None:  # fmt: skip
        super().__init__(broken.message(argv), variable, value, element, item, key)
        self.broken = broken
        self.argv = list(argv)


def substitute(arg: str, values: Mapping[str, str]) -> str:
    """``arg`` with each ``{name}`` replaced (the manifest was checked: every name is known)."""
    return VARIABLE.sub(lambda m: values.get(m.group(1), m.group(0)), arg)


class _Argv:
    """An argv rendered word by word, refusing a value that would make a word an option.

    A word whose template does not begin with ``-`` must not begin with it once rendered: a
    value there (``{image}``, ``{device_id}``, ``{env_key}={env_value}``) is refused when it
    begins with ``-``, unless an earlier word of the template is ``--`` (past it, a CLI
    reads words as operands). Nothing goes through a shell, so ``;``, ``$(…)`` and newlines
    are only characters of one word.
    """

    def __init__(self, lists: Mapping[str, Sequence[str]]) -> None:
        self.words: list[str] = []
        self.sources: list[tuple[str, Mapping[str, str], str]] = []
        self.operands = False
        self.lists = lists

    def add(self, arg: Arg, values: Mapping[str, str], key: str = "") -> None:
        if isinstance(arg, JsonArg):
            value = _json(arg.value, values, self.lists)
            self.words.append(json.dumps(value, separators=(",", ":")))
            self.sources.append((json.dumps(arg.value), values, key))
            return
        word = substitute(arg, values)
        if not self.operands and word.startswith("-") and not arg.startswith("-"):
            names = [m.group(1) for m in VARIABLE.finditer(arg)]
            name = next((n for n in names if values.get(n)), names[0])
            raise OptionLike(name, values.get(name, ""), arg, values, key)
        self.words.append(word)
        self.sources.append((arg, values, key))
        self.operands = self.operands or arg == "--"

    def checked(self, limits: Mapping[str, FlagRule]) -> list[str]:
        """The words, once they break none of ``limits``; ``LimitBroken`` naming its source."""
        broken = flag_limits.check(self.words, limits)
        if broken is None:
            return self.words
        element, values, key = self.sources[broken.index]
        names = [m.group(1) for m in VARIABLE.finditer(element)]
        # The request's value in the word, if any: the driver's own are not the request's.
        theirs = [n for n in names if n not in (*COMMON, "id") and values.get(n)]
        name = theirs[0] if theirs else ""
        raise LimitBroken(broken, self.words, name, values.get(name, ""), element, values, key)


def _json(value: Any, values: Mapping[str, str], lists: Mapping[str, Sequence[str]]) -> Any:
    """A JSON element's value rendered: each string a template, ``{@list}`` a list."""
    if isinstance(value, str):
        splice = SPLICE.fullmatch(value)
        return list(lists.get(splice.group(1), ())) if splice else substitute(value, values)
    if isinstance(value, Mapping):
        return {key: _json(item, values, lists) for key, item in value.items()}
    if isinstance(value, list):
        return [_json(item, values, lists) for item in value]
    return value


def render(
    argv: Sequence[str],
    values: Mapping[str, str],
    splices: Mapping[str, Items] | None = None,
    fragments: Mapping[str, Sequence[Arg]] | None = None,
    config: Sequence[tuple[str, Sequence[str], Mapping[str, str]]] = (),
    limits: Mapping[str, FlagRule] | None = None,
    lists: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """The argv of a template: variables from ``values``, ``{@name}`` from ``splices``.

    ``config``: what ``{@config}`` becomes, (key, fragment, its variables) per item;
    ``lists``: what a JSON element's ``{@name}`` becomes.
    ``OptionLike`` when a value would begin a word with ``-`` (``_Argv``); ``LimitBroken``
    when the argv breaks a rule of ``limits``.
    """
    out = _Argv(lists or {})
    for arg in argv:
        splice = SPLICE.fullmatch(arg)
        if splice is None:
            out.add(arg, values)
        elif splice.group(1) == "config":
            for key, pieces, item in config:
                for piece in pieces:
                    out.add(piece, {**values, **item}, key)
        else:
            name = splice.group(1)
            for item in (splices or {}).get(name, ()):
                for each in (fragments or {}).get(name, ()):
                    out.add(each, {**values, **item})
    return out.checked(limits or {})


def create_splices(request: CreateRequest) -> dict[str, Items]:
    """The fragments a create emits for ``request`` (driver_config keys aside)."""
    splices: dict[str, Items] = {}
    if request.count is not None:
        splices["count"] = ({"count": str(request.count)},)
    if request.gpu is not None:
        splices["gpu"] = ({"count": str(request.gpu)},)
    if request.default_gpu:
        splices["gpu_default"] = ({},)
    splices["device"] = tuple({"device_id": d, "uuid": u} for d, u in request.devices)
    if request.devices:
        splices["device_list"] = ({"count": str(len(request.devices))},)
    splices["dri_node"] = tuple({"node_path": p, "node_source": s} for p, s in request.dri_nodes)
    splices["tool_mount"] = tuple(
        {"mount_source": s, "mount_target": t} for s, t in request.tool_mounts
    )
    if request.shared:
        splices["shared"] = ({},)
    if request.image:
        splices["image"] = ({"image": request.image},)
    splices["env"] = tuple({"env_key": k, "env_value": v} for k, v in request.env.items())
    if request.mig_profile is not None:
        splices["mig_profile"] = ({"mig_profile": request.mig_profile},)
    if request.vendor is not None:
        splices["vendor"] = ({"vendor": request.vendor},)
    return splices


def config_items(
    manifest: Manifest, request: CreateRequest
) -> list[tuple[str, Sequence[str], Mapping[str, str]]]:
    """Each declared driver_config key the request sets: its fragment, once per item."""
    out: list[tuple[str, Sequence[str], Mapping[str, str]]] = []
    for key, declared in manifest.driver_config.items():
        if key not in request.config:
            continue
        value = request.config[key]
        for item in value if isinstance(value, list) else [value]:
            text = str(item).lower() if isinstance(item, bool) else str(item)
            out.append((key, declared.fragment, {"value": text}))
    return out


def render_create(
    manifest: Manifest, request: CreateRequest, values: Mapping[str, str]
) -> list[str]:
    """The create template's argv for ``request``; ``RefusedValue`` as ``render`` says."""
    values = {**values, "image": request.image}
    return render(
        manifest.templates["create"],
        values,
        create_splices(request),
        manifest.fragments,
        config_items(manifest, request),
        manifest.limits,
        {"device_ids": [device for device, _ in request.devices]},
    )
