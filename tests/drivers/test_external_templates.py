"""The templates language a CLI like OpenShell's needs: counts once, JSON arguments, limits, errors.

Each feature on the driver of sh commands (tests/drivers/test_external_driver.py): what it
renders, what the adapter refuses before anything runs, and what it reads back from a CLI.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from drivers.external import driver_class
from drivers.external.limits import check, is_image_reference
from drivers.external.manifest import ManifestError, parse
from drivers.external.process import empty_dir
from drivers.external.stderr import one_line, says_gone, typed_error
from drivers.external.templates import CreateRequest, LimitBroken, render_create
from drivers.external.validate import main as validate
from gpuhost import simulated
from gpuhost.errors import GpuBusy, GpusExhausted, InvalidGpuRequest, SandboxStartError
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec, parse_spec
from tests.drivers.test_external_driver import sh_manifest, write

VALUES = {"session_id": "s1", "sandbox_id": "0123456789ab", "driver": "sh-files", "cdi_kind": "k"}


@pytest.fixture
def host(tmp_path: Path) -> Iterator[GpuHost]:
    sim = simulated.setup(tmp_path / "sim", 4)
    yield GpuHost.open(HostConfig(sim.root))
    simulated.teardown(sim.root)


def chooser(state: Path, **changes: Any) -> dict[str, Any]:
    """The sh driver with ``allocation: driver`` and a CLI's GPU flags: OpenShell's shape."""
    manifest = sh_manifest(state, allocation="driver", **changes)
    manifest["templates"]["create"][4:] = [
        "{@gpu_default}", "{@count}", "{@device_list}", "{@image}", "{@env}",
    ]  # fmt: skip
    manifest["fragments"] = {
        "gpu_default": ["--gpu"],
        "count": ["--gpu={count}"],
        "device_list": [
            "--config",
            {"json": {"cli": {"devices": "{@device_ids}", "n": "{count}"}}},
        ],
        "image": ["--from={image}"],
        "env": ["--env={env_key}={env_value}"],
    }
    return manifest


def created(driver: Any, tmp_path: Path, spec: SandboxSpec) -> list[str]:
    """The argv words the sh driver's create was handed, for ``spec``."""
    with driver.create(spec) as sandbox:
        lines = (tmp_path / "sb" / driver.session_id / sandbox.id).read_text()
        return list(lines.split("\n")[0].split(" "))


def problem(argv: list[str], limits: Any) -> str:
    """What the first broken rule says, or "" when none is."""
    broken = check(argv, limits)
    return "" if broken is None else broken.problem


# -- counts, rendered once --------------------------------------------------------------------


def test_a_count_is_rendered_once_whatever_the_request(tmp_path: Path, host: GpuHost) -> None:
    """Default: --gpu; a count: --gpu=N; exact IDs: --gpu=<their number>; never two."""
    driver = driver_class(write(tmp_path / "d.yaml", chooser(tmp_path / "sb")))(host, "once")
    one, two = host.gpus[1].uuid, host.gpus[2].uuid
    assert created(driver, tmp_path, SandboxSpec()) == [""]
    assert created(driver, tmp_path, SandboxSpec.with_gpus()) == ["--gpu"]
    assert created(driver, tmp_path, SandboxSpec.with_gpus(2)) == ["--gpu=2"]
    exact = SandboxSpec.with_gpus(driver="sh-files", device_ids=[one, two])  # no count given
    words = created(driver, tmp_path, exact)
    assert words[:2] == ["--gpu=2", "--config"]
    assert json.loads(words[2]) == {"cli": {"devices": [one, two], "n": "2"}}
    counted = SandboxSpec.with_gpus(2, driver="sh-files", device_ids=[one, two])
    assert created(driver, tmp_path, counted)[:2] == ["--gpu=2", "--config"]


def test_the_json_argument_is_one_word_whatever_the_ids_hold(tmp_path: Path) -> None:
    manifest = parse(chooser(tmp_path))
    hostile = ['a"b', "c\nd", "--gpu", "$(id)", "e\\f", "ü"]
    devices = tuple((device, "") for device in hostile)
    argv = render_create(manifest, CreateRequest("", count=len(hostile), devices=devices), VALUES)
    assert argv[4:6] == ["--gpu=6", "--config"]
    assert json.loads(argv[6]) == {"cli": {"devices": hostile, "n": "6"}}
    assert len(argv) == 7


def test_the_image_reaches_its_fragment_from_the_request_the_option_or_the_default(
    tmp_path: Path, host: GpuHost
) -> None:
    manifest = chooser(tmp_path / "sb", defaultImage="registry.example/base:1")
    cls = driver_class(write(tmp_path / "d.yaml", manifest))
    assert created(cls(host, "img"), tmp_path, SandboxSpec()) == ["--from=registry.example/base:1"]
    assert created(cls(host, "img", image="mine:2"), tmp_path, SandboxSpec()) == ["--from=mine:2"]
    spec = parse_spec({"template": {"image": "theirs:3"}})
    assert created(cls(host, "img", image="mine:2"), tmp_path, spec) == ["--from=theirs:3"]


# -- limits: what the CLI would refuse ----------------------------------------------------------


def test_limits_find_a_flag_given_twice_a_value_too_long_or_not_matching() -> None:
    manifest = parse(chooser(Path("/x"), limits={
        "--gpu": {"once": True},
        "--name": {"maxLength": 5, "pattern": "^[a-z]+$"},
        "--from": {"imageReference": True},
    }))  # fmt: skip
    limits = manifest.limits
    assert problem(["cli", "--gpu", "--gpu=2"], limits).startswith("--gpu is given more")
    assert problem(["cli", "--gpu", "--", "--gpu"], limits) == ""  # operands are not flags
    assert "6 bytes" in problem(["cli", "--name=abcdef"], limits)
    assert "6 bytes" in problem(["cli", "--name", "abcdef"], limits)  # two words
    assert "6 bytes" in problem(["cli", "--name=ééé"], limits)  # bytes, not characters
    assert "does not match" in problem(["cli", "--name=ab1"], limits)
    assert problem(["cli", "--name"], limits) == "--name is given no value"
    assert problem(["cli", "--name=abc", "--from=reg.example:5000/a/b:1"], limits) == ""
    assert "not an image reference" in problem(["cli", "--from=/home/me"], limits)


@pytest.mark.parametrize(
    "image",
    ["busybox", "gpu-sandbox-busybox:latest", "ghcr.io/nvidia/openshell-community/base:latest",
     "localhost:5000/a/b_c.d:v1.2", "[::1]:5000/x", f"x@sha256:{'a' * 64}"],
)  # fmt: skip
def test_image_references_pass(image: str) -> None:
    assert is_image_reference(image)


@pytest.mark.parametrize(
    "image",
    ["/etc", "./build", "../x", "~/x", ".", "..", "Dockerfile", "--gpu", ";", "$(id)", "a\nb",
     "a b", "", "x:", "x" * 256],
)  # fmt: skip
def test_paths_options_and_shell_words_are_no_image_references(image: str) -> None:
    """OpenShell's --from builds a local Dockerfile from a path (cli run.rs:1044-1110)."""
    assert not is_image_reference(image)


def test_a_request_value_breaking_a_limit_is_refused_by_its_field_before_anything_runs(
    tmp_path: Path, host: GpuHost
) -> None:
    manifest = chooser(tmp_path / "sb", limits={"--from": {"imageReference": True}})
    cls = driver_class(write(tmp_path / "d.yaml", manifest))
    spec = parse_spec({"template": {"image": "/home/someone/project"}})
    with pytest.raises(InvalidGpuRequest) as refused:
        cls(host, "lim").create(spec)
    assert (refused.value.field, refused.value.value) == ("template.image", "/home/someone/project")
    assert "is not an image reference" in str(refused.value)
    with pytest.raises(InvalidGpuRequest) as refused:
        cls(host, "lim", image="./Dockerfile").create(SandboxSpec())
    assert refused.value.field == "--image"
    assert not (tmp_path / "sb").exists(), "create ran"


def test_a_name_of_the_drivers_own_values_breaking_a_limit_fails_the_create_unrun(
    tmp_path: Path, host: GpuHost
) -> None:
    manifest = chooser(tmp_path / "sb", limits={"--name": {"maxLength": 19}})
    manifest["templates"]["create"].insert(4, "--name={session_id}-{sandbox_id}")
    cls = driver_class(write(tmp_path / "d.yaml", manifest))
    with pytest.raises(SandboxStartError, match=r"the CLI refuses more than 19 \(limits\.--name\)"):
        cls(host, "a-session-id").create(SandboxSpec())
    assert not (tmp_path / "sb").exists(), "create ran"
    with pytest.raises(LimitBroken):
        render_create(parse(manifest), CreateRequest(""), {**VALUES, "session_id": "s" * 63})


def test_validate_holds_every_render_to_the_limits_with_the_longest_session_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = chooser(tmp_path / "sb", limits={"--name": {"maxLength": 30}})
    manifest["templates"]["create"].insert(4, "--name={session_id}")
    path = write(tmp_path / "d.yaml", manifest)
    assert validate([str(path)]) == 2
    assert "(rendered with a session id of 63 characters)" in capsys.readouterr().err
    manifest["limits"]["--name"]["maxLength"] = 63
    assert validate([str(write(tmp_path / "e.yaml", manifest))]) == 0  # a class per path


# -- errors: a CLI's text read as the suite's typed errors -----------------------------------


FRAMED = """\
Error:   \u00d7 code: 'The system is not in a state required for the operation's
  \u2502 execution', message: "GPU GPU 2 (GPU-21a9a674-448b-441e-9c7e-
  \u2502 4a18f701e21d) is already assigned to another sandbox (held by x)"
"""


def test_stderr_is_read_as_one_line_without_frames_colours_or_wrapped_hyphens() -> None:
    text = one_line("\x1b[31m" + FRAMED + "\x1b[0m")
    assert text.startswith("Error: code: 'The system is not in a state required for the operation")
    assert "GPU-21a9a674-448b-441e-9c7e-4a18f701e21d" in text


def test_error_rules_give_typed_errors_with_their_fields(tmp_path: Path) -> None:
    manifest = parse(sh_manifest(tmp_path, errors=[
        {"match": "requested (?P<requested>[0-9]+), only (?P<available>[0-9]+)( of "
                  "(?P<total>[0-9]+))?", "error": "GpusExhausted"},
        {"match": "GPU (?P<device>.+?) is already assigned to another sandbox"
                  "( \\((?P<holder>.+)\\))?\"", "error": "GpuBusy"},
        {"match": "sandbox not found", "error": "SandboxGone"},
    ]))  # fmt: skip
    full = typed_error(manifest.errors, "requested 3, only 1 of 8")
    assert isinstance(full, GpusExhausted)
    assert (full.requested, full.available, full.total) == (3, 1, 8)
    bare = typed_error(manifest.errors, "requested 9, only 8")  # no record of use: 8 of 8
    assert isinstance(bare, GpusExhausted)
    assert (bare.requested, bare.available, bare.total) == (9, 8, 8)
    busy = typed_error(manifest.errors, FRAMED)
    assert isinstance(busy, GpuBusy)
    assert busy.device == "GPU 2 (GPU-21a9a674-448b-441e-9c7e-4a18f701e21d)"
    assert typed_error(manifest.errors, "something else") is None
    assert says_gone(manifest.errors, "Error: sandbox\n  \u2502 not found")
    assert typed_error(manifest.errors, "sandbox not found") is None  # gone is no create error


def test_an_error_rule_without_the_groups_its_error_needs_is_refused(tmp_path: Path) -> None:
    bad = sh_manifest(
        tmp_path, errors=[{"match": "requested (?P<n>[0-9]+)", "error": "GpusExhausted"}]
    )
    with pytest.raises(ManifestError) as refused:
        parse(bad)
    assert refused.value.key == "errors[0].match"
    assert "requested, available" in str(refused.value)


def test_a_create_whose_stderr_says_exhausted_raises_gpus_exhausted(
    tmp_path: Path, host: GpuHost
) -> None:
    manifest = chooser(tmp_path / "sb", errors=[
        {"match": "requested (?P<requested>[0-9]+) GPUs, only (?P<available>[0-9]+)",
         "error": "GpusExhausted"},
    ])  # fmt: skip
    manifest["templates"]["create"] = ["sh", "-c", "echo 'requested 2 GPUs, only 1' >&2; exit 1"]
    cls = driver_class(write(tmp_path / "d.yaml", manifest))
    with pytest.raises(GpusExhausted) as exhausted:
        cls(host, "ex").create(SandboxSpec.with_gpus(2))
    assert (exhausted.value.requested, exhausted.value.available) == (2, 1)


def test_a_close_whose_cli_says_the_sandbox_is_gone_is_done(tmp_path: Path, host: GpuHost) -> None:
    manifest = sh_manifest(tmp_path / "sb", errors=[{"match": "not found", "error": "SandboxGone"}])
    manifest["templates"]["close"] = ["sh", "-c", "echo 'sandbox not found' >&2; exit 1"]
    cls = driver_class(write(tmp_path / "d.yaml", manifest))
    sandbox = cls(host, "gone").create(SandboxSpec.with_gpus())
    sandbox.close()
    assert host.leases.leases() == []
    manifest["errors"] = []
    other = driver_class(write(tmp_path / "e.yaml", manifest))(host, "gone2")
    sandbox = other.create(SandboxSpec())
    with pytest.raises(Exception, match="exited 1: sandbox not found"):
        sandbox.close()


# -- reap, cwd, JSON elements -------------------------------------------------------------------


def test_without_a_reap_template_the_adapter_closes_each_sandbox_list_prints(
    tmp_path: Path, host: GpuHost
) -> None:
    manifest = sh_manifest(tmp_path / "sb")
    del manifest["templates"]["reap"]
    driver = driver_class(write(tmp_path / "d.yaml", manifest))(host, "reaped")
    made = sorted(driver.create(SandboxSpec()).id for _ in range(3))
    assert driver.reap("reaped") == made
    assert driver.sandboxes("reaped") == []
    manifest["sandboxId"] = "stdout"
    with pytest.raises(ManifestError) as refused:
        parse(manifest)
    assert refused.value.key == "templates.reap"


def test_commands_run_in_an_empty_directory_of_their_own(tmp_path: Path, host: GpuHost) -> None:
    """A value a CLI reads as a relative path (``Dockerfile``, ``build/``) names nothing."""
    manifest = sh_manifest(tmp_path / "sb")
    out = tmp_path / "cwd"
    manifest["templates"]["create"] = ["sh", "-c", f"pwd > {out}; ls -A >> {out}"]
    driver = driver_class(write(tmp_path / "d.yaml", manifest))(host, "cwd")
    with driver.create(SandboxSpec()):
        where, *listed = out.read_text().splitlines()
    assert listed == [], "the commands' directory holds files"
    assert where != os.getcwd()
    assert os.stat(where).st_uid == os.getuid()
    assert os.stat(where).st_mode & 0o077 == 0


@pytest.mark.parametrize("planted", ["a file in it", "open to all", "another user's", "a link"])
def test_a_planted_shared_empty_directory_is_never_the_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """gpu-sandbox-empty-<uid> in the temporary directory: used only when it is still that."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    empty_dir.cache_clear()
    shared = tmp_path / f"gpu-sandbox-empty-{os.getuid()}"
    try:
        assert empty_dir() == str(shared)  # made, empty, this user's, 0500
        empty_dir.cache_clear()
        if planted == "a link":
            shared.rmdir()
            (tmp_path / "elsewhere").mkdir(mode=0o700)
            shared.symlink_to(tmp_path / "elsewhere")
        elif planted == "a file in it":
            shared.chmod(0o700)
            (shared / "Dockerfile").write_text("FROM scratch\n")
        elif planted == "open to all":
            shared.chmod(0o777)
        else:
            if os.getuid() != 0:
                pytest.skip("needs root to give the directory to another user")
            os.chown(shared, 65534, 65534)
        chosen = empty_dir()
        assert chosen != str(shared)
        assert os.listdir(chosen) == []
        assert os.stat(chosen).st_uid == os.getuid()
    finally:
        empty_dir.cache_clear()


@pytest.mark.parametrize(
    ("fragment", "key"),
    [
        ({"count": [{"json": "{@device_ids}"}]}, "fragments.count[0].json"),
        ({"device_list": [{"json": {"{driver}": 1}}]}, "fragments.device_list[0].json.{driver}"),
        ({"device_list": [{"json": ["{nope}"]}]}, "fragments.device_list[0].json[0]"),
        ({"device_list": [{"json": "x{@device_ids}"}]}, "fragments.device_list[0].json"),
        ({"device_list": [{"json": 1, "yaml": 2}]}, "fragments.device_list[0]"),
    ],
    ids=["list-outside-device-list", "variable-in-a-key", "unknown-variable", "list-in-text",
         "unknown-key"],
)  # fmt: skip
def test_a_json_element_is_checked_like_a_template(
    tmp_path: Path, fragment: dict[str, Any], key: str
) -> None:
    manifest = sh_manifest(tmp_path)
    manifest["fragments"].update(fragment)
    with pytest.raises(ManifestError) as refused:
        parse(manifest)
    assert refused.value.key == key, refused.value
