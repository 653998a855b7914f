"""Entry point: `python -m trainer.train --config RECIPE.toml [--flag value ...] [--preflight-only]`.

Normally launched by `bash run.sh train RECIPE` (torchrun, one process per device).
Stages: parse the config, run preflight, then hand over to the training loop.
With --preflight-only it prints the resolved config as JSON followed by
`preflight ok` (exit 0), or the list of violations (exit 2); --quiet leaves out
everything but the violations (the launcher's check: `bash run.sh train` runs it once,
in one process, before torchrun starts the ranks). Config and preflight errors always
exit 2, before any weights load.

Exit status of a run: 0 when it ran its rollouts; 1 when it failed, including a run that
ran rollouts and scored none of them (it trained nothing: the message says so after the
summary); 2 for the config and preflight; 3 when --stop-on-hacking stopped it early.
"""

from __future__ import annotations

import json
import os
import sys

from trainer.config import ConfigError, format_help, load_config, parse_cli, world_size_from_env
from trainer.preflight import PreflightError, validate

EXIT_CONFIG = 2
#: set by run.sh for its check before torchrun starts the ranks (see main)
LAUNCHER_ENV = "FLOWGRPO_LAUNCH_CHECK"


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def die_with_launcher() -> None:
    """Under torchrun: have the kernel SIGKILL this rank when its launcher dies.

    torchrun starts each rank in a session of its own, so a kill -9 of torchrun (or of its
    process group) would otherwise leave the ranks running on, reparented, training and even
    committing checkpoints that nobody asked for. Linux only (prctl PR_SET_PDEATHSIG); a no-op
    elsewhere and outside torchrun.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    # the launcher may have died before the request was in place: then nobody would signal us
    if os.getppid() != parent or parent == 1:
        os._exit(1)


def report_fatal(rank: int | str, text: str) -> None:
    """A rank's fatal error, on its stderr at once and in torchrun's error file for the rank
    (TORCHELASTIC_ERROR_FILE), so the launcher's failure report shows it under "Root Cause" even
    when the ranks' output is redirected (torchrun --redirects / --log-dir) or interleaved with
    the others' shutdown: whichever rank fails first, its message reaches the console."""
    import time

    line = f"[rank {rank}] {text}"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:  # the message is on stderr already
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    die_with_launcher()
    if any(a in ("-h", "--help") for a in argv):
        print(format_help())
        return 0
    if "--version" in argv:
        from trainer.cli import version

        print(version())
        return 0
    preflight_only = "--preflight-only" in argv
    quiet = preflight_only and "--quiet" in argv
    # --quiet means something only to --preflight-only; alone it stays an unknown flag
    argv = [a for a in argv if a != "--preflight-only" and not (quiet and a == "--quiet")]
    rank0 = _is_rank0()
    try:
        cfg = load_config(argv)
        world = world_size_from_env()
    except ConfigError as exc:
        if rank0:
            print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    # A process not started by torchrun runs alone (init_distributed makes a group of one), so
    # the recipe is checked against 1, not against the world it names; --preflight-only
    # checks the recipe on its own world.
    torchrun = world is not None
    if world is None and not preflight_only:
        world = 1
    if preflight_only and rank0 and not quiet:
        from trainer.core.redact import redact_urls

        print(json.dumps(redact_urls(cfg.to_dict()), indent=2))
    try:
        warnings = validate(cfg, world, torchrun=torchrun)
    except PreflightError as exc:
        if rank0:
            print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    if rank0 and not quiet:
        for w in warnings:
            print(f"preflight warning: {w}", file=sys.stderr)
    from trainer.preflight import prepare_compile_cache

    if preflight_only:
        # `bash run.sh train`'s one check before torchrun (LAUNCHER_ENV) also makes the compile
        # cache, so that a directory someone else planted is refused with exit 2 there, where
        # under torchrun a rank's exit 2 would be reported as the launcher's 1; a user's own
        # --preflight-only creates nothing
        if os.environ.get(LAUNCHER_ENV) == "1" and (problem := prepare_compile_cache(cfg)):
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_CONFIG
        if rank0 and not quiet:
            print("preflight ok")
        return 0
    if problem := prepare_compile_cache(cfg):  # before anything can compile; every rank checks
        report_fatal(os.environ.get("RANK", "0"), f"error: {problem}")
        return EXIT_CONFIG
    # The loop is imported only after preflight so a bad config never pays for torch.
    from trainer.loop import run

    recipe, _ = parse_cli(argv)  # load_config parsed it already, so this cannot raise
    return run(cfg, recipe=recipe)


if __name__ == "__main__":
    sys.exit(main())
