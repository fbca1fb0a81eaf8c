"""What reaches an external driver's commands: its manifest, request values, the environment.

The podman CLI manifests are run with ``podman`` replaced by a recorder (a script that
writes its argv and answers as podman would), so that what the adapter would have run is
seen without an engine; OpenShell's is rendered and refused before its program is looked for.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from drivers.base import Command
from drivers.external import driver_class
from drivers.external.adapter import ExternalDriver
from drivers.external.jsonl_process import DRIVER_MARKER_ENV
from drivers.external.manifest import ManifestError, parse
from drivers.external.templates import CreateRequest, render_create
from drivers.host_process import HOST_PATH
from gpuhost import simulated
from gpuhost.errors import InvalidGpuRequest, SandboxExecError, SandboxStartError
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import parse_spec
from tests.catalogue import ROOT
from tests.drivers.test_external_driver import sh_manifest, write

EXAMPLES = ROOT / "examples" / "drivers"
HOSTILE = ["--privileged", "-v/:/host", ";", "$(id>/tmp/pwned)", "a\nb"]
"""Values a request may carry: options of the CLI, shell syntax, a newline."""
OPTION_LIKE = [value for value in HOSTILE if value.startswith("-")]

RECORDER = """\
#!{python}
import json, os, sys
with open({log!r}, "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
words = sys.argv[1:]
if "run" in words:
    print("c0ffee00")
elif "inspect" in words:
    print(os.getppid())  # the adapter's process: alive while it holds the sandbox
"""


@pytest.fixture
def host(tmp_path: Path) -> Iterator[GpuHost]:
    sim = simulated.setup(tmp_path / "sim", 4)
    yield GpuHost.open(HostConfig(sim.root))
    simulated.teardown(sim.root)


def recorded(tmp_path: Path, example: str) -> tuple[type[ExternalDriver], Path]:
    """The example manifest with its program replaced by the recorder, and the recorder's log."""
    log = tmp_path / "argv.jsonl"
    recorder = tmp_path / "podman"
    recorder.write_text(RECORDER.format(python=sys.executable, log=str(log)))
    recorder.chmod(0o755)
    text = (EXAMPLES / example).read_text()
    text = text.replace("- podman\n", f"- {recorder}\n").replace("[podman,", f"[{recorder},")
    return driver_class(write_text(tmp_path / example, text)), log


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def runs(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def request(image: str | None = None, env: dict[str, str] | None = None, **gpu: Any) -> Any:
    template: dict[str, Any] = {}
    if image is not None:
        template["image"] = image
    if env is not None:
        template["env"] = env
    return parse_spec({"resource_requirements": {"gpu": gpu}, "template": template})


# -- request values as options -------------------------------------------------------------


@pytest.mark.parametrize("value", OPTION_LIKE)
@pytest.mark.parametrize("example", ["podman-cli.yaml", "podman-cli-choosing.yaml"])
def test_an_image_that_is_an_option_is_refused_by_name_before_anything_runs(
    tmp_path: Path, host: GpuHost, example: str, value: str
) -> None:
    """`podman run ... {image}`: an image `--privileged` was podman's flag, not an image."""
    cls, log = recorded(tmp_path, example)
    driver = cls(host, "opt-image")
    with pytest.raises(InvalidGpuRequest) as refused:
        driver.create(request(image=value))
    assert (refused.value.field, refused.value.value) == ("template.image", value)
    assert "must not begin with '-'" in str(refused.value)
    assert runs(log) == [], "the CLI ran"
    assert host.leases.leases() == [], "a GPU was leased"


@pytest.mark.parametrize("value", OPTION_LIKE)
def test_the_run_option_image_that_is_an_option_is_refused_by_name(
    tmp_path: Path, host: GpuHost, value: str
) -> None:
    cls, log = recorded(tmp_path, "podman-cli.yaml")
    with pytest.raises(InvalidGpuRequest) as refused:
        cls(host, "opt-image", image=value).create(request())
    assert (refused.value.field, refused.value.value) == ("--image", value)
    assert runs(log) == []


@pytest.mark.parametrize("value", OPTION_LIKE)
def test_openshells_image_after_from_is_refused_before_its_program_is_looked_for(
    host: GpuHost, value: str
) -> None:
    """`--from {image}`: two words, the image a word of its own."""
    driver = driver_class(EXAMPLES / "openshell.yaml")(host, "opt-openshell")
    with pytest.raises(InvalidGpuRequest) as refused:
        driver.create(request(image=value))
    assert (refused.value.field, refused.value.value) == ("template.image", value)


@pytest.mark.parametrize("value", [v for v in HOSTILE if "\n" not in v])
@pytest.mark.parametrize("example", ["podman-cli.yaml", "podman-cli-choosing.yaml"])
def test_other_values_are_each_one_word_where_the_template_puts_them(
    tmp_path: Path, host: GpuHost, example: str, value: str
) -> None:
    """In `--env=K=V` a value is never an option; `;` and `$(…)` reach no shell."""
    cls, log = recorded(tmp_path, example)
    image = "img" if value.startswith("-") else value
    with cls(host, "one-word").create(request(image=image, env={"K": value, "L": "x\ny"})):
        (run, *_) = runs(log)
        argv = run["argv"]
        assert f"--env=K={value}" in argv
        assert "--env=L=x\ny" in argv
        assert argv[-3:] == [image, "sleep", "infinity"]
    assert not Path("/tmp/pwned").exists()


def test_a_newline_in_an_image_is_refused_by_the_request_model(
    tmp_path: Path, host: GpuHost
) -> None:
    cls, log = recorded(tmp_path, "podman-cli.yaml")
    with pytest.raises(InvalidGpuRequest, match=r"template\.image must be an image's name"):
        cls(host, "newline").create(request(image="a\nb"))
    assert runs(log) == []


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("example", ["podman-cli.yaml", "podman-cli-choosing.yaml"])
def test_a_device_id_is_one_the_host_has_or_refused_before_anything_runs(
    tmp_path: Path, host: GpuHost, example: str, value: str
) -> None:
    cls, log = recorded(tmp_path, example)
    spec = parse_spec(
        {
            "resource_requirements": {"gpu": {}},
            "template": {"driver_config": {cls.name: {"gpu_device_ids": [value]}}},
        }
    )
    with pytest.raises(InvalidGpuRequest) as refused:
        cls(host, "device").create(spec)
    assert refused.value.value in (value, [value])
    assert runs(log) == []
    assert host.leases.leases() == []


def test_a_driver_config_value_that_is_an_option_is_refused_by_its_field(
    tmp_path: Path, host: GpuHost
) -> None:
    state = tmp_path / "sb"
    manifest = sh_manifest(
        state, driverConfig={"net": {"type": "string", "fragment": ["--net", "{value}"]}}
    )
    cls = driver_class(write(tmp_path / "d.yaml", manifest))
    spec = parse_spec({"template": {"driver_config": {"sh-files": {"net": "--privileged"}}}})
    with pytest.raises(InvalidGpuRequest) as refused:
        cls(host, "config").create(spec)
    assert refused.value.field == "template.driver_config.sh-files.net"
    assert not state.exists()


def test_after_a_double_dash_a_value_is_an_operand(tmp_path: Path, host: GpuHost) -> None:
    state = tmp_path / "sb"
    manifest = sh_manifest(state)
    manifest["templates"]["create"] = [*manifest["templates"]["create"], "--", "{image}"]
    cls = driver_class(write(tmp_path / "d.yaml", manifest))
    with cls(host, "dashdash").create(request(image="--privileged")) as sandbox:
        assert sandbox.running()


def test_a_driver_id_that_is_an_option_never_reaches_close(tmp_path: Path, host: GpuHost) -> None:
    """`podman rm --force {id}` with an id of `--all` would remove every container."""
    manifest = sh_manifest(tmp_path / "sb", sandboxId="stdout")
    manifest["templates"]["create"] = ["echo", "--all"]
    manifest["templates"]["close"] = [
        "sh",
        "-c",
        'echo "$@" >> ' + str(tmp_path / "closed"),
        "c",
        "{id}",
    ]
    cls = driver_class(write(tmp_path / "d.yaml", manifest))
    with pytest.raises(SandboxStartError, match="printed the id '--all'"):
        cls(host, "id").create(parse_spec({}))
    closed = (tmp_path / "closed").read_text().split()
    assert "--all" not in closed, closed  # closed by the adapter's own id instead


def test_an_exec_env_key_that_is_an_option_is_refused(tmp_path: Path, host: GpuHost) -> None:
    from drivers.external.driver import TemplatesSandbox

    cls = driver_class(write(tmp_path / "d.yaml", sh_manifest(tmp_path / "sb")))
    with cls(host, "exec-env").create(parse_spec({})) as sandbox:
        assert isinstance(sandbox, TemplatesSandbox)

        command = Command.of(["true"], 5)
        hostile = {"-i": "x"}  # `env -i=x true`: env's own option
        with (
            mock.patch.object(Command, "env", property(lambda self: hostile)),
            pytest.raises(SandboxExecError, match="begins with '-'"),
        ):
            sandbox.exec_argv(command)


# -- the manifest, read strictly -------------------------------------------------------------


def alias_bomb_manifest() -> str:
    """606 bytes: a manifest whose description is 9**9 strings once its aliases are expanded."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for before, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{','.join(['*' + before] * 9)}]")
    return (
        "apiVersion: gpu-sandbox.dev/v1alpha1\nkind: Driver\nname: bomb\nmode: templates\n"
        "allocation: driver\ncapabilities: {maxGpusPerSandbox: 1, exactIds: false}\n"
        "templates: {create: [x], exec: [x], close: [x], list: [x], reap: [x]}\n"
        "timeouts:\n" + "".join(f"  {line}\n" for line in lines) + "description: *i\n"
    )


def test_an_alias_bomb_is_refused_at_its_first_anchor_within_a_memory_bound(
    tmp_path: Path,
) -> None:
    path = write_text(tmp_path / "bomb.yaml", alias_bomb_manifest())
    script = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from drivers.external.manifest import ManifestError, load
        try:
            load({str(path)!r})
        except ManifestError as exc:
            print("refused", exc.key)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "refused timeouts.a", done.stderr[-500:]


STRICT = {
    "a second create": (
        "templates:\n", "templates:\n  create: [sh, -c, 'curl x | sh']\n",
        "templates.create", "the key 'create' is given twice",
    ),
    "a timeout of .nan": (
        "timeouts:\n", "timeouts:\n  ready: .nan\n", "timeouts.ready", ".nan is not a finite",
    ),
    "a timeout of .inf": (
        "timeouts:\n", "timeouts:\n  ready: .inf\n", "timeouts.ready", ".inf is not a finite",
    ),
    "a tag": (
        "name: sh-files", "name: !!python/name:os.system sh-files", "name", "tags are not allowed",
    ),
    "a merge key": (
        "capabilities:\n", "capabilities:\n  <<: {shared: true}\n", "capabilities['<<']",
        "merge keys are not allowed",
    ),
}  # fmt: skip
"""In a manifest of the driver of sh commands: what is replaced, by what, the key, the problem."""


@pytest.mark.parametrize(("where", "what", "key", "said"), STRICT.values(), ids=list(STRICT))
def test_a_manifest_is_read_strictly_naming_the_key_and_its_line(
    tmp_path: Path, where: str, what: str, key: str, said: str
) -> None:
    text = yaml.safe_dump(sh_manifest(tmp_path / "sb"))
    assert text.count(where) == 1
    path = write_text(tmp_path / "driver.yaml", text.replace(where, what))
    with pytest.raises(ManifestError) as refused:
        driver_class(path)
    assert refused.value.key == key, refused.value
    assert said in str(refused.value)
    assert ": line " in str(refused.value)


def test_a_non_finite_timeout_is_refused_by_the_schema_check_too(tmp_path: Path) -> None:
    for value in (math.nan, math.inf, -1.0, 0.0):
        with pytest.raises(ManifestError) as refused:
            parse(sh_manifest(tmp_path, timeouts__create=value))
        assert refused.value.key == "timeouts.create", value


def test_a_default_image_that_is_an_option_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ManifestError) as refused:
        parse(sh_manifest(tmp_path, defaultImage="--privileged"))
    assert refused.value.key == "defaultImage"


# -- the environment of the driver's commands ------------------------------------------------


def test_commands_run_with_the_fixed_environment_and_only_what_passEnv_names(
    tmp_path: Path, host: GpuHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    evil = tmp_path / "evil"
    evil.mkdir()
    monkeypatch.setenv("PATH", f"{evil}:{os.environ['PATH']}")
    monkeypatch.setenv("LD_PRELOAD", str(evil / "nothing.so"))
    monkeypatch.setenv("GPU_SANDBOX_CANARY", "leaked")
    monkeypatch.setenv("DRIVER_TOKEN", "passed")
    cls, log = recorded(tmp_path, "podman-cli.yaml")
    manifest = cls.manifest.path.read_text() + "passEnv: [DRIVER_TOKEN, NOT_SET_HERE]\n"
    cls = driver_class(write_text(tmp_path / "with-env.yaml", manifest))
    with cls(host, "env").create(request()) as sandbox:
        sandbox.exec(["true"])
    envs = [run["env"] for run in runs(log)]
    assert len(envs) >= 3  # run, inspect, exec
    for env in envs:
        env.pop("GPU_SANDBOX_EXEC", None)  # exec's marker
        assert env == {"PATH": HOST_PATH, "LANG": "C.UTF-8", "DRIVER_TOKEN": "passed"}


JSONL_ENV = """
import json, os, sys
json.dump(dict(os.environ), open("env.json", "w"))
for line in sys.stdin:
    r = json.loads(line)
    result = {"protocol": 1, "driver": {"name": "envy", "version": "0"},
              "capabilities": {"maxGpusPerSandbox": 1, "exactIds": False}}
    reply = {"list": {"sandbox_ids": []}, "reap": {"removed": []}}.get(r["op"], result)
    sys.stdout.write(json.dumps({"id": r["id"], "op": r["op"], "result": reply}) + "\\n")
    sys.stdout.flush()
"""


def test_a_jsonl_driver_process_gets_the_fixed_environment(
    tmp_path: Path, host: GpuHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_SANDBOX_CANARY", "leaked")
    (tmp_path / "envy.py").write_text(JSONL_ENV)
    manifest = {
        "apiVersion": "gpu-sandbox.dev/v1alpha1", "kind": "Driver", "name": "envy",
        "mode": "jsonl", "allocation": "driver", "command": ["{python}", "envy.py"],
        "capabilities": {"maxGpusPerSandbox": 1, "exactIds": False},
    }  # fmt: skip
    cls = driver_class(write(tmp_path / "envy.yaml", manifest))
    assert cls(host, "envy").sandboxes("envy") == []
    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen.pop(DRIVER_MARKER_ENV), "no marker: what the driver starts cannot be found"
    assert seen == {"PATH": HOST_PATH, "LANG": "C.UTF-8"}


def test_the_commands_image_flag_is_held_to_the_same_rule() -> None:
    """`gpu-sandbox spec --image=--privileged`: the request's image, refused by name."""
    done = subprocess.run(
        [Path(sys.executable).parent / "gpu-sandbox", "spec",
         f"--driver=exec:{EXAMPLES / 'openshell.yaml'}", "--gpu", "--image=--privileged"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert "(InvalidGpuRequest at template.image)" in done.stderr
    assert "is not an image reference" in done.stderr  # --from's rule in the manifest's limits


# -- OpenShell's command line: a request's value is never a flag nor a shell word ----------------

INJECTED = ["--gpu", ";", "$(touch /tmp/gpu-sandbox-pwned)", "a\nb"]
"""A flag of OpenShell's create, a shell separator, a command substitution, a newline."""


def openshell_recorded(tmp_path: Path) -> tuple[type[ExternalDriver], Path]:
    """examples/drivers/openshell.yaml with its program replaced by the recorder."""
    log = tmp_path / "argv.jsonl"
    recorder = tmp_path / "openshell"
    recorder.write_text(RECORDER.format(python=sys.executable, log=str(log)))
    recorder.chmod(0o755)
    text = (EXAMPLES / "openshell.yaml").read_text()
    text = text.replace("- openshell\n", f"- {recorder}\n").replace("[openshell,", f"[{recorder},")
    return driver_class(write_text(tmp_path / "openshell.yaml", text)), log


def flags_of(argv: list[str]) -> list[str]:
    """The words of a create before its `--` that begin with '-', each up to its '='."""
    return [word.partition("=")[0] for word in argv[: argv.index("--")] if word.startswith("-")]


@pytest.mark.parametrize("value", INJECTED, ids=["flag", "semicolon", "substitution", "newline"])
@pytest.mark.parametrize("field", ["image", "env value", "device ID"])
def test_a_request_value_never_becomes_a_flag_or_a_shell_word_of_openshells_create(
    tmp_path: Path, host: GpuHost, field: str, value: str
) -> None:
    """Refused by name, or one word of the argv beside the flags a harmless value gets.

    An image is refused by name (not an image reference); an env value is one word,
    ``--env=V=<value>``; a device ID is refused as unknown, and where it reaches the render,
    it is a string inside the one JSON word.
    """
    cls, log = openshell_recorded(tmp_path)
    driver = cls(host, "injected")
    if field == "image":
        with pytest.raises(InvalidGpuRequest) as refused:
            driver.create(request(image=value))
        assert (refused.value.field, refused.value.value) == ("template.image", value)
        assert runs(log) == []
    elif field == "env value":
        with driver.create(parse_spec({"template": {"env": {"V": value}}})):
            (created, *_) = [run["argv"] for run in runs(log)]
        with driver.create(parse_spec({"template": {"env": {"V": "harmless"}}})):
            harmless = runs(log)[-1]["argv"]
        assert f"--env=V={value}" in created
        assert value not in created, "the value is a word of its own"
        assert flags_of(created) == flags_of(harmless)
    else:
        block = {"openshell": {"gpu_device_ids": [value]}}
        spec = parse_spec(
            {"resource_requirements": {"gpu": {}}, "template": {"driver_config": block}}
        )
        with pytest.raises(InvalidGpuRequest) as refused:
            driver.create(spec)
        assert refused.value.field == "template.driver_config.openshell.gpu_device_ids"
        assert runs(log) == []
        devices = ((value, ""), ("nvidia.com/gpu=1", ""))
        values = {"session_id": "s", "sandbox_id": "0123456789ab", "driver": "openshell",
                  "cdi_kind": "nvidia.com/gpu"}  # fmt: skip
        argv = render_create(cls.manifest, CreateRequest("", count=2, devices=devices), values)
        assert value not in argv, "the value is a word of its own"
        (config,) = [word for word in argv if word.startswith("{")]
        assert json.loads(config)["docker"]["cdi_devices"] == [value, "nvidia.com/gpu=1"]
        assert flags_of(argv) == [
            "--name", "--label", "--label", "--gpu", "--driver-config-json", "--no-tty", "--detach",
        ]  # fmt: skip
    assert not Path("/tmp/gpu-sandbox-pwned").exists()
