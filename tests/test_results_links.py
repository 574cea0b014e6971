"""docs/results stays citable: every relative link in a Markdown file (README, docs/, the results' own pages) and
every ``docs/results/…`` path named in a page, in src/ or in tests/ points at something that exists (a link's
``#anchor`` at a heading of its page). A path with a placeholder in capitals (``…/hbN-rcR``, ``load-warm-seedS.json``)
is a pattern, not checked; nor are the recorded commands inside the result files themselves (``command`` in a JSON,
the first line of a load-bench table): they keep the paths of the day they ran."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"docs/results(?:/[\w.*{},-]+)*/?")


def _slug(heading: str) -> str:  # GitHub's anchor for a heading
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _sources() -> list[Path]:
    return sorted(p for top in ("src", "tests") for p in (ROOT / top).rglob("*.py"))


def _written(page: Path) -> bool:
    """A page whose bare docs/results paths are checked: written by hand, not a command's table."""
    return not page.is_relative_to(RESULTS) or page.name == "README.md"


def _expand(path: str) -> list[str]:  # "hb{1,32}-rc0" -> both; a glob stays a glob
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [x for part in m.group(1).split(",") for x in _expand(path[: m.start()] + part + path[m.end():])]


def _exists(path: Path) -> bool:
    if any(c in str(path) for c in "*?["):
        return any(path.parent.glob(path.name)) if path.parent.exists() else False
    return path.exists()


def broken() -> list[str]:
    bad = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: link {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: anchor {target}")
        if _written(page):
            bad += _bare(page, text)
    for source in _sources():
        bad += _bare(source, source.read_text(encoding="utf-8"))
    return bad


def _bare(page: Path, text: str) -> list[str]:
    bad = []
    for m in PATH.finditer(text):
        for path in _expand(m.group(0).rstrip(".,")):
            if re.search(r"[A-Z]", path.replace("README.md", "")):
                continue  # a placeholder: seedS, hbN-rcR
            if not _exists(ROOT / path):
                bad.append(f"{page.relative_to(ROOT)}: path {path}")
    return bad


def test_every_results_link_and_path_resolves():
    assert broken() == []


if __name__ == "__main__":  # python tests/test_results_links.py: the list, one a line
    print("\n".join(broken()) or "0 broken")
