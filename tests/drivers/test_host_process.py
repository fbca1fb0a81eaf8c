"""Host tools: the fixed PATH by default, or a path its variable names explicitly."""

from __future__ import annotations

from pathlib import Path

import pytest

from drivers.host_process import how_to_name, missing_tools, tool


def test_a_tool_outside_the_fixed_path_is_found_only_where_its_variable_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bwrap = tmp_path / "bwrap-0.9" / "bwrap"
    bwrap.parent.mkdir()
    bwrap.write_text("#!/bin/sh\n")
    bwrap.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bwrap.parent}:/usr/bin:/bin")  # the user's PATH: never read
    monkeypatch.delenv("GPU_SANDBOX_TOOL_NO_SUCH_TOOL", raising=False)
    assert missing_tools(["no-such-tool"]) == ["no-such-tool"]
    fake = bwrap.parent / "no-such-tool"
    fake.symlink_to(bwrap)
    assert missing_tools(["no-such-tool"]) == ["no-such-tool"], "the user's PATH was searched"
    monkeypatch.setenv("GPU_SANDBOX_TOOL_NO_SUCH_TOOL", str(fake))
    assert tool("no-such-tool") == str(fake)
    assert missing_tools(["no-such-tool"]) == []
    # Only an absolute path to an executable: a relative one, or a missing file, is no tool.
    for named in ("no-such-tool", str(tmp_path / "absent")):
        monkeypatch.setenv("GPU_SANDBOX_TOOL_NO_SUCH_TOOL", named)
        assert missing_tools(["no-such-tool"]) == ["no-such-tool"]
    assert how_to_name(["bwrap", "nsenter"]) == (
        "GPU_SANDBOX_TOOL_BWRAP=/path/to/bwrap, GPU_SANDBOX_TOOL_NSENTER=/path/to/nsenter"
    )
