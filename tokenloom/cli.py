"""The ``tokenloom`` command: parser and dispatch.

Subcommands live in their own modules and add themselves with
``register(subparsers, common)``: ``demo`` (the main job on an embedded corpus),
``run`` (a recipe on your data), ``inspect`` (the first batch, decoded for a
person), ``state`` (a saved loader state, for a person), ``tokenize`` (a token cache), ``verify``
(resumes checked on your data). Each sets
``args.run(args) -> exit code``.

Errors are one line on stderr with exit code 2 (a bad flag, a missing file, a
value a recipe refuses), because a person at a terminal wants the cause, not a
traceback; ``--debug`` lets the exception propagate. Errors raised in a loader
worker arrive with the worker's traceback inside the message; the line keeps
the worker and the error itself. Advice worded for Python callers (``pass
text_column=``) is said in flags (``pass --text-column``), see `cli_hints`.

Output into a pipe that closes early (``tokenloom run ... | head``) ends the
command quietly with exit code 141, what a shell reports for a command killed by
SIGPIPE (``git log | head``, ``yes | head``): under ``set -o pipefail`` a script
sees that the output was cut short, and tells it from success (0) and from an
error (2). Python ignores SIGPIPE, so the write raises `BrokenPipeError`; stdout
is then pointed at /dev/null so the interpreter's final flush does not raise again.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import sys
from typing import Optional, Sequence

from . import demo_cmd, index_cmd, inspect_cmd, run_cmd, state_cmd, tokenize_cmd, verify_cmd
from .cli_hints import for_cli

EXIT_ERROR = 2
EXIT_PIPE_CLOSED = 128 + 13  # 128 + SIGPIPE, as a shell reports a command the signal ended
_RST_LITERAL = re.compile(r"``(.+?)``")


class UsageError(Exception):
    """A command line argparse refused; carries the one line to print."""


class Parser(argparse.ArgumentParser):
    """argparse, but a refused command line raises `UsageError` instead of printing
    the usage block and exiting, so `main` prints one line and returns 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")

    def format_help(self) -> str:
        # Descriptions come from module docstrings, written in reStructuredText: ``x`` reads as x.
        return _RST_LITERAL.sub(r"\1", super().format_help())


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


def stdout_closed() -> bool:
    """Whether stdout is a pipe nobody reads any more (so a `BrokenPipeError` was ours
    to write, not a worker's or a socket's)."""
    if not hasattr(select, "poll"):  # pragma: no cover - Windows
        return True
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError):  # replaced by an object without a descriptor: not a pipe we wrote to
        return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = Parser(prog="tokenloom", description="Packed, mixed, exactly resumable token batches for LLM "
                    "training: try the loader on the embedded demo or on your files.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    # Also accepted after the subcommand (tokenloom run ... --debug), where people type it.
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo_cmd, run_cmd, inspect_cmd, state_cmd, index_cmd, tokenize_cmd, verify_cmd):
        module.register(sub, common)

    try:
        args = parser.parse_args(None if argv is None else list(argv))
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what a command may pass on (verify)
    except UsageError as e:
        print(e, file=sys.stderr)
        return EXIT_ERROR
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one clear line for people, full traceback with --debug
        if isinstance(e, BrokenPipeError) and stdout_closed():
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_PIPE_CLOSED
        if args.debug:
            raise
        print(f"tokenloom: error: {for_cli(one_line(e), getattr(args, 'recipe_built', None))}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
