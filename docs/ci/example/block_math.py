"""The example project's own code: block arithmetic of a paged KV cache."""


def get_num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    return -(-num_tokens // block_size)


def get_num_skipped_blocks(num_computed_tokens: int, sliding_window: int,
                           block_size: int) -> int:
    """Whole blocks before the window of the next token (they can be freed)."""
    first_read = max(0, num_computed_tokens - sliding_window + 1)
    return first_read // block_size
