"""(being written)"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommand to the `specdec` CLI."""
