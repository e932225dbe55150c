"""A griffe extension (mkdocs.yml, mkdocstrings' `extensions:`): the API reference shows, under each
public name, its example from docs/reference/examples.md, as the docstring's "Examples" section.

The examples live in that one Markdown file rather than in the docstrings so that the source stays
short (modules under 400 lines) and each example is a runnable ```python block: tests/docs/test_docs.py
runs every section in a fresh namespace, as a reader copying one would.
A section is `## hookscope.NAME` followed by its blocks; NAME is a name in `hookscope.__all__`.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import griffe

EXAMPLES = Path(__file__).resolve().parent / "reference" / "examples.md"
SECTION = re.compile(r"^## hookscope\.(?P<name>\S+)[ \t]*$", re.MULTILINE)


def sections(text: str) -> dict[str, str]:
    """`{name: its section's Markdown}` of an examples file."""
    heads = list(SECTION.finditer(text))
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return {h.group("name"): text[h.end() : end].strip("\n") for h, end in zip(heads, ends, strict=True)}


class ReferenceExamples(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        if pkg.name != "hookscope":
            return
        for name, example in sections(EXAMPLES.read_text(encoding="utf-8")).items():
            # what `import hookscope` binds: a verb imported over its submodule's name (`hs.capture`
            # from verbs.py, not the `hookscope.capture` module) is the import, not the module
            obj = pkg.modules_collection[pkg.imports[name]] if name in pkg.imports else pkg[name]
            obj = obj.final_target if isinstance(obj, griffe.Alias) else obj
            while isinstance(obj, griffe.Module) and name in obj.members:  # a verb named like its module
                obj = obj[name]
                obj = obj.final_target if isinstance(obj, griffe.Alias) else obj
            section = "Examples:\n" + textwrap.indent(example, "    ")
            if obj.docstring is None:
                obj.docstring = griffe.Docstring(section, parent=obj)
            else:
                obj.docstring.value = obj.docstring.value.rstrip() + "\n\n" + section
