"""The ``tokenloom`` command: parser and dispatch.

Subcommands live in their own modules and add themselves with
``register(subparsers, common)``: ``demo`` (the main job on an embedded corpus),
``run`` (a recipe on your data), ``inspect`` (the first batch, decoded for a
person), ``state`` (a saved loader state, for a person). Each sets
``args.run(args) -> exit code``.

Errors are one line on stderr with exit code 2 (a bad flag, a missing file, a
value a recipe refuses), because a person at a terminal wants the cause, not a
traceback; ``--debug`` lets the exception propagate. Errors raised in a loader
worker arrive with the worker's traceback inside the message; the line keeps
the worker and the error itself.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import demo_cmd, inspect_cmd, run_cmd, state_cmd

EXIT_ERROR = 2


class UsageError(Exception):
    """A command line argparse refused; carries the one line to print."""


class Parser(argparse.ArgumentParser):
    """argparse, but a refused command line raises `UsageError` instead of printing
    the usage block and exiting, so `main` prints one line and returns 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line."""
    text = str(e).strip() or type(e).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Original Traceback" in text and len(lines) > 1:
        # torch's worker wrapper: "Caught X in DataLoader worker process N.", the traceback, then "X: message".
        return f"{lines[-1]} ({lines[0].removeprefix('Caught ').rstrip('.')})"
    if not isinstance(e, (ValueError, OSError, RuntimeError, TypeError)):
        lines[0] = f"{type(e).__name__}: {lines[0]}"
    return lines[0] + (" " + "; ".join(lines[1:]) if len(lines) > 1 else "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = Parser(prog="tokenloom", description="Packed, mixed, exactly resumable token batches for LLM "
                    "training: try the loader on the embedded demo or on your files.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    # Also accepted after the subcommand (tokenloom run ... --debug), where people type it.
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo_cmd, run_cmd, inspect_cmd, state_cmd):
        module.register(sub, common)
    try:
        from tokenloom.index_cmd import register as _register_index
    except ImportError:  # pragma: no cover - added by the manifest work
        _register_index = None
    if _register_index is not None:
        _register_index(sub)

    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except UsageError as e:
        print(e, file=sys.stderr)
        return EXIT_ERROR
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one clear line for people, full traceback with --debug
        if args.debug:
            raise
        print(f"tokenloom: error: {one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
