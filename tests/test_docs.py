"""The documentation stays true: docs/magics.md is what the magics' own parsers say, every
magic is in the README's table, every relative link in README.md and docs/ leads to a file
(and heading) that exists, and the README stays about one screen long. No cluster."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from dtlab.views.magic_reference import magic_reference, registered_magics

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
REGENERATE = "python -m dtlab.views.magic_reference > docs/magics.md"


def test_magics_reference_is_current():
    on_disk = (ROOT / "docs" / "magics.md").read_text()
    assert on_disk == magic_reference(), f"docs/magics.md is stale: regenerate with `{REGENERATE}`"


def test_the_reference_covers_every_registered_magic():
    magics = registered_magics()
    assert {"dt_launch", "dt", "dt_step", "dt_doctor"} <= set(magics)
    reference = magic_reference()
    for name, magic in magics.items():
        assert f"\n## {magic.heading}\n" in reference, name


def section(text: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    lines = text.split("\n")
    start = lines.index(heading) + 1
    end = next(
        (i for i in range(start, len(lines)) if re.match(rf"#{{1,{len(level)}}} ", lines[i])),
        len(lines),
    )
    return "\n".join(lines[start:end])


def test_every_magic_is_in_the_readme_table():
    rows = [
        line.split(" | ")[0]
        for line in section(README.read_text(), "## Magics").split("\n")
        if line.startswith("| ") and not line.startswith("| magic")
    ]
    assert rows, "README.md has no table under '## Magics'"
    missing = [
        name
        for name in registered_magics()
        if not any(re.search(rf"%%?{re.escape(name)}(?!\w)", row) for row in rows)
    ]
    assert not missing, f"magics missing from README.md's '## Magics' table: {missing}"


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def without_code(text: str) -> str:
    """Markdown with fenced blocks and code spans removed (a link inside code is text)."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def anchors(path: Path) -> set[str]:
    """Heading anchors as GitHub makes them: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered."""
    found: set[str] = set()
    for line in without_code_blocks(path.read_text()).split("\n"):
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


LINK = re.compile(r"\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_lead_somewhere(doc: Path):
    broken = []
    for target in LINK.findall(without_code(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http(s), mailto, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    broken = list(dict.fromkeys(broken))
    assert not broken, f"broken links in {doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_readme_is_one_screen_and_gives_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150, "README.md is a front page: move detail to docs/"
    assert "./dev demo" in text and "./dev test" in text


def test_the_gallery_shows_every_screenshot_the_browser_test_takes():
    shot = re.compile(r"\d\d-[a-z-]+\.png")
    taken = set(shot.findall((ROOT / "tests" / "test_browser.py").read_text()))
    shown = set(shot.findall((ROOT / "docs" / "gallery.md").read_text()))
    assert len(taken) >= 12 and taken == shown, (taken - shown, shown - taken)
    # shown from docs/gallery/, kept in git (runs/ is ignored: a page of broken images)
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", (ROOT / "docs" / "gallery.md").read_text())
    assert sorted(Path(i).name for i in images) == sorted(taken), images
    gallery = ROOT / "docs" / "gallery"
    missing = [
        i
        for i in images
        if (ROOT / "docs" / i).resolve().parent != gallery or not (ROOT / "docs" / i).is_file()
    ]
    assert missing == [], f"gallery images not in docs/gallery/: {missing}"
