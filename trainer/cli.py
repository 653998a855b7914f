"""What every command-line tool shares: the parser, the version, the one-line errors.

A tool builds its parser with `tool_parser`, checks its inputs with `existing_dir` /
`existing_file` (argparse `type=` callables, so the message names the flag), raises
`ToolError` for what it finds wrong later, and runs through `run_tool`. The user then sees
one line, `<script>: error: <what and what to do>`, and the exit status 2, never a traceback.

Exit status, the same for every tool and the trainer: 0 done; 1 a runtime failure (a crash, a
device or a peer that failed mid-run); 2 the input is wrong (usage, a config, a data file, a
path): fix the input and rerun. `<script>` is the console script's name (setup.cfg), whichever
way the tool was started, so a message and the usage line name what the user types.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

EXIT_OK = 0
#: a runtime failure: the input was fine, something failed while running
EXIT_FAILURE = 1
#: the input is wrong (usage, config, data, paths): fixing it is up to the user
EXIT_USAGE = 2

#: tool module -> its console script (setup.cfg [options.entry_points]); a test keeps them equal
CONSOLE_SCRIPTS = {
    "sample": "flowgrpo-sample",
    "score": "flowgrpo-score",
    "export_checkpoint": "flowgrpo-export",
    "evaluate": "flowgrpo-eval",
    "prepare_data": "flowgrpo-prepare-data",
    "curate_data": "flowgrpo-curate-data",
    "inspect_data": "flowgrpo-inspect-data",
    "make_tiny_model": "flowgrpo-make-tiny-model",
    "plot_rewards": "flowgrpo-plot-rewards",
    "reward_server": "flowgrpo-reward-server",
    "bench": "flowgrpo-bench",
}


def script_name(tool: str) -> str:
    """The name a user types for `tool` (a tools/ module name): its console script, or the
    module name for a tool without one (demo helpers)."""
    return CONSOLE_SCRIPTS.get(tool, tool)


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
    """A parser with the shared help layout and --version. `prog` is the tool's module name; the
    usage line and the errors show its console script's name (script_name)."""
    p = ToolParser(prog=script_name(prog), description=description, formatter_class=_HelpFormatter)
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
    """main() with ToolError (and the tool's own input-error types) as a one-line error, exit 2,
    third-party logging quietened first (quiet_third_party)."""
    quiet_third_party()
    try:
        return main()
    except (ToolError, *user_errors) as e:
        # a multi-problem message keeps one problem per "; "-separated part
        text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        print(f"{script_name(prog)}: error: {text}", file=sys.stderr)
        return EXIT_USAGE


def output_file(flag: str, path: str) -> None:
    """ToolError unless `path` can be written as a file: not an existing directory, and its parent
    not an existing file. Checked before any work, so a wrong flag costs nothing."""
    p = Path(path)
    if p.is_dir():
        raise ToolError(f"{flag} {path} is a directory; give a file path (e.g. {p / 'prompts.jsonl'})")
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ToolError(f"{flag} {path}: {parent} is a file, not a directory; choose another path")
            break


def output_dir(flag: str, path: str) -> None:
    """ToolError unless `path` is a directory or can be made one (not a file, nor under one)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ToolError(f"{flag} {path} is a file, not a directory; give a directory (it is created if missing)")
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ToolError(f"{flag} {path}: {parent} is a file, not a directory; choose another path")
            break


#: environment switches the libraries read when they are imported (a user's own value wins)
_QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
              "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def quiet_third_party(load: bool = False) -> None:
    """Keep third-party chatter out of logs: transformers' and diffusers' progress bars ("Loading
    weights", "Loading pipeline components") and info/warning lines, and torchvision's known
    warnings, each of which fills a log file with a frame per redraw or a line per load.
    Called once at the start of the trainer and of every tool. The environment switches cover a
    library imported later; with `load` (the trainer, which imports them anyway), or when a
    library is already imported, its own switches are flipped too. Importing diffusers costs
    ~1 s (it imports torch), so a tool that needs neither does not pay for it. A variable the
    user set (TRANSFORMERS_VERBOSITY=info, ...) is left as it is."""
    import os
    import warnings

    user_set = {k for k in _QUIET_ENV if k in os.environ}
    for k, v in _QUIET_ENV.items():
        os.environ.setdefault(k, v)
    # torchvision's image extension probe and the video-decoding deprecation: both harmless here
    warnings.filterwarnings("ignore", message=r"Failed to load image Python extension", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"Using `torchvision` for video decoding is deprecated")
    warnings.filterwarnings("ignore", message=r".*torchvision.*is deprecated", category=UserWarning,
                            module=r"torchvision(\..*)?")
    for lib, env in (("transformers", "TRANSFORMERS_VERBOSITY"), ("diffusers", "DIFFUSERS_VERBOSITY")):
        if not (load or lib in sys.modules):
            continue
        try:
            logging_mod = __import__(f"{lib}.utils.logging", fromlist=["logging"])
        except ImportError:
            continue
        logging_mod.disable_progress_bar()
        if env not in user_set:
            logging_mod.set_verbosity_error()
