"""The documentation renders: links resolve, and the generated pages are current.

Every relative link in README.md and docs/*.md must name an existing file,
and an anchor (``page.md#section``) a heading of that page, as GitHub renders
it. docs/config-reference.md must be what ``python -m rltrain.config.reference``
writes from the schema today (docs/bad-inputs.md has its own check in
tests/test_bad_inputs.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    out, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        if not in_code:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().replace("`", "").replace("*", "").lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if in_code or not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def test_slug_matches_github():
    assert slug("Config groups and overrides") == "config-groups-and-overrides"
    assert slug("`precision.grad_scaler`") == "precisiongrad_scaler"
    assert slug("Refit (weights to the engines)") == "refit-weights-to-the-engines"
    assert slug("Faults, restarts and bad input") == "faults-restarts-and-bad-input"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.name}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_docs_are_linked_from_the_readme():
    readme = _prose((REPO / "README.md").read_text())
    for page in (REPO / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_config_reference_is_current():
    from rltrain.config.reference import DOC, render

    assert DOC.read_text() == render(), (
        "docs/config-reference.md is stale: python -m rltrain.config.reference"
    )


def test_config_reference_lists_every_key():
    """Every leaf key of the schema is a row, with its default."""
    import dataclasses

    from rltrain.config.reference import collect
    from rltrain.config.schema import RunConfig

    def leaves(node: object, prefix: str = "") -> list[str]:
        out = []
        for f in dataclasses.fields(node):  # type: ignore[arg-type]
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                out += leaves(value, f"{prefix}{f.name}.")
            else:
                out.append(f"{prefix}{f.name}")
        return out

    listed = [k.key for _, keys in collect().values() for k in keys]
    assert sorted(listed) == sorted(leaves(RunConfig()))
    text = (REPO / "docs" / "config-reference.md").read_text()
    assert "| `optim.lr` | float | `0.0003` |" in text
    assert "| `refit.bucket_bytes` | int | `536870912 (512 MiB)` |" in text
