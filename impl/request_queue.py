"""The waiting queue, ordered by the scheduling policy."""
from __future__ import annotations

import bisect
from typing import Iterable

from kvspec.impl.request import Request


class RequestQueue:
    """FCFS keeps insertion order; PRIORITY orders by (priority, arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._items: list[Request] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def _key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)

    def add(self, request: Request) -> None:
        if self.policy == "priority":
            keys = [self._key(r) for r in self._items]
            self._items.insert(bisect.bisect_right(keys, self._key(request)), request)
        else:
            self._items.append(request)

    def prepend(self, request: Request) -> None:
        if self.policy == "priority":
            keys = [self._key(r) for r in self._items]
            self._items.insert(bisect.bisect_left(keys, self._key(request)), request)
        else:
            self._items.insert(0, request)

    def prepend_all(self, requests: Iterable[Request]) -> None:
        for request in reversed(list(requests)):
            self.prepend(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        self._items.remove(request)
