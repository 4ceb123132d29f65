"""The KV connector interface the scheduler talks to (scheduler side).

The contract a conforming connector keeps:

- ``get_num_new_matched_tokens(request, num_computed_tokens)`` answers
  ``(n, load_async)`` with ``0 <= n <= request.num_tokens - num_computed_tokens``,
  or ``(None, False)`` for "not known yet, ask again next step";
- ``update_state_after_alloc(request, block_ids, num_external_tokens)`` is told
  which blocks will receive the external tokens;
- ``build_connector_meta(scheduler_output)`` is called once per step;
- ``request_finished(request, block_ids)`` answers ``(delay_free, params)``; with
  ``delay_free`` the scheduler keeps the blocks until the request id comes back
  in ``finished_sending``.
"""
from __future__ import annotations

from typing import Any, Protocol


class ConnectorContractError(ValueError):
    """The connector answered outside its contract."""


class KVConnector(Protocol):
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output) -> Any: ...

    def request_finished(self, request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict | None]: ...


class NoConnector:
    """No external KV: nothing matched, nothing sent."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, block_ids):
        return False, None


def check_matched_tokens(request, num_computed_tokens: int, answer: tuple) -> None:
    """Reject an answer outside the connector contract with a clear message."""
    num_external, _ = answer
    if num_external is None:
        return
    room = request.num_tokens - num_computed_tokens
    if not 0 <= num_external <= room:
        raise ConnectorContractError(
            f"connector answered {num_external} external tokens for request "
            f"{request.request_id!r}, which has only {room} uncomputed tokens")
