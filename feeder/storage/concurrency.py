"""Threads shared by the readers of a store: :func:`map_bounded` (requests side by side, results in
order) and :class:`SharedCheck` (one check shared by the callers that wait for it)."""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_bounded(fn: Callable[[T], R], items: Sequence[T], workers: int, name: str) -> List[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` daemon threads named ``name``, results in
    order. The failure of the first item (in order) that failed is raised; every thread has ended
    when this returns. One item, or one worker, runs in the calling thread."""
    n = len(items)
    workers = max(1, min(workers, n))
    if workers == 1:
        return [fn(x) for x in items]
    results: List[Any] = [None] * n
    errors: Dict[int, BaseException] = {}
    lock = threading.Lock()
    nxt = [0]

    def work() -> None:
        while True:
            with lock:
                i = nxt[0]
                if i >= n or errors and min(errors) < i:
                    return  # an earlier item failed: what follows it is not needed
                nxt[0] = i + 1
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # raised in the caller's thread below
                with lock:
                    errors[i] = e

    threads = [threading.Thread(target=work, name=f"{name}-{k}", daemon=True) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.1)  # in slices: Ctrl-C still interrupts the caller
    if errors:
        raise errors[min(errors)]
    return results


class SharedCheck:
    """Checks shared by the callers that each need one begun after they asked (that an object is
    still the version a read got, say): a caller waits for the next check of its key to begin and
    end, at most one runs per key at a time, and every caller that asked while one ran shares the
    next. So N reads of one object that end together cost one request, not N; each waits for
    at most two checks."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._keys: Dict[Any, List[Any]] = {}  # key -> [checks begun, checks ended, one running, last result]

    def check(self, key: Any, fn: Callable[[], T]) -> T:
        """The result of a call of ``fn`` begun after this call began (``fn`` should return its
        failures as values: they are handed to every caller sharing it)."""
        with self._cond:
            st = self._keys.setdefault(key, [0, 0, False, None])
            mine = st[0] + 1  # the first check that begins from now on
            while st[1] < mine:
                if st[2]:
                    self._cond.wait(0.05)
                    continue
                st[0] += 1
                st[2] = True
                self._cond.release()
                try:
                    result = fn()
                finally:
                    self._cond.acquire()
                    st[2] = False
                    self._cond.notify_all()
                st[1] = st[0]
                st[3] = result
            return st[3]  # type: ignore[no-any-return]
