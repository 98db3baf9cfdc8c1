"""Waiting queues: FCFS, and priority with aging.

With aging, a request's effective priority is `priority - rate * (now - arrival)` (lower runs first). Ordering
by it at any instant is ordering by `priority + rate * arrival`, a key that never changes, so one sorted list
serves both: old low-priority requests overtake new high-priority ones after (gap / rate) seconds of waiting.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from tokenmill.request import Request


class RequestQueue:
    def push(self, request: Request) -> None:
        raise NotImplementedError

    def push_front(self, request: Request) -> None:
        """Return a preempted request to where it resumes first (within its priority)."""
        raise NotImplementedError

    def peek(self) -> Request:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    def __init__(self, aging_per_s: float) -> None:
        self.aging_per_s = aging_per_s
        self._items: list[tuple[float, int, Request]] = []
        self._counter = itertools.count()

    def key(self, request: Request) -> float:
        return request.priority + self.aging_per_s * request.times.arrival

    def push(self, request: Request) -> None:
        bisect.insort(self._items, (self.key(request), next(self._counter), request), key=lambda t: t[:2])

    def push_front(self, request: Request) -> None:
        # Among equal keys it goes first; its arrival time keeps its place otherwise.
        bisect.insort_left(self._items, (self.key(request), -next(self._counter), request), key=lambda t: t[:2])

    def peek(self) -> Request:
        return self._items[0][2]

    def pop(self) -> Request:
        return self._items.pop(0)[2]

    def remove(self, request: Request) -> None:
        for i, item in enumerate(self._items):
            if item[2] is request:
                del self._items[i]
                return
        raise ValueError(f"{request.request_id} is not waiting")

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (item[2] for item in self._items)
