"""Planted breakers of a command's environment: SANDBOX-ENV-01.

The spec's env, exactly, through ``exec`` and ``exec_stream``, and nothing of the creating
process's. Their tests: the env test of conformance/test_exec.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from conformance.observe import COMMAND_PATHS
from conformance.test_exec import CREATOR_KINDS, SPEC_VALUE_CLASSES
from drivers.base import Command, Launch
from drivers.reference import ReferenceSandbox
from tests.breakers.base import BrokenDriver, family
from tests.breakers.execution import OnePath, way_name


class SpecEnvCannotOverrideDefaults(BrokenDriver):
    """SANDBOX-ENV-01: the driver's PATH, HOME and LANG go over the spec's env."""

    BREAKS = "SANDBOX-ENV-01"

    def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        return {**extra, **super().sandbox_env({})}


class DropsLoaderVariables(BrokenDriver):
    """SANDBOX-ENV-01: drops the loader's variables (LD_*) from the spec's env, "for safety"."""

    BREAKS = "SANDBOX-ENV-01"

    def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        return super().sandbox_env({k: v for k, v in extra.items() if not k.startswith("LD_")})


class ForcesCudaVisibleDevices(BrokenDriver):
    """SANDBOX-ENV-01: sets CUDA_VISIBLE_DEVICES to its NVIDIA GPUs' UUIDs, over the spec's own."""

    BREAKS = "SANDBOX-ENV-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        nvidia = [gpu.uuid for gpu in launch.gpus if gpu.vendor == "nvidia"]
        if nvidia:
            sandbox._env = {**sandbox._env, "CUDA_VISIBLE_DEVICES": ",".join(nvidia)}
        return sandbox


def _config_proxies() -> dict[str, str]:
    """The proxies of the creator's docker client configuration, as docker-py adds them."""
    directory = os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker")
    try:
        config = json.loads(Path(directory, "config.json").read_text())
    except (OSError, ValueError):
        return {}
    proxies = config.get("proxies", {}).get("default", {})
    names = {"httpProxy": "http_proxy", "httpsProxy": "https_proxy", "ftpProxy": "ftp_proxy",
             "noProxy": "no_proxy"}  # fmt: skip
    return {
        spelt: str(proxies[key])
        for key, name in names.items()
        if key in proxies
        for spelt in (name, name.upper())
    }


def _named(predicate: Callable[[str], bool]) -> Callable[[], dict[str, str]]:
    return lambda: {name: value for name, value in os.environ.items() if predicate(name)}


_PROXIES = frozenset(f"{name}_proxy" for name in ("http", "https", "ftp", "no"))
_DEEMED_THE_HOSTS = (
    "GPU_SANDBOX_", "CUDA_", "NVIDIA_", "NCCL_", "TORCH_", "CUPY_", "HF_", "OMP_", "LD_", "PYTHON",
    "TZ", "LC_", "TERM", "DOCKER_",
)  # fmt: skip
_FORWARDS: dict[str, tuple[str, Callable[[], dict[str, str]], str]] = {
    "a name of its own": (
        "HostEnvironmentLeaks",
        lambda: dict(os.environ),
        "the creating process's whole environment",
    ),
    "CUDA's, NVIDIA's, NCCL's and the frameworks' knobs": (
        "ForwardsGpuKnobs",
        _named(lambda name: name.startswith(("CUDA_", "NVIDIA_", "NCCL_", "TORCH_"))),
        "the creator's CUDA_, NVIDIA_, NCCL_ and TORCH_ variables, the host's GPU tuning",
    ),
    "the loader's (LD_)": (
        "ForwardsLoaderVariables",
        _named(lambda name: name.startswith("LD_")),
        "the creator's LD_ variables, for a GPU library's shim",
    ),
    "Python's (PYTHON)": (
        "ForwardsPythonVariables",
        _named(lambda name: name.startswith("PYTHON")),
        "the creator's PYTHON variables, for the user's code",
    ),
    "the time zone, locale and terminal": (
        "ForwardsLocale",
        _named(lambda name: name in ("TZ", "LANG", "TERM") or name.startswith("LC_")),
        "the creator's TZ, LANG, LC_ and TERM, so that logs and output agree",
    ),
    "proxies, in lower case": (
        "ForwardsLowerCaseProxies",
        _named(lambda name: name in _PROXIES),
        "the creator's http_proxy, https_proxy, ftp_proxy and no_proxy, credentials and all, "
        "as podman forwards its own",
    ),
    "proxies, in upper case": (
        "ForwardsUpperCaseProxies",
        _named(lambda name: name.lower() in _PROXIES and name.isupper()),
        "the creator's HTTP_PROXY, HTTPS_PROXY, FTP_PROXY and NO_PROXY, credentials and all, "
        "as podman forwards its own",
    ),
    "a client configuration it names, with proxies (DOCKER_CONFIG)": (
        "ForwardsClientConfigProxies",
        _config_proxies,
        "the proxies of the creator's docker client configuration, as docker-py adds them",
    ),
    "every other variable it has": (
        "ForwardsAllButTheHosts",
        _named(
            lambda name: name.lower() not in _PROXIES and not name.startswith(_DEEMED_THE_HOSTS)
        ),
        "the creator's environment but what it deems the host's own (GPU, loader, Python, "
        "locale, proxies, its own)",
    ),
}
"""For each kind of the creator's variables SANDBOX-ENV-01 sets, a driver forwarding them."""


def _forwarding(kind: str) -> type[BrokenDriver]:
    name, forwarded, story = _FORWARDS[kind]

    class Forwards(BrokenDriver):
        __doc__ = f"SANDBOX-ENV-01: commands get {story}, the spec's env over it."
        BREAKS = "SANDBOX-ENV-01"

        def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
            return {**forwarded(), **super().sandbox_env(extra)}

    Forwards.__name__ = Forwards.__qualname__ = name
    return Forwards


FORWARDING = family(globals(), CREATOR_KINDS, _forwarding)


def _loses_spec_env(way: str) -> type[BrokenDriver]:
    class _Sandbox(OnePath):
        BROKEN_ON = way

        def command_env(self, command: Command) -> dict[str, str]:
            env = super().command_env(command)
            if not self.broken():
                return env
            own = {"PATH": env.get("PATH", ""), "HOME": "/tmp", "LANG": "C.UTF-8"}
            return {**own, **command.env}  # the driver's own, the spec's lost on the way

    class SpecEnvLost(BrokenDriver):
        __doc__ = (
            f"SANDBOX-ENV-01: a command run through {way} gets the driver's env, not the spec's."
        )
        BREAKS = "SANDBOX-ENV-01"
        SANDBOX = _Sandbox

    SpecEnvLost.__name__ = SpecEnvLost.__qualname__ = f"SpecEnvLostOn{way_name(way)}"
    return SpecEnvLost


SPEC_ENV_LOST = family(globals(), COMMAND_PATHS, _loses_spec_env)


_MANGLED: dict[str, tuple[str, Callable[[str], str | None], str]] = {
    "a newline": (
        "EnvFileLines",
        lambda value: value.split("\n", 1)[0],
        "through an env file of KEY=VALUE lines (as docker --env-file reads one): a value is "
        "cut at its first newline",
    ),
    "a tab": (
        "EnvTabsAsSpaces",
        lambda value: value.replace("\t", " "),
        "through a config format that folds whitespace: a value's tabs become spaces",
    ),
    "non-ASCII UTF-8": (
        "EnvAsciiOnly",
        lambda value: value.encode("ascii", "replace").decode(),
        "encoded as ASCII on its way: each non-ASCII character of a value becomes '?'",
    ),
    "a backslash": (
        "EnvBackslashEscapes",
        lambda value: value.replace("\\\\", "\0").replace("\\n", "\n").replace("\\t", "\t")
        .replace("\\", "").replace("\0", "\\"),
        "through a quoted env file whose reader takes backslashes for escapes",
    ),
    "a value starting with -": (
        "EnvDashIsAnOption",
        lambda value: None if value.startswith("-") else value,
        "as a command line's arguments: a value starting with '-' is taken for an option, "
        "and the variable dropped",
    ),
    "very long (64 KiB)": (
        "EnvFixedBuffer",
        lambda value: value[:4096],
        "through a fixed buffer of 4 KiB per value: a longer value is cut there",
    ),
}  # fmt: skip
"""For each class of byte a spec's value holds (SANDBOX-ENV-01), a driver that changes it."""


def _mangling(value_class: str) -> type[BrokenDriver]:
    name, mangle, story = _MANGLED[value_class]

    class Mangles(BrokenDriver):
        __doc__ = f"SANDBOX-ENV-01: the spec's env goes {story} ({value_class})."
        BREAKS = "SANDBOX-ENV-01"

        def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
            kept = {key: mangle(value) for key, value in extra.items()}
            return super().sandbox_env({k: v for k, v in kept.items() if v is not None})

    Mangles.__name__ = Mangles.__qualname__ = name
    return Mangles


SPEC_VALUE_MANGLED = family(globals(), SPEC_VALUE_CLASSES, _mangling)
