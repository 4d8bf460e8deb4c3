"""Placeholder: this command is being built."""

from __future__ import annotations

import argparse

HELP = "(not built yet)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise SystemExit("not built yet")
