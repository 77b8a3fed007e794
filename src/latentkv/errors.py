"""Errors the user can fix, shared by the command line, the server and the engine process.

A `UserError` is printed as one line without a traceback (`latentkv CMD: error: ...`, exit 2)
or, in the server, reported as the reason loading failed. `ValueError`s raised while checking
what the user asked for (a flag, a request, a model folder) are shown the same way; anything
else is a bug and keeps its type in the message.
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


def user_message(exc: BaseException) -> str:
    """The line to show for `exc`: its text when the user can fix it, else 'Type: text'."""
    if isinstance(exc, (UserError, ValueError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class Unavailable(RuntimeError):
    """A part the engine needs is gone for now (a cluster rank that stopped answering): requests
    in flight fail with this message, and the server answers 503 until it is back."""
