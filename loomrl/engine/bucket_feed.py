"""A version's buckets handed to an engine's update one at a time, from another thread: the colocated route's engine
side (weights/bucket.py). The update consumes the feed as any iterable of buckets; `put` returns once the update has
finished with the bucket it gave (asked for the next, or ended), so that the trainer may overwrite its buffer.

Every wait is bounded by `timeout_s`: an update whose trainer vanished mid-version ends with TimeoutError (the engine's
reload is then finished on the old tensors and the engine refuses requests until a whole update loads); a trainer whose
engine stopped reading gets the engine's error, or TimeoutError.
"""

from __future__ import annotations

import threading
from typing import Any


class BucketFeed:
    """Producer: `put` each bucket, then `end` (or `end(failed=...)`); consumer: iterate. `stopped` tells the producer
    that the consumer will read no more (its update ended, with `why` when it failed)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._item: Any = None
        self._has = False  # an item waits for the consumer
        self._put = 0  # items put
        self._taken = 0  # items the consumer has taken
        self._done = 0  # items the consumer has finished with: those taken before its latest call for the next
        self._ended = False
        self._failed = ""  # the producer ended it because it failed
        self._stopped: str | None = None  # the consumer stopped reading (why; "" for a clean end)

    def __iter__(self) -> BucketFeed:
        return self

    def __next__(self) -> Any:
        with self._cond:
            self._done = self._taken  # what it took before this call is finished with (not what was put since)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._has or self._ended, self.timeout_s):
                raise TimeoutError(f"weight sync: no bucket came from the trainer within {self.timeout_s:.0f} s")
            if self._has:
                self._has = False
                self._taken += 1
                return self._item
            if self._failed:
                raise RuntimeError(f"weight sync: the trainer stopped sending the version: {self._failed}")
            raise StopIteration

    def put(self, item: Any) -> None:
        """Hand `item` over; returns once the consumer has finished with it."""
        with self._cond:
            if self._ended:
                raise RuntimeError("weight sync: a bucket after the version's end")
            self._check_stopped()
            self._item, self._has = item, True
            self._put += 1
            n = self._put
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: self._done >= n or self._stopped is not None, self.timeout_s)
            if self._done >= n:
                return
            if not done:
                raise TimeoutError(f"weight sync: the engine did not load bucket {n} within {self.timeout_s:.0f} s")
            self._check_stopped()

    def end(self, failed: str = "") -> None:
        """No more buckets: the version is complete, or (`failed`: why) abandoned, which fails the update."""
        with self._cond:
            self._ended, self._failed = True, failed
            self._cond.notify_all()

    def stop(self, why: str = "") -> None:
        """The consumer reads no more (`why`: its error, if it failed)."""
        with self._cond:
            self._stopped = why
            self._cond.notify_all()

    def _check_stopped(self) -> None:
        if self._stopped is not None:
            raise RuntimeError(f"weight sync: the engine stopped reading the version's buckets: "
                               f"{self._stopped or 'it ended'}")
