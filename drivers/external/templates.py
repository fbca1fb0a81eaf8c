"""Rendering a manifest's argv templates: variables, and fragments spliced in.

A variable is ``{name}`` inside an element; an element that is exactly ``{@name}`` is
replaced by the fragment ``name``'s arguments, once per item (each device, each env var),
or by nothing when the request does not set that field. Nothing goes through a shell, and
no value may begin a word of the argv with ``-`` before a ``--`` of the template (``_Argv``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from drivers.external.manifest import SPLICE, VARIABLE, Manifest
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
    count: int | None = None
    gpu: int | None = None
    """A GPU request whose devices the driver chooses (``allocation: driver``, no IDs)."""
    devices: tuple[tuple[str, str], ...] = ()
    """(device ID, UUID or "") per device."""
    dri_nodes: tuple[tuple[str, str], ...] = ()
    """(path inside, source on the host) per node of the leased AMD and Intel GPUs."""
    tool_mounts: tuple[tuple[str, str], ...] = ()
    """(host path, sandbox path) of the GPU tools, when no CDI device brings them."""
    shared: bool = False
    image_set: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    mig_profile: str | None = None
    vendor: str | None = None
    config: Mapping[str, object] = field(default_factory=dict)


class OptionLike(ValueError):
    """A value that would begin a word of the argv with ``-``, where a CLI reads options.

    ``variable`` is the template's name for it, ``value`` the value, ``item`` the variables
    of the fragment item it was in (``env_key`` of an ``env_value``), ``key`` the
    ``driverConfig`` key of a ``{value}``, ``element`` the template's text.
    """

    def __init__(
        self, variable: str, value: str, element: str, item: Mapping[str, str], key: str = ""
    ) -> None:
        super().__init__(
            f"{{{variable}}} = {shown(value)} begins with '-' at the start of the argv word "
            f"{shown(element)}: a CLI would read it as an option"
        )
        self.variable = variable
        self.value = value
        self.element = element
        self.item = dict(item)
        self.key = key


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

    def __init__(self) -> None:
        self.words: list[str] = []
        self.operands = False

    def add(self, arg: str, values: Mapping[str, str], key: str = "") -> None:
        word = substitute(arg, values)
        if not self.operands and word.startswith("-") and not arg.startswith("-"):
            names = [m.group(1) for m in VARIABLE.finditer(arg)]
            name = next((n for n in names if values.get(n)), names[0])
            raise OptionLike(name, values.get(name, ""), arg, values, key)
        self.words.append(word)
        self.operands = self.operands or arg == "--"


def render(
    argv: Sequence[str],
    values: Mapping[str, str],
    splices: Mapping[str, Items] | None = None,
    fragments: Mapping[str, Sequence[str]] | None = None,
    config: Sequence[tuple[str, Sequence[str], Mapping[str, str]]] = (),
) -> list[str]:
    """The argv of a template: variables from ``values``, ``{@name}`` from ``splices``.

    ``config``: what ``{@config}`` becomes, (key, fragment, its variables) per item.
    ``OptionLike`` when a value would begin a word with ``-`` (``_Argv``).
    """
    out = _Argv()
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
                for piece in (fragments or {}).get(name, ()):
                    out.add(piece, {**values, **item})
    return out.words


def create_splices(request: CreateRequest) -> dict[str, Items]:
    """The fragments a create emits for ``request`` (driver_config keys aside)."""
    splices: dict[str, Items] = {}
    if request.count is not None:
        splices["count"] = ({"count": str(request.count)},)
    if request.gpu is not None:
        splices["gpu"] = ({"count": str(request.gpu)},)
    splices["device"] = tuple({"device_id": d, "uuid": u} for d, u in request.devices)
    splices["dri_node"] = tuple({"node_path": p, "node_source": s} for p, s in request.dri_nodes)
    splices["tool_mount"] = tuple(
        {"mount_source": s, "mount_target": t} for s, t in request.tool_mounts
    )
    if request.shared:
        splices["shared"] = ({},)
    if request.image_set:
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
    """The create template's argv for ``request``; ``OptionLike`` as ``render`` says."""
    values = {**values, "image": request.image}
    return render(
        manifest.templates["create"],
        values,
        create_splices(request),
        manifest.fragments,
        config_items(manifest, request),
    )
