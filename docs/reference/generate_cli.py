"""Writes docs/reference/cli.md from the click commands' own --help.

    .venv/bin/python docs/reference/generate_cli.py           # rewrite cli.md
    .venv/bin/python docs/reference/generate_cli.py --check   # exit 1 when cli.md is stale

The page is the commands' help text and nothing else, so it cannot disagree with the CLI;
tests/test_docs.py runs --check.
"""

import pathlib
import sys

import click

from infmoe_export.cli import COMMANDS, cli

PAGE = pathlib.Path(__file__).with_name("cli.md")
WIDTH = 100  # fixed, so the page does not depend on the terminal that wrote it


def help_text(command: click.Command, name: str, parent: click.Context) -> str:
    # The group's settings (-h beside --help) reach a command through its parent context.
    context = click.Context(command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
    return command.get_help(context)


def page() -> str:
    root = click.Context(cli, info_name="infmoe-export", terminal_width=WIDTH, max_content_width=WIDTH,
                         **cli.context_settings)
    sections = ["# Command-line reference\n",
                "Generated from the commands' `--help` by `.venv/bin/python docs/reference/generate_cli.py`;",
                "do not edit by hand. Every command uses the bundled model when no checkpoint is given.\n",
                "## infmoe-export\n", "```text", cli.get_help(root), "```\n"]
    for name in sorted(COMMANDS):
        command = cli.get_command(root, name)
        sections += [f"## infmoe-export {name}\n", "```text", help_text(command, name, root), "```\n"]
    return "\n".join(sections)


def main(argv) -> int:
    text = page()
    if argv == ["--check"]:
        if PAGE.read_text(encoding="utf-8") != text:
            print("docs/reference/cli.md is stale: run .venv/bin/python docs/reference/generate_cli.py", file=sys.stderr)
            return 1
        return 0
    if argv:
        print("usage: generate_cli.py [--check]", file=sys.stderr)
        return 2
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
