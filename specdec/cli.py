"""Command line: specdec generate | serve | models | bench | eval | check-lossless | kld | profile-drafts | drafts.

Human-readable lines go to stderr; with --json, stdout holds only JSON Lines. Every user mistake
exits non-zero with a one-line error, never a traceback. Each subcommand registers its own parser
(specdec/commands/, and the eval, check-lossless and profile-drafts commands in quality/ and bench/);
this module builds the top parser and dispatches.
"""
from __future__ import annotations

import argparse
import sys

from specdec.bench import kld, profile_drafts
from specdec.commands import bench, drafts, generate, models, serve
from specdec.quality import eval as quality_eval
from specdec.quality import lossless

SUBCOMMANDS = (generate, serve, models, bench, quality_eval, lossless, kld, profile_drafts, drafts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for command in SUBCOMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # ModelFileError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
