"""Transient failures of a store told from permanent ones, and retried: :class:`Retry` (how often,
how long), :func:`retrying` (the one retry layer) and :class:`RetryCounts` (per worker)."""
from __future__ import annotations

import logging
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, TypeVar

log = logging.getLogger("feeder")

T = TypeVar("T")


@dataclass(frozen=True)
class Retry:
    """How transient storage failures are retried: up to ``attempts`` more tries, waiting
    ``backoff_s`` seconds before the first, doubled before each next one up to ``max_backoff_s``
    (each wait drawn at random between half and all of it, so that many readers do not retry in
    step), and none that would start more than ``budget_s`` seconds after the first failure (a
    long transfer that fails late is still tried again). The defaults wait about 0.1 + 0.2 + 0.4
    + 0.8 + 1.6 = 3.1 s at most over 5 retries; with requests that hang until their time-out, the
    budget ends the retries."""

    attempts: int = 5
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    budget_s: float = 10.0

    def about_s(self) -> float:
        """The most the waits between tries add up to (seconds)."""
        return float(sum(min(self.max_backoff_s, self.backoff_s * (2.0 ** k)) for k in range(self.attempts)))

    def wait_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first)."""
        full = min(self.max_backoff_s, self.backoff_s * (2.0 ** retry))
        return float(full * random.uniform(0.5, 1.0))


# Messages of transient failures, as pyarrow's AWS, GCS and Azure clients and fsspec drivers word
# them (AWS error names, HTTP statuses, curl's and the OS's words for a broken connection).
_TRANSIENT = re.compile(
    r"HTTP status (5\d\d|429|408)|status code:? (5\d\d|429|408)|\b(500|502|503|504)\b.*(Error|error)|"
    r"SLOW_DOWN|SlowDown|THROTTL|Throttl|TooManyRequests|Too Many Requests|SERVICE_UNAVAILABLE|"
    r"ServiceUnavailable|Service Unavailable|INTERNAL_FAILURE|InternalError|InternalFailure|REQUEST_TIMEOUT|"
    r"RequestTimeout|NETWORK_CONNECTION|timed out|[Tt]imeout|[Cc]onnection (reset|refused|aborted|closed)|"
    r"Broken pipe|Recv failure|Send failure|Couldn't connect|Could not connect|transient|Temporary failure|"
    r"try again|Try again|UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED")
# ... and of permanent ones, which no retry mends (checked first: "403 ... try again" is permanent).
_PERMANENT = re.compile(
    r"ACCESS_DENIED|AccessDenied|Access Denied|HTTP status (400|401|403|404|409|412)|NO_SUCH_|NoSuch|"
    r"RESOURCE_NOT_FOUND|INVALID_|InvalidAccessKeyId|SignatureDoesNotMatch|PERMISSION_DENIED|NOT_FOUND")


def is_transient(e: BaseException) -> bool:
    """Whether a storage failure may go away when tried again: a time-out, throttling (429,
    SlowDown), a 5xx answer, a connection reset or refused. A missing object, access denied or
    bad data are not."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    if not isinstance(e, OSError) and type(e).__module__.split(".")[0] not in ("pyarrow", "botocore", "aiohttp",
                                                                              "requests", "urllib3", "google"):
        return False
    marked = getattr(e, "feeder_transient", None)
    if marked is not None:
        return bool(marked)
    text = str(e)
    if _PERMANENT.search(text):
        return False
    return bool(_TRANSIENT.search(text))


def is_io_failure(e: BaseException) -> bool:
    """Whether a failed read failed in the storage (the object is not there, access was denied,
    the network failed) rather than in the bytes (a damaged file): an OSError with an errno, or
    one a store worded."""
    if isinstance(e, OSError) and (e.errno is not None or isinstance(e, (TimeoutError, ConnectionError))):
        return True
    return is_transient(e) or bool(_PERMANENT.search(str(e))) or "AWS Error" in str(e)


# on_retry(exception, retry number (0 for the first), seconds it waits before trying again)
OnRetry = Callable[[BaseException, int, float], None]


def retrying(fn: Callable[[], T], what: str, policy: Retry, on_retry: Optional[OnRetry] = None,
             stop: Optional[threading.Event] = None, counts: Optional["RetryCounts"] = None,
             worker: Optional[int] = None) -> T:
    """``fn()``, tried again after a transient failure (see :func:`is_transient`) up to
    ``policy.attempts`` times with exponential backoff, none starting later than
    ``policy.budget_s`` seconds after the first failure; each retry reported to ``on_retry`` and
    counted in ``counts`` (for ``worker``), and logged naming ``what``: the first failure that
    ``counts`` sees at WARNING, at once (a store that stopped answering is said before the
    retries run out), the others at DEBUG. The last failure, or a permanent one, is raised as it
    came. A set ``stop`` event ends the waiting (the last failure is raised)."""
    retry = 0
    failed_at: Optional[float] = None
    while True:
        try:
            return fn()
        except Exception as e:
            if retry >= policy.attempts or not is_transient(e):
                raise
            wait = policy.wait_s(retry)
            now = time.monotonic()
            failed_at = now if failed_at is None else failed_at
            if now + wait - failed_at > policy.budget_s:
                raise
            first = counts.retried(worker) if counts is not None else False
            text = " ".join(str(e).split())[:300]
            if first:
                log.warning("feeder: %s failed (%s: %s); retrying up to %d times within %.0f s (further retries "
                            "are logged at DEBUG)", what, type(e).__name__, text, policy.attempts, policy.budget_s)
            else:
                log.debug("feeder: %s failed (%s: %s); retry %d of %d in %.2f s", what, type(e).__name__, text,
                          retry + 1, policy.attempts, wait)
            if on_retry is not None:
                on_retry(e, retry, wait)
            if stop is not None:
                if stop.wait(wait):
                    raise
            else:
                time.sleep(wait)
            retry += 1


class RetryCounts:
    """Retries and failures after retries, per worker id (None: outside any worker, when a source
    is created or started). Thread-safe; pickled empty (counts stay in the process that made them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries: Dict[Optional[int], int] = {}
        self.exhausted: Dict[Optional[int], int] = {}

    def retried(self, worker: Optional[int]) -> bool:
        """Count a retry; True for the first these counts have seen."""
        with self._lock:
            first = not self.retries
            self.retries[worker] = self.retries.get(worker, 0) + 1
            return first

    def gave_up(self, worker: Optional[int]) -> None:
        with self._lock:
            self.exhausted[worker] = self.exhausted.get(worker, 0) + 1

    def total(self, workers: Optional[Iterable[Optional[int]]] = None) -> Tuple[int, int]:
        """(retries, failures left after retries) of these workers (None: all, setup included)."""
        with self._lock:
            if workers is None:
                return sum(self.retries.values()), sum(self.exhausted.values())
            ids = set(workers)
            return (sum(n for w, n in self.retries.items() if w in ids),
                    sum(n for w, n in self.exhausted.items() if w in ids))

    def __getstate__(self) -> Dict[str, Any]:
        return {}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
