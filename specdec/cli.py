"""Command line: specdec generate | serve | models | cache | bench | eval | check-lossless | kld | profile-drafts | drafts.

Human-readable lines go to stderr; with --json, stdout holds only JSON Lines. Every user mistake
exits 2 with a one-line error, never a traceback or a usage dump. Each subcommand registers its own
parser (specdec/commands/, and the eval, check-lossless and profile-drafts commands in quality/ and
bench/); this module builds the top parser and dispatches.
"""
from __future__ import annotations

import argparse
import sys

from specdec.bench import kld, profile_drafts
from specdec.commands import bench, cache, drafts, generate, models, serve
from specdec.quality import eval as quality_eval
from specdec.quality import lossless

SUBCOMMANDS = (generate, serve, models, cache, bench, quality_eval, lossless, kld, profile_drafts, drafts)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (its own, a bad flag or value) instead of the usage dump.
    Subparsers are made of this class too (add_subparsers takes the parent's class)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def version() -> str:
    """The installed package's version ("unknown" when run from a tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    try:
        return installed("specdec")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specdec", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"specdec {version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.register(sub)
    return parser


def one_line(message: object) -> str:
    """A message on one line (YAML and grammar errors come with caret diagrams)."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(bench.with_default_mode(list(sys.argv[1:] if argv is None else argv)))
    try:
        return args.func(args)
    except ValueError as e:  # ModelFileError, ModelNotPulledError and JSON errors are ValueErrors
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the user named that cannot be read or written
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
