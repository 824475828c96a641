"""The CLI reference as markdown, read from the `jmoe` command's own argparse parser (jmoe/cli.py).

The docs site's hook (docs/hooks.py) puts it into docs/cli.md at build time; run this file to
print it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def option_row(action: argparse.Action) -> list[str]:
    if action.option_strings:
        name = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or (action.dest.upper() if not action.choices else "{" + ",".join(map(str, action.choices)) + "}")
            name += f" `{metavar}`"
    else:
        name = f"`{action.metavar or action.dest}`"
    help_text = (action.help or "") % vars(action) if action.help and "%(" in action.help else (action.help or "")
    if action.choices and action.option_strings and action.nargs != 0:
        help_text = (help_text + "; " if help_text else "") + "one of " + ", ".join(f"`{c}`" for c in action.choices)
    default = action.default
    shown = "" if default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    if isinstance(action, argparse._AppendAction):
        help_text += " (repeatable)" if "repeatable" not in help_text else ""
    return [name, escape(help_text), shown]


def markdown() -> str:
    from jmoe.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = []
    for name, cmd in sub.choices.items():
        cmd.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
        out.append(f"## jmoe {name}\n")
        if helps.get(name):
            out.append(helps[name][0].upper() + helps[name][1:] + ".\n")
        out.append("```text\n" + cmd.format_usage().strip() + "\n```\n")
        rows = [option_row(a) for a in cmd._actions if not isinstance(a, argparse._HelpAction)]
        out.append("| argument | meaning | default |\n| --- | --- | --- |")
        out.extend("| " + " | ".join(r) + " |" for r in rows)
        out.append("")
    # The launcher builds its parser inside main(): its own --help, run at build time.
    launch = subprocess.run([sys.executable, "-m", "jmoe.launch", "--help"], capture_output=True, text=True,
                            env=dict(os.environ, COLUMNS="100"), check=True)
    out.append("## python -m jmoe.launch\n")
    out.append("Runs a command as several local processes of one jax.distributed job "
               "(see [Scale-out](scale-out.md)).\n")
    out.append("```text\n" + launch.stdout.strip() + "\n```\n")
    return "\n".join(out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(markdown())
