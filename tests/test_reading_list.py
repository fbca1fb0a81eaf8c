"""Every size a driver author's reading list states is the file's own, counted in lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "writing-a-driver.md"]
SIZE = re.compile(
    r"(?:\[[^\]]*\]\((?P<link>[^)\s]+)\)|`(?P<code>[^`\s]+)`|(?P<this>this page))"
    r"\s+\((?P<lines>\d[\d,]*) lines"
)
"""A file named (a link, a path in code, or "this page"), then ``(N lines``."""
ANY_SIZE = re.compile(r"\d[\d,]* lines")


def stated(page: Path) -> list[tuple[Path, int]]:
    """Each file whose size ``page`` states, and the size it states."""
    text = page.read_text()
    found = []
    for match in SIZE.finditer(text):
        if match["this"]:
            path = page
        elif match["link"]:
            path = (page.parent / match["link"]).resolve()
        else:
            path = ROOT / match["code"]
        found.append((path, int(match["lines"].replace(",", ""))))
    return found


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_each_size_a_page_states_is_the_files(page: Path) -> None:
    sizes = stated(page)
    assert sizes, f"{page.name} states no size: the pattern no longer finds its list"
    wrong = [
        f"{path.relative_to(ROOT)}: {said} lines said, {lines(path)} counted"
        for path, said in sizes
        if lines(path) != said
    ]
    assert wrong == []


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_no_size_is_stated_that_is_not_checked(page: Path) -> None:
    """A count of lines in other words ("a driver of 196 lines", a sum) would go stale."""
    assert len(ANY_SIZE.findall(page.read_text())) == len(stated(page))


def test_a_stale_size_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("one\ntwo\n")
    page = tmp_path / "page.md"
    page.write_text("1. [a](a.py) (2 lines);\n2. this page (1 lines)\n3. [a](a.py) (3 lines)\n")
    assert [(path.name, said) for path, said in stated(page)] == [
        ("a.py", 2), ("page.md", 1), ("a.py", 3)
    ]  # fmt: skip
    assert [said == lines(path) for path, said in stated(page)] == [True, False, False]


def test_the_page_names_every_name_of_the_public_contract() -> None:
    """What ``drivers.contract`` exports, docs/writing-a-driver.md names, and jail.py imports so."""
    import drivers.contract

    page = (ROOT / "docs" / "writing-a-driver.md").read_text()
    unnamed = [name for name in drivers.contract.__all__ if f"`{name}`" not in page]
    assert unnamed == []
    example = (ROOT / "examples" / "drivers" / "jail.py").read_text()
    assert "from drivers.contract import" in example
    inner = re.findall(r"^from (drivers\.(?:base|sandbox|commands)) import", example, re.M)
    assert inner == [], "the example imports the contract from where it is written"
