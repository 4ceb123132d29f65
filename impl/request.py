"""A request as the reference scheduler tracks it."""
from __future__ import annotations

from typing import Callable, Hashable

from kvspec.spec.state import STATS_UNSET, RequestStatus

BlockHasher = Callable[[Hashable, tuple[int, ...]], Hashable]


def hash_block(parent: Hashable, tokens: tuple[int, ...]) -> Hashable:
    """Chain hash of one full block: depends on every token before it."""
    return hash((parent, tokens))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(request_id, prompt, max_tokens, eos_token_id, priority,
                 hash_block_size) -> None:
    """A request's fields have the types the scheduler computes with (a TypeError
    naming the field otherwise); values (an empty prompt, max_tokens < 1, a prompt
    that does not fit) are the scheduler's to check in ``add_request``."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {request_id!r:.60}")
    if not request_id:
        raise ValueError("request_id must not be empty")
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"request {request_id!r:.40}: prompt_token_ids must be a list of "
                        f"integers, got {prompt!r:.60}")
    # every token exactly an int (a C pass), else looked at one by one
    bad = None if set(map(type, prompt)) <= {int} else \
        next((t for t in prompt if not _is_int(t)), None)
    if bad is not None:
        raise TypeError(f"request {request_id!r:.40}: prompt_token_ids must be integers, "
                        f"got {bad!r:.60}")
    if prompt and min(prompt) < 0:
        raise ValueError(f"request {request_id!r:.40}: prompt_token_ids must be >= 0, "
                         f"got {min(prompt)}")
    for name, value in (("max_tokens", max_tokens), ("priority", priority)):
        if not _is_int(value):
            raise TypeError(f"request {request_id!r:.40}: {name} must be an integer, "
                            f"got {value!r:.60}")
    if eos_token_id is not None and not _is_int(eos_token_id):
        raise TypeError(f"request {request_id!r:.40}: eos_token_id must be an integer or None, "
                        f"got {eos_token_id!r:.60}")
    if not _is_int(hash_block_size) or hash_block_size < 1:
        raise ValueError(f"request {request_id!r:.40}: hash_block_size must be an integer "
                         f">= 1, got {hash_block_size!r:.60}")


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                 eos_token_id: int | None = None, priority: int = 0,
                 arrival_time: float = 0.0, hash_block_size: int = 4) -> None:
        _check_types(request_id, prompt_token_ids, max_tokens, eos_token_id, priority,
                     hash_block_size)
        self.request_id = request_id
        # immutable, as a prompt is: an observer tells it unchanged by identity
        self.prompt_token_ids = tuple(prompt_token_ids)
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
