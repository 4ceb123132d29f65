"""A request as the reference scheduler tracks it."""
from __future__ import annotations

from typing import Callable, Hashable

from kvspec.spec.state import STATS_UNSET, RequestStatus

BlockHasher = Callable[[Hashable, tuple[int, ...]], Hashable]


def hash_block(parent: Hashable, tokens: tuple[int, ...]) -> Hashable:
    """Chain hash of one full block: depends on every token before it."""
    return hash((parent, tokens))


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                 eos_token_id: int | None = None, priority: int = 0,
                 arrival_time: float = 0.0, hash_block_size: int = 4) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = STATS_UNSET
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        self.hash_block_size = hash_block_size
        self.block_hashes: list[Hashable] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        size = self.hash_block_size
        while (len(self.block_hashes) + 1) * size <= len(self.all_token_ids):
            start = len(self.block_hashes) * size
            parent = self.block_hashes[-1] if self.block_hashes else 0
            block = tuple(self.all_token_ids[start:start + size])
            self.block_hashes.append(hash_block(parent, block))

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
