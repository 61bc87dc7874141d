"""bench/RESULTS.md stays a standing page, and the links into it resolve.

RESULTS holds one current table per area (history lives in git), so it has a line budget; README.md's "Where it
stands" table and docs/*.md link into its sections by GitHub anchor, so every such anchor must name a heading that
exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
README = ROOT / "README.md"
MAX_LINES = 450
MAX_CELL = 160

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"\]\(([^)\s]*RESULTS\.md)#([^)\s]+)\)")
_SELF_LINK = re.compile(r"\]\(#([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's heading slug: lowercase, punctuation dropped (hyphens and spaces kept), spaces -> hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor GitHub makes for the headings of a page (a repeated slug gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else _HEADING.match(line)
        if not match:
            continue
        slug = github_anchor(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_github_anchor_rules():
    assert github_anchor("Ids from the tuned embedding (issue 55 item 2; CPU, 2026-12-07)") == (
        "ids-from-the-tuned-embedding-issue-55-item-2-cpu-2026-12-07"
    )
    assert github_anchor("Two channels: dense, generative, hybrid") == "two-channels-dense-generative-hybrid"
    assert github_anchor("generate on Ray") == "generate-on-ray"
    assert github_anchor("Per-bucket formats, fifth pass (H100, 2026-12-06/07 night)") == (
        "per-bucket-formats-fifth-pass-h100-2026-12-0607-night"
    )
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_results_page_within_line_budget():
    lines = RESULTS.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, (
        f"bench/RESULTS.md has {len(lines)} lines (budget {MAX_LINES}): keep one current table per area and "
        "replace superseded rows instead of adding passes (history lives in git)"
    )


def _links_into_results(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for target, anchor in _LINK.findall(line):
            if (path.parent / target).resolve() == RESULTS.resolve():
                found.append((number, anchor))
    return found


def test_readme_and_docs_links_into_results_name_existing_headings():
    existing = anchors(RESULTS.read_text(encoding="utf-8"))
    sources = [README, *sorted((ROOT / "docs").glob("*.md"))]
    readme_links = _links_into_results(README)
    assert readme_links, "README.md no longer links into bench/RESULTS.md sections"
    broken = [
        f"{src.relative_to(ROOT)}:{number}: #{anchor}"
        for src in sources
        for number, anchor in _links_into_results(src)
        if anchor not in existing
    ]
    assert not broken, "links to bench/RESULTS.md headings that do not exist:\n" + "\n".join(broken)


def test_results_internal_links_resolve():
    text = RESULTS.read_text(encoding="utf-8")
    existing = anchors(text)
    broken = sorted({anchor for anchor in _SELF_LINK.findall(text) if anchor not in existing})
    assert not broken, f"bench/RESULTS.md links to missing headings: {broken}"


def test_readme_standing_table_is_compact():
    text = README.read_text(encoding="utf-8")
    section = text.split("## Where it stands", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) > 2, "README.md's 'Where it stands' table is missing"
    too_long = [
        cell.strip()[:60]
        for row in rows
        for cell in row.strip().strip("|").split("|")
        if len(cell.strip()) > MAX_CELL
    ]
    assert not too_long, f"README 'Where it stands' cells over {MAX_CELL} characters: {too_long}"
