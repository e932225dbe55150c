"""Every ```python block in README.md and docs/**/*.md runs, as written, on this machine (CPU, no
network), on the bundled model or the tiny models the blocks make themselves.

The convention, for whoever writes docs:
- A page's ```python blocks run top to bottom in one namespace, as a reader would run them going
  down the page, in a fresh temporary working directory (relative paths such as "prof/" land
  there). A block may use what an earlier block on the same page defined; nothing else is given.
- A block that cannot run offline on CPU (a GPU, credentials, a hub model) is fenced
  ```python notest  and says why in a comment inside the block. It is skipped.
- A block that needs more than the base install says so on its first line:
  `# needs: pip install 'hookscope[plot]'` (an extra) or `# needs: pip install sae-lens` (a package
  the test gate knows, tests/kit/gate.py). Where it is installed, the block runs. Where an extra is
  missing (the `base` environment of scripts/test-all), the block must fail with a HookscopeError that
  names the extra to install; where a package is missing, the block is skipped, unless HOOKSCOPE_REQUIRE
  requires it (then that is an error).
- A failure names the page and the line: tracebacks point into the Markdown file itself.
- With HOOKSCOPE_DOCS_NEEDING_ONLY=1 only the pages and reference examples with a block that needs
  more than the base install run: scripts/test-all's main environment sets it, because its base
  environment runs every block on the plain install, where a page that needs nothing runs the same
  code; the main environment adds what the base one cannot run (the extras' blocks).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import gate
import pytest

import hookscope
from hookscope.errors import HookscopeError

ROOT = Path(__file__).resolve().parents[2]
# the example under each entry of the API reference: a `## hookscope.NAME` section per public name,
# each run on its own (docs/reference_examples.py puts them into the site's reference)
REFERENCE_EXAMPLES = ROOT / "docs" / "reference" / "examples.md"
SECTION = re.compile(r"^## hookscope\.(?P<name>\S+)[ \t]*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python(?P<info>[^\n`]*)$")
CLOSE = re.compile(r"^[ \t]*```[ \t]*$")
NEEDS = re.compile(r"^# needs: pip install (?P<what>.+)$")
EXTRA = re.compile(r"^'?hookscope\[(?P<extra>[a-z0-9_-]+)\]'?$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the first line of code (just after the opening fence)
    code: str
    notest: bool

    @property
    def needs(self) -> list[str]:
        """What its first line says it needs beyond the base install (`# needs: pip install ...`)."""
        first = self.code.lstrip("\n").split("\n", 1)[0]
        found = NEEDS.match(first)
        return found.group("what").split() if found else []

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, dedented (blocks may sit inside list items)."""
    return blocks_in(path.read_text(encoding="utf-8").split("\n"), path)


def blocks_in(lines: list[str], path: Path, first_line: int = 1) -> list[Block]:
    """The ```python blocks of `lines`, which are `path`'s from line `first_line` on."""
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start = i + 1
        end = start
        while end < len(lines) and not CLOSE.match(lines[end]):
            if FENCE.match(lines[end]):  # an unclosed block would swallow the next one untested
                raise AssertionError(
                    f"{path}:{i + first_line}: a ```python block that is never closed "
                    f"before line {end + first_line}"
                )
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path}:{i + first_line}: a ```python block that is never closed")
        code = textwrap.dedent("\n".join(lines[start:end]))
        blocks.append(Block(path, start + first_line, code, "notest" in opening.group("info").split()))
        i = end + 1
    return blocks


def doc_files() -> list[Path]:
    """The pages whose blocks run top to bottom in one namespace (the reference examples do not)."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != REFERENCE_EXAMPLES)]


def reference_examples(path: Path = REFERENCE_EXAMPLES) -> dict[str, list[Block]]:
    """{NAME: the blocks of its `## hookscope.NAME` section}."""
    lines = path.read_text(encoding="utf-8").split("\n")
    heads = [(i, m.group("name")) for i, line in enumerate(lines) if (m := SECTION.match(line))]
    ends = [i for i, _ in heads[1:]] + [len(lines)]
    return {
        name: blocks_in(lines[start:end], path, start + 1)
        for (start, name), end in zip(heads, ends, strict=True)
    }


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_extra(extra: str) -> bool:
    """Whether a distribution that hookscope's `extra` adds is not installed."""
    requires = importlib.metadata.requires("hookscope") or []
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    names = [re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0] for r in requires if marker.search(r)]
    assert names, f"hookscope has no extra [{extra}]"
    return not all(installed(n) for n in names)


def missing_package(block: Block, distribution: str) -> bool:
    """Whether `distribution` is missing; an error where the gate requires it (HOOKSCOPE_REQUIRE)."""
    by_dist = {need.dist: name for name, need in gate.NEEDS.items() if need.dist}
    assert distribution in by_dist, (
        f"{block.where}: `# needs: pip install {distribution}` names neither a hookscope extra nor a "
        f"package tests/kit/gate.py knows ({sorted(by_dist)})"
    )
    name = by_dist[distribution]
    if installed(distribution) and gate.problem(name) is None:
        return False
    if name in gate.required():
        gate.need(name)  # fails, naming what is wrong
    return True


def run_block(block: Block, namespace: dict, without_extra: str | None = None) -> None:
    """Run one block; a failure is reported with the page, the block's line and a traceback whose
    lines are the Markdown file's. `without_extra`: that extra is missing, so the block must stop on
    a HookscopeError naming it."""
    # pad with blank lines so that line numbers in tracebacks are the Markdown file's own
    source = "\n" * (block.line - 1) + block.code
    hint = f"pip install 'hookscope[{without_extra}]'"
    try:
        exec(compile(source, str(block.path), "exec"), namespace)
    except HookscopeError as e:
        if without_extra is None or hint not in str(e):
            fail(block, e)
        return
    except BaseException as e:  # noqa: BLE001 - any failure of a block is the test's failure
        fail(block, e)
    if without_extra is not None:
        raise AssertionError(f"{block.where} needs [{without_extra}], which is not installed, yet it ran")


def fail(block: Block, e: BaseException) -> None:
    trace = "".join(traceback.format_exception(e)[-12:])
    pytest.fail(
        f"the ```python block at {block.where} failed: {type(e).__name__}: {e}\n{trace}", pytrace=False
    )


def skip_if_run_plain_elsewhere(blocks: list[Block]) -> None:
    """Under HOOKSCOPE_DOCS_NEEDING_ONLY=1 (see the module's docstring), skip blocks that need nothing."""
    if os.environ.get("HOOKSCOPE_DOCS_NEEDING_ONLY") == "1" and not any(b.needs for b in blocks):
        pytest.skip("needs nothing beyond the base install: the base environment runs it")


def run_page(blocks: list[Block]) -> list[str]:
    """Run the page's blocks in order in one namespace, the first failure reported by page and line.
    Returns what was left out for a missing package (see the module's docstring)."""
    namespace: dict = {"__name__": "__docs__"}
    left_out = []
    for block in blocks:
        if block.notest:
            assert "#" in block.code, f"{block.where}: a `python notest` block must say why in a comment"
            continue
        extras = [m.group("extra") for m in map(EXTRA.match, block.needs) if m]
        packages = [n for n in block.needs if not EXTRA.match(n)]
        absent_extras = [e for e in extras if missing_extra(e)]
        absent = [p for p in packages if missing_package(block, p)]
        if absent:
            left_out.append(f"{block.where} (needs {' '.join(absent)})")
        else:
            run_block(block, namespace, without_extra=absent_extras[0] if absent_extras else None)
    return left_out


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.slow
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    blocks = python_blocks(path)
    if not any(not b.notest for b in blocks):
        pytest.skip(f"{path.name} has no runnable python block")
    skip_if_run_plain_elsewhere(blocks)
    monkeypatch.chdir(tmp_path)
    left_out = run_page(blocks)
    if left_out:
        pytest.skip(f"ran the rest; left out for a missing package: {', '.join(left_out)}")


def test_the_readme_blocks_are_found():
    """The runner sees the README's examples (a runner that finds nothing would pass everything)."""
    blocks = python_blocks(ROOT / "README.md")
    assert len([b for b in blocks if not b.notest]) >= 3
    assert all(b.code.strip() for b in blocks)


def test_a_failing_block_is_named_by_file_and_line(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```python\nx = 1\n```\n\ntext\n\n  ```python\n  y = x + 1\n  z = undefined\n"
        "  ```\n\n```python notest\n# needs a GPU\nimport cuda_only\n```\n"
    )
    blocks = python_blocks(page)
    assert [(b.line, b.notest) for b in blocks] == [(4, False), (10, False), (15, True)]
    with pytest.raises(pytest.fail.Exception) as caught:
        run_page(blocks)
    message = str(caught.value)
    assert f"{page}:10 failed: NameError" in message  # the block, by file and line
    assert f'File "{page}", line 11' in message  # and the failing line inside it
    unclosed = tmp_path / "unclosed.md"
    unclosed.write_text("```python notest\n# needs a GPU\nx = 1\n\n```python\ny = 2\n```\n")
    with pytest.raises(AssertionError, match="never closed before line 5"):
        python_blocks(unclosed)
    bare = tmp_path / "bare.md"
    bare.write_text("```python notest\nimport cuda_only\n```\n")
    with pytest.raises(AssertionError, match="must say why"):
        run_page(python_blocks(bare))


def test_a_block_that_needs_an_extra_names_it_when_the_extra_is_missing(tmp_path: Path):
    """Where the extra is missing, the block must stop on a HookscopeError naming it: a deep
    ModuleNotFoundError, an error naming nothing, or a block that runs anyway all fail the page."""
    page = tmp_path / "page.md"
    blocks = [
        "# needs: pip install 'hookscope[datasets]'\nfrom hookscope.errors import StoreError\n"
        "raise StoreError(\"needs datasets: pip install 'hookscope[datasets]'\")",
        "# needs: pip install 'hookscope[datasets]'\nimport no_such_module_deep_inside",
        "# needs: pip install 'hookscope[plot]'\nfrom hookscope.errors import StoreError\n"
        "raise StoreError('no hint')",
        "# needs: pip install 'hookscope[plot]'\nx = 1",
    ]
    page.write_text("".join(f"```python\n{code}\n```\n" for code in blocks))
    named, deep, vague, runs = python_blocks(page)
    assert named.needs == ["'hookscope[datasets]'"]
    run_block(named, {}, without_extra="datasets")  # the error names the extra: what the page wants
    for block, extra in ((deep, "datasets"), (vague, "plot")):
        with pytest.raises(pytest.fail.Exception, match="failed: (ModuleNotFoundError|StoreError)"):
            run_block(block, {}, without_extra=extra)
    with pytest.raises(AssertionError, match="yet it ran"):
        run_block(runs, {}, without_extra="plot")


def test_a_block_that_needs_a_package_names_one_the_gate_knows(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("```python\n# needs: pip install left-pad\nx = 1\n```\n")
    with pytest.raises(
        AssertionError, match="names neither a hookscope extra nor a package tests/kit/gate.py"
    ):
        run_page(python_blocks(page))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One working directory for all reference examples: a store one writes, the next resumes (finds
    it complete) instead of extracting again."""
    return tmp_path_factory.mktemp("reference")


@pytest.mark.parametrize("name", hookscope.__all__)
@pytest.mark.slow
def test_every_public_name_has_a_reference_example_that_runs(
    name: str, reference_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    blocks = reference_examples().get(name, [])
    assert any(not b.notest for b in blocks), (
        f"hookscope.{name} has no runnable example: add a `## hookscope.{name}` section with a ```python "
        f"block to {REFERENCE_EXAMPLES.relative_to(ROOT)}"
    )
    skip_if_run_plain_elsewhere(blocks)
    monkeypatch.chdir(reference_dir)
    left_out = run_page(blocks)  # a fresh namespace: each example stands alone
    if left_out:
        pytest.skip(f"left out for a missing package: {', '.join(left_out)}")


def test_every_reference_example_names_a_public_name():
    stale = sorted(set(reference_examples()) - set(hookscope.__all__))
    assert not stale, f"{REFERENCE_EXAMPLES.relative_to(ROOT)} has sections for names not in __all__: {stale}"


@pytest.mark.parametrize("name", [n for n in hookscope.__all__ if inspect.isfunction(getattr(hookscope, n))])
def test_every_public_function_says_what_it_returns_and_raises(name: str):
    """The reference shows a Returns and a Raises table for each verb: Google-style sections."""
    doc = inspect.getdoc(getattr(hookscope, name)) or ""
    for section in ("Returns:", "Raises:"):
        assert re.search(rf"^{section}\n    \S", doc, re.MULTILINE), (
            f"hookscope.{name}'s docstring has no `{section}` section (an indented entry below it)"
        )


@pytest.mark.parametrize("name", [n for n in hookscope.__all__ if n != "__version__"])
def test_every_public_name_has_a_docstring(name: str):
    doc = inspect.getdoc(getattr(hookscope, name))
    assert doc and not doc.startswith(f"{name}("), f"hookscope.{name} has no docstring of its own"


def test_reference_sections_are_split_by_name_and_keep_their_lines(tmp_path: Path):
    page = tmp_path / "examples.md"
    page.write_text(
        "# Intro\n\n## hookscope.a\n\n```python\nx = 1\n```\n\n## hookscope.b\n\ntext\n\n"
        "```python\ny = x\n```\n"
    )
    sections = reference_examples(page)
    assert [(n, [b.line for b in bs]) for n, bs in sections.items()] == [("a", [6]), ("b", [14])]
    run_page(sections["a"])
    with pytest.raises(pytest.fail.Exception, match=f"{page}:14 failed: NameError"):
        run_page(sections["b"])  # each section in a fresh namespace: b cannot see a's x


def test_under_needing_only_a_page_that_needs_nothing_is_left_to_the_base_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """scripts/test-all's main environment runs only the blocks the base one cannot: a page that needs
    an extra or a package still runs there, and without the setting every page runs."""
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\n# needs: pip install sae-lens\ny = 2\n```\n")
    plain, needing = python_blocks(page)
    monkeypatch.delenv("HOOKSCOPE_DOCS_NEEDING_ONLY", raising=False)
    skip_if_run_plain_elsewhere([plain])
    monkeypatch.setenv("HOOKSCOPE_DOCS_NEEDING_ONLY", "1")
    skip_if_run_plain_elsewhere([plain, needing])
    with pytest.raises(pytest.skip.Exception, match="the base environment runs it"):
        skip_if_run_plain_elsewhere([plain])
