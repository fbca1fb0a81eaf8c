"""How the catalogue reads what a sandbox shows: CUDA_VISIBLE_DEVICES as CUDA reads it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest

from conformance.observe import cuda_visible_uuids
from drivers.base import ExecResult, Sandbox

LISTED = ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-cccc-3333"]


class _Shows:
    """A sandbox whose shell prints what the catalogue's probe of the variable prints."""

    def __init__(self, printed: str) -> None:
        self.printed = printed

    def exec(self, argv: Sequence[str], timeout: float = 60) -> ExecResult:
        return ExecResult(tuple(argv), 0, self.printed, "")


@pytest.mark.parametrize(
    ("printed", "cuda_uses"),
    [
        ("", LISTED),  # unset: every GPU listed
        ("=", []),  # set and empty: none
        ("=0,2", ["GPU-aaaa-1111", "GPU-cccc-3333"]),
        ("=2,0", ["GPU-cccc-3333", "GPU-aaaa-1111"]),
        ("=3", []),  # a host index past the sandbox's own GPUs
        ("=1,5,0", ["GPU-bbbb-2222"]),  # the first bad entry ends the list
        ("=GPU-bbbb,0", ["GPU-bbbb-2222", "GPU-aaaa-1111"]),  # UUID prefixes
        ("=GPU-", []),  # a prefix of several names none
        ("=-1", []),
        ("=0,0", ["GPU-aaaa-1111"]),
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(printed: str, cuda_uses: list[str]) -> None:
    assert cuda_visible_uuids(cast(Sandbox, _Shows(printed)), LISTED) == cuda_uses
