"""A sandbox's own pod options, checked by the API's rules before any pod is made.

Per sandbox, ``template.driver_config.kubernetes`` takes ``runtime_class_name`` (a
RuntimeClass's name), ``node_selector`` (label names to label values) and ``image``, beside
the keys every driver's block takes. A value the API would refuse is refused here, as
``InvalidDriverConfig`` naming its field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpuhost.errors import InvalidDriverConfig, named, shown
from gpuhost.requestjson import thawed
from gpuhost.spec import check_image

OPTION_KEYS = ("runtime_class_name", "node_selector", "image")
"""The keys of its own block it reads, beside the common ones: a pod's runtime class, the
nodes it may go to, the image its container runs."""
_DNS_SUBDOMAIN = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
_LABEL_VALUE = re.compile(r"(?=.{1,63}\Z)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
"""Kubernetes' syntax of names (RFC 1123 subdomains) and label values (and label names
after their prefix)."""


def _label_name(name: str) -> bool:
    prefix, slash, rest = name.rpartition("/")
    if slash and not _DNS_SUBDOMAIN.fullmatch(prefix):
        return False
    return bool(_LABEL_VALUE.fullmatch(rest))


def check_options(block: Mapping[str, Any], prefix: str) -> None:
    """The pod's options, by the API's own rules: one it would refuse is refused here.

    ``prefix`` is where the block stands in a request (``block_field``), for the errors' fields.
    """
    if block.get("image") is not None:
        check_image(block["image"], f"{prefix}.image", InvalidDriverConfig)
    runtime_class = block.get("runtime_class_name")
    if runtime_class is not None and not (
        isinstance(runtime_class, str) and _DNS_SUBDOMAIN.fullmatch(runtime_class)
    ):
        raise InvalidDriverConfig(
            f"{prefix}.runtime_class_name",
            runtime_class,
            f"{prefix}.runtime_class_name must be a RuntimeClass's name (lower-case "
            f"letters, digits, '-' and '.', at most 253), got {shown(runtime_class)}",
        )
    selector = thawed(block.get("node_selector"))
    if selector is None:
        return
    if not isinstance(selector, dict):
        raise InvalidDriverConfig(
            f"{prefix}.node_selector",
            selector,
            f"{prefix}.node_selector must map label names to strings, got {shown(selector)}",
        )
    for name, value in selector.items():
        if not _label_name(name):
            raise InvalidDriverConfig(
                f"{prefix}.node_selector",
                name,
                f"{prefix}.node_selector has a key {shown(name)} that is no label name "
                "([prefix/]name: letters, digits, '-', '_' and '.', at most 63)",
            )
        if not (isinstance(value, str) and (not value or _LABEL_VALUE.fullmatch(value))):
            raise InvalidDriverConfig(
                f"{prefix}.node_selector.{name}",
                value,
                f"{prefix}.node_selector.{named(name)} must be a label value (letters, digits, "
                f"'-', '_' and '.', at most 63), got {shown(value)}",
            )
