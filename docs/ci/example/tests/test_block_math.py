import pytest

from block_math import get_num_blocks, get_num_skipped_blocks


@pytest.mark.parametrize("tokens,blocks", [(0, 0), (1, 1), (16, 1), (17, 2)])
def test_get_num_blocks(tokens, blocks):
    assert get_num_blocks(tokens, 16) == blocks


def test_window_skips_whole_blocks_only():
    # the token at 47 reads 16..47 with a window of 32: block 0 is out of it
    assert get_num_skipped_blocks(47, 32, 16) == 1
    assert get_num_skipped_blocks(46, 32, 16) == 0


def test_bad_block_size():
    with pytest.raises(ValueError):
        get_num_blocks(3, 0)
