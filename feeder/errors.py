"""Exceptions raised to consumers of a feed, and the envelope that carries them across threads.

Everything the library raises derives from :class:`FeederError`, except the
``StopIteration`` that ends a finite source (so ``for batch in feed`` ends).
"""
from __future__ import annotations

import copy
from typing import Optional


class FeederError(Exception):
    """Base class of every error raised by ``feeder``."""


class FeedStopped(FeederError):
    """The coordinator owning this feed has been stopped; the feed is no longer usable."""


class FeedTimeout(FeederError, TimeoutError):
    """No batch arrived within the timeout. The message diagnoses what the source was doing."""


class FetchError(FeederError):
    """A ``fetch_fun`` raised. ``__cause__`` is the original exception, traceback intact."""


class InputValidationError(FeederError, ValueError):
    """A chunk did not match the declared inputs or the session's input signature.

    The message names the source, worker id, input, what was expected and what came.
    """


class Failure:
    """A failure recorded in one thread and re-raised, possibly many times, in consumers.

    Each ``raise_()`` raises a fresh copy of the template so that repeated raises from
    different threads do not pile tracebacks onto one shared exception object, while the
    original exception (``cause``) keeps its own traceback and becomes ``__cause__``.
    """

    __slots__ = ("template", "cause")

    def __init__(self, template: BaseException, cause: Optional[BaseException] = None):
        self.template = template
        self.cause = cause

    def make(self) -> BaseException:
        try:
            err = copy.copy(self.template)
        except Exception:  # an exotic subclass that cannot be copied: raise the template itself
            err = self.template
        err.__traceback__ = None
        return err

    def raise_(self) -> None:
        err = self.make()
        if self.cause is not None:
            raise err from self.cause
        raise err

    def __repr__(self) -> str:
        return f"Failure({self.template!r}, cause={self.cause!r})"


class RemoteError(FeederError):
    """An exception raised in a worker process that could not be pickled back to the parent.

    Its message holds the original exception's type name, message and the child's traceback.
    """


def exception_text(e: BaseException) -> str:
    """``str(e)``, or a stand-in when the exception's own ``__str__`` raises: a message about a
    user's exception must never fail in its turn (and hide the exception it is about)."""
    try:
        return str(e)
    except Exception:
        return f"<{type(e).__name__}: str() failed>"
