"""openshell_standin/rules.py: OpenShell's gateway rules, checked without the CLI or a sandbox.

Each expected message is OpenShell's own, from the source line the rule cites.
"""

from __future__ import annotations

import shlex
import subprocess

import pytest

from openshell_standin import rules
from openshell_standin.rules import DriverBlock, Refused


def refused(call: object, *args: object) -> Refused:
    with pytest.raises(Refused) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("a" * 20, "name exceeds maximum length (20 > 19)"),
        ("é" * 10, "name exceeds maximum length (20 > 19)"),  # bytes, as Rust's len()
        ("Upper", "name must contain only lowercase alphanumeric characters or hyphens"),
        ("a_b", "name must contain only lowercase alphanumeric characters or hyphens"),
        ("-ab", "name must not start or end with a hyphen"),
        ("ab-", "name must not start or end with a hyphen"),
        ("a--b", "name must not contain consecutive hyphens"),
    ],
)
def test_names_over_19_bytes_or_not_a_dns_label_are_refused(name: str, message: str) -> None:
    error = refused(rules.check_name, name)
    assert (error.code, error.message) == ("INVALID_ARGUMENT", message)


def test_names_of_19_bytes_and_no_name_pass() -> None:
    rules.check_name("a" * 19)
    rules.check_name("")  # the gateway makes one
    rules.check_name("os-0123456789-ab-1c")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("", "v", "label key cannot be empty"),
        ("gpu-sandbox.session", "", None),
        ("gpu-sandbox.dev/session", "abc", None),
        ("Gpu.dev/x", "v", "label key prefix must be a DNS subdomain"),
        ("a/b/c", "v", "label key name segment contains invalid characters"),
        ("x" * 64, "v", "label key name segment exceeds 63 characters"),
        ("k", "-v", "label value must start with alphanumeric character: '-v'"),
        ("k", "a b", "label value contains invalid characters"),
        ("k", "v" * 64, "label value exceeds 63 characters"),
    ],
)
def test_labels_follow_kubernetes_rules(key: str, value: str, message: str | None) -> None:
    if message is None:
        rules.check_labels({key: value})
        return
    assert message in refused(rules.check_labels, {key: value}).message


def test_selectors_are_pairs_checked_as_labels() -> None:
    assert rules.parse_selector(" a=b, ,c.d/e=f ,") == [("a", "b"), ("c.d/e", "f")]
    assert rules.parse_selector("") == []
    assert refused(rules.parse_selector, "a").message == (
        "invalid label selector: expected 'key=value', got 'a'"
    )
    assert (
        "label value contains invalid characters" in refused(rules.parse_selector, "a=b c").message
    )
    too_many = ",".join(f"k{i}=v" for i in range(65))
    assert refused(rules.parse_selector, too_many).message == "label selector exceeds 64 pair limit"


def test_the_page_size_is_100_by_default_and_1000_at_most() -> None:
    assert [rules.clamp_limit(n) for n in (0, 1, 1000, 5000)] == [100, 1, 1000, 1000]


@pytest.mark.parametrize(
    "word", ["--gpu", "a;b", "$(id)", "`id`", "it's", "x\ny", "", "*", "a b", "~", "é"]
)
def test_each_word_reaches_bash_as_one_word(word: str) -> None:
    line = rules.remote_command(["printf", "%s|", word], {"K": "v w"}, "")
    # What bash -c makes of the line: the assignment, then each word as given.
    shown = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, check=True, env={}
    ).stdout
    assert shown == f"{word}|"


def test_the_command_line_is_assignments_sorted_then_words() -> None:
    line = rules.remote_command(["ls", "-l"], {"B": "2", "A": "x'y"}, "/tmp/a b")
    assert line == "cd '/tmp/a b' && A='x'\"'\"'y' B=2 ls -l"
    assert shlex.split(line)[3:] == ["A=x'y", "B=2", "ls", "-l"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"V": "a\nb"}, "environment value for 'V' contains newline or carriage return characters"),
        ({"V": "a\rb"}, "environment value for 'V' contains newline or carriage return characters"),
        ({"1V": "x"}, "environment keys must match ^[A-Za-z_][A-Za-z0-9_]*$"),
        ({"OPENSHELL_X": "x"}, "environment keys starting with OPENSHELL_ are reserved; got "),
    ],
)
def test_exec_environment_is_one_line_per_assignable_name(
    env: dict[str, str], message: str
) -> None:
    assert refused(rules.check_exec, ["true"], env, "").message.startswith(message)


def test_exec_arguments_may_hold_newlines_but_not_nul() -> None:
    rules.check_exec(["sh", "-c", "a\nb"], {}, "")
    assert refused(rules.check_exec, ["a\0b"], {}, "").message == (
        "command argument 0 contains null bytes"
    )
    assert refused(rules.check_exec, [], {}, "").message == "command is required"


def test_create_environment_values_are_on_one_line() -> None:
    error = refused(rules.check_environment, {"V": "$(id)\n"}, "spec.environment")
    assert error.message == (
        "spec.environment value for 'V' contains newline or carriage return characters"
    )


def test_only_the_active_drivers_block_is_read() -> None:
    config = {"docker": {"cdi_devices": ["k=0"]}, "vm": {"gpu_device_ids": ["bad"]}}
    assert rules.select_block(config, "docker") == {"cdi_devices": ["k=0"]}
    assert rules.select_block(config, "podman") == {}
    assert refused(rules.select_block, {"docker": ["k=0"]}, "docker").message == (
        "template.driver_config.docker must be an object"
    )


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (
            {"gpu_device_ids": ["k=0"]},
            "invalid docker driver_config: unknown field `gpu_device_ids`",
        ),
        ({"cdi_devices": []}, "invalid docker driver_config: must be a non-empty list of strings"),
        ({"cdi_devices": [" "]}, "invalid docker driver_config: [0] must be a non-empty string"),
        ({"cdi_devices": "k=0"}, "invalid docker driver_config: invalid type for `cdi_devices`"),
    ],
)
def test_the_block_is_read_strictly(block: dict[str, object], message: str) -> None:
    assert refused(rules.read_block, block, "docker").message.startswith(message)


def test_exact_ids_need_a_gpu_request_of_their_count_and_no_duplicates() -> None:
    ids = DriverBlock(("k=0", "k=1"), "driver_config.cdi_devices")
    rules.check_exact_devices(True, 2, ids)
    rules.check_exact_devices(True, None, DriverBlock(("k=0",), "driver_config.cdi_devices"))
    cases = [
        (False, None, ids, "driver_config.cdi_devices requires a gpu request"),
        (True, None, ids, "gpu count (1) must match driver_config.cdi_devices length (2)"),
        (True, 3, ids, "gpu count (3) must match driver_config.cdi_devices length (2)"),
        (True, 2, DriverBlock(("k=0", "k=0"), "driver_config.cdi_devices"),
         "driver_config.cdi_devices contains duplicate device ID 'k=0'"),
    ]  # fmt: skip
    for requested, count, block, message in cases:
        assert refused(rules.check_exact_devices, requested, count, block).message == message
