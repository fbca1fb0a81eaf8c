"""Rendering a manifest's argv templates: variables, and fragments spliced in.

A variable is ``{name}`` inside an element; an element that is exactly ``{@name}`` is
replaced by the fragment ``name``'s arguments, once per item (each device, each env var),
or by nothing when the request does not set that field. Nothing goes through a shell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from drivers.external.manifest import SPLICE, VARIABLE, Manifest

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


def substitute(arg: str, values: Mapping[str, str]) -> str:
    """``arg`` with each ``{name}`` replaced (the manifest was checked: every name is known)."""
    return VARIABLE.sub(lambda m: values.get(m.group(1), m.group(0)), arg)


def render(
    argv: Sequence[str],
    values: Mapping[str, str],
    splices: Mapping[str, Items] | None = None,
    fragments: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """The argv of a template: variables from ``values``, ``{@name}`` from ``splices``."""
    out: list[str] = []
    for arg in argv:
        splice = SPLICE.fullmatch(arg)
        if splice is None:
            out.append(substitute(arg, values))
            continue
        name = splice.group(1)
        for item in (splices or {}).get(name, ()):
            for piece in (fragments or {}).get(name, ()):
                out.append(substitute(piece, {**values, **item}))
    return out


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


def config_args(manifest: Manifest, request: CreateRequest, values: Mapping[str, str]) -> list[str]:
    """Each declared driver_config key the request sets: its fragment, once per item."""
    out: list[str] = []
    for key, declared in manifest.driver_config.items():
        if key not in request.config:
            continue
        value = request.config[key]
        for item in value if isinstance(value, list) else [value]:
            text = str(item).lower() if isinstance(item, bool) else str(item)
            out.extend(substitute(piece, {**values, "value": text}) for piece in declared.fragment)
    return out


def render_create(
    manifest: Manifest, request: CreateRequest, values: Mapping[str, str]
) -> list[str]:
    """The create template's argv for ``request``."""
    values = {**values, "image": request.image}
    splices = create_splices(request)
    out: list[str] = []
    for arg in manifest.templates["create"]:
        if arg == "{@config}":
            out.extend(config_args(manifest, request, values))
        else:
            out.extend(render([arg], values, splices, manifest.fragments))
    return out
