"""The project's Markdown pages as the tests read them: a page, the section under a heading, a
fenced block in that section, and the links and headings a page holds.

Tests that run a documented snippet take it from the page that shows it, so that what a reader
copies is what CI runs; fenced blocks are skipped when links and headings are read, because a
``#`` comment or a ``[x](y)`` inside code is neither.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^```.*?^```[ \t]*$", flags=re.DOTALL | re.MULTILINE)
_HEADING = re.compile(r"^(#{1,6}) +(.+?) *$", flags=re.MULTILINE)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def read_page(relative: str) -> str:
    """The page at ``relative`` (from the repository root), as text."""
    return (ROOT / relative).read_text(encoding="utf-8")


def outside_fences(text: str) -> str:
    """``text`` with every fenced code block blanked out: spaces for its characters, its line
    breaks kept, so that positions in the result are positions in ``text``."""
    return _FENCE.sub(lambda match: re.sub(r"[^\n]", " ", match.group(0)), text)


def section(text: str, heading: str) -> str:
    """The lines under the heading titled ``heading`` (any level), up to the next heading of the
    same or a higher level; ``KeyError`` naming the heading when the page has none."""
    plain = outside_fences(text)
    for match in _HEADING.finditer(plain):
        if match.group(2) == heading:
            level = len(match.group(1))
            end = len(text)
            for later in _HEADING.finditer(plain, match.end()):
                if len(later.group(1)) <= level:
                    end = later.start()
                    break
            return text[match.end() : end]
    raise KeyError(f"no heading {heading!r}")


def fenced_block(relative: str, heading: str, language: str, index: int = 0) -> str:
    """The ``index``-th fenced block tagged ``language`` under ``heading`` of the page at
    ``relative``, without its fences."""
    under = section(read_page(relative), heading)
    blocks = re.findall(rf"^```{re.escape(language)}\n(.*?)^```", under, re.DOTALL | re.MULTILINE)
    return str(blocks[index])


def slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives a heading: lower case, inline code
    marks and punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor on the page (a repeated heading's second anchor gets ``-1``)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for match in _HEADING.finditer(outside_fences(text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[str]:
    """Every link and image target on the page, outside code blocks and inline code."""
    plain = re.sub(r"`[^`\n]*`", "", outside_fences(text))
    return _LINK.findall(plain)
