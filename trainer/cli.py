"""What every command-line tool shares: the parser, the version, the one-line errors.

A tool builds its parser with `tool_parser`, checks its inputs with `existing_dir` /
`existing_file` (argparse `type=` callables, so the message names the flag), raises
`ToolError` for what it finds wrong later, and runs through `run_tool`. The user then sees
one line, `<tool>: error: <what and what to do>`, and the exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

EXIT_USAGE = 2


def version() -> str:
    """The installed distribution's version, or the checkout's when it is run uninstalled."""
    from trainer import __version__

    return f"flowgrpo-trainer {__version__}"


class ToolError(Exception):
    """Bad input found by a tool; `run_tool` prints it on one line and exits 2."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring keeps its layout; a flag's help ends with its default when it has
    one (not for required flags, switches, or an unset default, which the help text explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text
                or isinstance(action, (argparse._VersionAction, argparse._HelpAction))):
            return text
        return f"{text} (default: %(default)s)"


class ToolParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # one line instead of argparse's usage block: the flag and the fix are in the message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def tool_parser(prog: str, description: str | None) -> ToolParser:
    """A parser with the shared help layout and --version. `prog` is the tool's script name."""
    p = ToolParser(prog=prog, description=description, formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=version())
    return p


def existing_dir(value: str) -> str:
    """argparse type: a directory that exists (argparse prefixes the flag to the message)."""
    if not Path(value).is_dir():
        what = "is a file, not a directory" if Path(value).exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{value} {what}")
    return value


def existing_path(value: str) -> str:
    """argparse type: a file or a directory that exists."""
    if not Path(value).exists():
        raise argparse.ArgumentTypeError(f"{value} does not exist")
    return value


def existing_file(value: str) -> str:
    """argparse type: a file that exists."""
    if not Path(value).is_file():
        what = "is a directory, not a file" if Path(value).is_dir() else "does not exist"
        raise argparse.ArgumentTypeError(f"{value} {what}")
    return value


def run_tool(prog: str, main: Callable[[], int], user_errors: Sequence[type[BaseException]] = ()) -> int:
    """main() with ToolError (and the tool's own input-error types) as a one-line error, exit 2."""
    try:
        return main()
    except (ToolError, *user_errors) as e:
        # a multi-problem message keeps one problem per "; "-separated part
        text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        print(f"{prog}: error: {text}", file=sys.stderr)
        return EXIT_USAGE
