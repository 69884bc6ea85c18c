"""What RPC handlers leave for the step loop (invariant 4: only the loop touches the scheduler).

Handlers append typed items; the loop drains them at the top of each iteration, in arrival order, so
an abort that follows its add in the same iteration still finds the request.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.outputs import FinishReason
from scheduler.request import Request


@dataclass(slots=True, frozen=True)
class AddRequest:
    request: Request


@dataclass(slots=True, frozen=True)
class AbortRequest:
    request_id: str
    finish_reason: FinishReason = FinishReason.ABORT


InboxItem = AddRequest | AbortRequest


class Inbox:
    def __init__(self) -> None:
        self._items: list[InboxItem] = []

    def put(self, item: InboxItem) -> None:
        self._items.append(item)

    def take_all(self) -> list[InboxItem]:
        items, self._items = self._items, []
        return items

    def arriving(self) -> list[Request]:
        """Requests added and not yet handed to the scheduler (admission counts them as waiting)."""
        return [item.request for item in self._items if isinstance(item, AddRequest)]

    def withdraw(self, request_id: str) -> None:
        """Drops a request that never reached the scheduler (its deadline passed in the inbox)."""
        self._items = [item for item in self._items
                       if not (isinstance(item, AddRequest) and item.request.request_id == request_id)]
