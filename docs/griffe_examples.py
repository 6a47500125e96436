"""A griffe extension for the API reference (mkdocs.yml): the package's docstrings title
their doctests `Example:`, as tests/test_docs.py requires; griffe's Google-style parser
renders only a section titled `Examples:` as examples (each `>>>` block as code, its
output beside it), and would read `Example:` as a note whose `>>>` lines are Markdown.
So the title is renamed before the docstrings are parsed."""

import re

import griffe

_TITLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSection(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(r"\1Examples:", obj.docstring.value)
