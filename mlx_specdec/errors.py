"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input from the user: a missing model, a corrupt file, an unknown method, ..."""


class ModelNotFound(UserError):
    pass


class UnsupportedModel(UserError):
    pass


class CorruptModel(UserError):
    pass


class ContextOverflow(UserError):
    pass


def run_guarded(func, args) -> int:
    """Run a command: user errors -> one line + exit 1 (a usage error, such as a setting the
    method does not take: 2), Ctrl-C -> 130, closed pipe -> 0."""
    try:
        return func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", 1)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
