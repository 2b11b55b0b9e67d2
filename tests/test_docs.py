"""The README stays a short front page, and no link in it or in docs/ leads nowhere.

A relative link (or image) must name a file that exists; a `#fragment` must name a heading
of that file, made into an anchor as GitHub does (lower case, punctuation other than `-`
and `_` dropped, spaces to `-`). Links inside fenced code blocks are not links.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def prose(path: Path) -> str:
    return FENCE.sub("", path.read_text())


def anchors(path: Path) -> set[str]:
    found = set()
    for line in prose(path).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            text = heading.group(1).strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text)))
    return found


def relative_links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < 350, f"README.md has {lines} lines; move detail to a docs/ page"


def test_readme_keeps_the_two_setup_commands_and_ci_runs_the_same_tests():
    text = README.read_text()
    install = ('python3 -m pip install torch==2.13.0 numpy && python3 -m pip install -e '
               '".[tensorboard]" && fivefold train && fivefold generate --checkpoint '
               'runs/default/checkpoints --prompt "ROMEO:"')
    tests = ('python3 -m pip install torch==2.13.0 numpy && python3 -m pip install -e '
             '".[test]" && python3 -m pytest')
    assert f"```bash\n{install}\n```" in text
    assert f"```bash\n{tests}\n```" in text
    ci = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#")]
    assert ci[-2:] == ["python3 -m pytest", "python3 -m pytest -m docs"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT)})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_check_sees_links():
    """The check above could pass by finding nothing: the README links every docs page."""
    linked = {Path(t.partition("#")[0]).name for t in relative_links(README)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert len(linked) >= 10
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
