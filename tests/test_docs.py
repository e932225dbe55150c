"""Every ```python block in README.md and docs/**/*.md runs, as written, on this machine (CPU, no
network), on the bundled model or the tiny models the blocks make themselves.

The convention, for whoever writes docs:
- A page's ```python blocks run top to bottom in one namespace, as a reader would run them going
  down the page, in a fresh temporary working directory (relative paths such as "prof/" land
  there). A block may use what an earlier block on the same page defined; nothing else is given.
- A block that cannot run offline on CPU (a GPU, credentials, a hub model) is fenced
  ```python notest  and says why in a comment inside the block. It is skipped.
- A failure names the page and the line: tracebacks point into the Markdown file itself.
"""

from __future__ import annotations

import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python(?P<info>[^\n`]*)$")
CLOSE = re.compile(r"^[ \t]*```[ \t]*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the first line of code (just after the opening fence)
    code: str
    notest: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, dedented (blocks may sit inside list items)."""
    lines = path.read_text(encoding="utf-8").split("\n")
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
                raise AssertionError(f"{path}:{i + 1}: a ```python block that is never closed "
                                     f"before line {end + 1}")
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path}:{i + 1}: a ```python block that is never closed")
        code = textwrap.dedent("\n".join(lines[start:end]))
        blocks.append(Block(path, start + 1, code, "notest" in opening.group("info").split()))
        i = end + 1
    return blocks


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def run_page(blocks: list[Block]) -> None:
    """Run the page's blocks in order in one namespace; the first failure is reported with the
    page, the block's line and a traceback whose lines are the Markdown file's."""
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks:
        if block.notest:
            assert "#" in block.code, f"{block.where}: a `python notest` block must say why in a comment"
            continue
        # pad with blank lines so that line numbers in tracebacks are the Markdown file's own
        source = "\n" * (block.line - 1) + block.code
        try:
            exec(compile(source, str(block.path), "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 - any failure of a block is the test's failure
            trace = "".join(traceback.format_exception(e)[-12:])
            pytest.fail(f"the ```python block at {block.where} failed: {type(e).__name__}: {e}\n{trace}",
                        pytrace=False)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    blocks = python_blocks(path)
    if not any(not b.notest for b in blocks):
        pytest.skip(f"{path.name} has no runnable python block")
    monkeypatch.chdir(tmp_path)
    run_page(blocks)


def test_the_readme_blocks_are_found():
    """The runner sees the README's examples (a runner that finds nothing would pass everything)."""
    blocks = python_blocks(ROOT / "README.md")
    assert len([b for b in blocks if not b.notest]) >= 3
    assert all(b.code.strip() for b in blocks)


def test_a_failing_block_is_named_by_file_and_line(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```python\nx = 1\n```\n\ntext\n\n  ```python\n  y = x + 1\n  z = undefined\n"
                    "  ```\n\n```python notest\n# needs a GPU\nimport cuda_only\n```\n")
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
