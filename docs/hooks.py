"""MkDocs hooks: the CLI reference from jmoe's argparse parser, and a check that the generated
results tables match bench/results/<benchmark>/*.json."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))
sys.path.insert(0, str(DOCS))

import gen_cli  # noqa: E402
import gen_tables  # noqa: E402

CLI_MARKER = "<!-- cli-reference -->"


def on_pre_build(config, **kwargs):
    stale = gen_tables.stale()
    if stale:
        names = ", ".join(str(p.relative_to(gen_tables.ROOT)) for p in stale)
        raise PluginError(f"results tables out of date in {names}: run python docs/gen_tables.py")


def on_page_markdown(markdown, page, config, files, **kwargs):
    if CLI_MARKER in markdown:
        return markdown.replace(CLI_MARKER, gen_cli.markdown())
    return markdown
