"""The README and the pages of ``docs/`` hold together, and their quoted errors are real.

Every page of ``docs/`` is reachable from the README and leads back to it; every relative link
of every page names a file that exists and, after ``#``, a heading of that file; and every error
message the errors table of ``docs/cli.md`` quotes is written, word for word, in the package's
sources (``…`` standing for a name or value the code fills in), so a reworded message fails here
instead of leaving the table quoting words no code prints. The grouping policies' table is
what the command that the page says made it prints today.
"""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from markdown_pages import ROOT, anchors, links, read_page, section

PAGES = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))
ALL_PAGES = ["README.md", *PAGES]
SOURCES = ("spec", "reference", "optimized", "conformance", "src/hybridkv")


def _targets(page: str) -> set[str]:
    """The files (repository-relative) that ``page`` links to."""
    folder = (ROOT / page).parent
    found = set()
    for link in links(read_page(page)):
        path = link.split("#", 1)[0]
        if path and "://" not in path:
            found.add((folder / path).resolve().relative_to(ROOT).as_posix())
    return found


def test_the_readme_links_every_docs_page_and_every_page_links_back() -> None:
    assert len(PAGES) == 10
    assert set(PAGES) <= _targets("README.md")
    for page in PAGES:
        assert "README.md" in _targets(page), page


def test_each_docs_page_links_its_neighbours_in_the_readmes_order() -> None:
    """The README's list of pages is the reading order; each page links the one before and the
    one after it."""
    listed = [
        target
        for target in links(section(read_page("README.md"), "The documentation"))
        if target.startswith("docs/")
    ]
    assert sorted(listed) == PAGES
    for before, after in itertools.pairwise(listed):
        assert after in _targets(before), (before, after)
        assert before in _targets(after), (after, before)


@pytest.mark.parametrize("page", ALL_PAGES)
def test_every_relative_link_resolves_to_a_file_and_heading(page: str) -> None:
    folder = (ROOT / page).parent
    relative = [link for link in links(read_page(page)) if "://" not in link]
    assert relative, page
    for link in relative:
        path, _, anchor = link.partition("#")
        target = (folder / path).resolve() if path else ROOT / page
        assert target.is_file(), f"{page}: {link} names no file"
        if anchor:
            assert anchor in anchors(target.read_text(encoding="utf-8")), f"{page}: {link}"


@cache
def _code_strings() -> tuple[str, ...]:
    """Every string literal of the package's sources; an f-string with ``…`` for each value it
    fills in (implicitly joined literals are one string, as Python reads them)."""
    strings: list[str] = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.JoinedStr):
                    strings.append(
                        "".join(
                            str(part.value) if isinstance(part, ast.Constant) else "…"
                            for part in node.values
                        )
                    )
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    strings.append(node.value)
    return tuple(strings)


def _in_code(quoted: str) -> bool:
    """Whether one string literal of the sources reads ``quoted``, each ``…`` of it standing for
    any text."""
    fragments = quoted.split("…")
    pattern = re.compile(".*?".join(re.escape(fragment) for fragment in fragments), re.DOTALL)
    longest = max(fragments, key=len)  # a plain substring test first: most strings lack it
    return any(longest in string and pattern.search(string) for string in _code_strings())


def _quoted_errors() -> list[str]:
    """The messages the errors tables of ``docs/cli.md`` quote (their second column's code)."""
    quotes = []
    for heading in ("The command line's errors", "The library's errors"):
        table = section(read_page("docs/cli.md"), heading)
        rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
        quotes += [q for row in rows for q in re.findall(r"`([^`]+)`", row.split(" | ")[1])]
    return quotes


def test_the_matcher_finds_a_real_message_and_not_a_retired_one() -> None:
    assert _in_code("num_blocks must be an int of at least 2 (the null block plus one), got …")
    assert _in_code("… must be a positive int, got …")
    assert not _in_code("every KV cache group must share one block size")
    assert not _in_code("enable_caching=True is not supported with a Mamba group yet")


def test_every_error_message_the_docs_quote_is_in_the_code() -> None:
    quoted = _quoted_errors()
    assert len(quoted) >= 18
    assert [message for message in quoted if not _in_code(message)] == []


def test_the_readme_and_docs_name_the_kill_tables_command() -> None:
    """The planted-bug table's command moved from ``conformance.mutants`` to its own module."""
    assert "python -m hybridkv.conformance.kill_table --table" in read_page("docs/checks.md")
    assert (Path(ROOT) / "conformance" / "kill_table.py").is_file()


def test_the_grouping_policies_table_is_what_its_command_prints() -> None:
    page = read_page("docs/grouping-policies.md")
    pasted = page.split("Made by `hybridkv policies --format markdown`:\n\n", 1)[1]
    printed = subprocess.run(
        [sys.executable, "-m", "hybridkv", "policies", "--format", "markdown"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout.strip()
    assert printed.count("\n| ") == 28  # the header, 25 catalogue models and 2 layouts
    assert pasted.startswith(printed + "\n\n")


def test_the_kill_tables_modules_are_where_the_catalogue_plants_each_bug() -> None:
    """Each row of the planted-bug table in docs/checks.md names the module its mutant patches
    today (code moves; the table must follow)."""
    from hybridkv.conformance.mutants import MUTANTS

    where = {m.name: m.module.removeprefix("hybridkv.") for m in MUTANTS}
    rows = re.findall(
        r"^\| `([a-z0-9_]+)` \| `([a-z0-9_.]+)` \|", read_page("docs/checks.md"), re.M
    )
    listed = {name: module for name, module in rows if name in where}
    assert len(listed) == len(where)
    assert {name: module for name, module in listed.items() if where[name] != module} == {}
