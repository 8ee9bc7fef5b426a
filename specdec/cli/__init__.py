"""The `specdec` command line. Each subcommand lives in its own module of this package and
defines `register(subparsers)`; main() catches user errors and prints one line, never a traceback.

    specdec generate smollm2-135m --prompt "Hello" --speculative-method ngram
    specdec chat smollm2-135m
    specdec info smollm2-135m
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings

from specdec.config import ConfigError

# what a user can fix: one line, exit 2 (OSError: a missing, unwritable or full path, a name too long)
USER_ERRORS = (ConfigError, ValueError, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if not mod.startswith("_"):
            importlib.import_module(f"{__name__}.{mod}").register(sub)
    return parser


def _one_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"specdec: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line  # one line each; catch_warnings restores the default
            return int(args.func(args) or 0)
    except USER_ERRORS as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
