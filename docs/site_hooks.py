"""mkdocs hooks (mkdocs.yml `hooks:`): the site is the repository's own Markdown, unchanged.

The guides are written to be read on a code host, with links relative to where each file sits in
the repository: README.md links `docs/scale.md`, docs/examples/*.md link `../../examples/*.py`. The
site's pages live under docs/, so this hook
- makes README.md the home page (index.md),
- publishes every file outside docs/ that a page links to, under `repo/<its path>` (a Markdown file
  as a page, whose own links are followed the same way; a folder as a page listing its files),
- rewrites each relative link to where its target landed on the site, so `mkdocs build --strict`
  checks every link of every page against the files it names,
- drops the `notest` word of a ```python notest fence (tests/docs/test_docs.py's marker, not a language).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
DOCS = "docs/"
PUBLISHED = "repo/"  # where files from outside docs/ land on the site
LINK = re.compile(r"(?<=\]\()(?P<target>[^)\s#]+)(?P<rest>#[^)\s]*)?(?=\))")
NOTEST = re.compile(r"^(?P<fence>[ \t]*```python)[ \t]+notest[ \t]*$", re.MULTILINE)
NOT_IN_NAV = InclusionLevel.NOT_IN_NAV  # reached by links, not listed in the navigation
IN_NAV = {"README.md", "bench/RESULTS.md"}  # mkdocs.yml lists these
SKIP = ("http://", "https://", "mailto:", "/")

# the page's site path (src_uri) -> its path in the repository, for the pages not under docs/
_repo_path: dict[str, str] = {}


def site_path(repo_path: str, is_dir: bool) -> str:
    """Where a repository file (or folder: its listing page) is on the site, as a src_uri."""
    if repo_path == "README.md":
        return "index.md"
    if repo_path.startswith(DOCS):
        return repo_path[len(DOCS) :]
    return PUBLISHED + repo_path.rstrip("/") + ("/index.md" if is_dir else "")


def resolve(page_repo_path: str, target: str) -> str | None:
    """The repository path a relative link of the page at `page_repo_path` points to, or None."""
    if target.startswith(SKIP) or ":" in target.split("/")[0]:
        return None
    return posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), target))


def _links(path: Path) -> list[str]:
    return [m.group("target") for m in LINK.finditer(path.read_text(encoding="utf-8"))]


def _listing(repo_dir: str) -> str:
    names = sorted(
        p.name for p in (ROOT / repo_dir).iterdir() if p.is_file() and not p.name.startswith((".", "_"))
    )
    lines = [f"# {repo_dir.rstrip('/')}/", "", "The files of this folder of the repository:", ""]
    return "\n".join(lines + [f"- [{n}]({n})" for n in names]) + "\n"


def on_files(files: Files, config) -> Files:
    """Add the home page and every file outside docs/ that a page links to (transitively)."""
    _repo_path.clear()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    seen: set[str] = set()
    while pages:
        page = pages.pop()
        page_repo = page.relative_to(ROOT).as_posix()
        for target in _links(page):
            repo = resolve(page_repo, target)
            if repo is None or repo.startswith(DOCS) or repo in seen or not (ROOT / repo).exists():
                continue  # a missing target stays as written: the strict build reports it
            seen.add(repo)
            if (ROOT / repo).is_dir():
                src_uri = site_path(repo, is_dir=True)
                files.append(File.generated(config, src_uri, content=_listing(repo), inclusion=NOT_IN_NAV))
                _repo_path[src_uri] = repo.rstrip("/") + "/index.md"
                for child in sorted((ROOT / repo).iterdir()):
                    if child.is_file() and not child.name.startswith((".", "_")):
                        _add(files, config, child.relative_to(ROOT).as_posix(), seen)
                        if child.suffix == ".md":
                            pages.append(child)
                continue
            _add(files, config, repo, seen)
            if repo.endswith(".md"):
                pages.append(ROOT / repo)
    _add(files, config, "README.md", seen)
    return files


def _add(files: Files, config, repo: str, seen: set[str]) -> None:
    seen.add(repo)
    src_uri = site_path(repo, is_dir=False)
    if files.get_file_from_path(src_uri) is None:
        inclusion = InclusionLevel.UNDEFINED if repo in IN_NAV else NOT_IN_NAV
        files.append(File.generated(config, src_uri, abs_src_path=str(ROOT / repo), inclusion=inclusion))
        _repo_path[src_uri] = repo


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Point each relative link at its target's place on the site; drop `notest` from fences."""
    src_uri = page.file.src_uri
    page_repo = _repo_path.get(src_uri, DOCS + src_uri)

    def relink(match: re.Match) -> str:
        target, rest = match.group("target"), match.group("rest") or ""
        repo = resolve(page_repo, target)
        if repo is None or not (ROOT / repo).exists():
            return match.group(0)
        where = site_path(repo, is_dir=(ROOT / repo).is_dir())
        return posixpath.relpath(where, posixpath.dirname(src_uri) or ".") + rest

    return NOTEST.sub(r"\g<fence>", LINK.sub(relink, markdown))
