"""vLLM's Mamba "align" mode keeps one state per block: the data oracle's
last-state group holds one state a block, and a full-prompt hit resumes where
a last-state group holds the state its first step reads."""
from kvspec.harness.machine import make_groups
from kvspec.harness.runner import Runner
from kvspec.harness.target import make_config
from kvspec.impl.mutants import MUTANTS
from kvspec.spec.oracle import KVContent
from kvspec.spec.state import (GroupSpec, Observation, PoolView, RequestStatus, RequestView,
                               StepView)

BLOCK = 4
GROUPS = (GroupSpec(BLOCK), GroupSpec(BLOCK, "last_state"))
PROMPT = (1, 2, 3, 4, 5, 6)
#: per group, blocks 0-1 (full attention) and 2-3 (last state): positions 0-3, 4-7
TABLES = ((0, 1), (2, 3))


def _request(num_computed: int, output=()) -> RequestView:
    return RequestView("r", RequestStatus.RUNNING, PROMPT, tuple(output), 4, num_computed,
                       0, 0, 0, TABLES)


def _observation(request: RequestView) -> Observation:
    config = make_config(block_size=BLOCK, num_blocks=4, groups=GROUPS)
    return Observation(config, {"r": request}, (), ("r",),
                       PoolView(ref_cnt=(1, 1, 1, 1), free_queue=(), cached=()))


def _step(start: int, count: int) -> StepView:
    return StepView({"r": count}, {"r": start}, {}, (), (), frozenset())


def _loaded_prompt() -> tuple[KVContent, list[int]]:
    """The oracle after an async load of the whole prompt into ``TABLES``."""
    content = KVContent(4, BLOCK, GROUPS)
    request = _request(0)
    content.add_load(request, TABLES, 0, len(PROMPT), is_async=True)
    report = content.execute(StepView({}, {}, {}, (), (), frozenset()), _observation(request),
                             {"r"}, set(), 0)
    assert report.loaded_ok == {"r"}
    return content, content.book.keys("r", PROMPT)


def test_a_last_state_block_holds_the_state_after_its_last_written_position():
    content, keys = _loaded_prompt()
    # the state after 6 tokens (position 5) is the one state block 3 holds
    assert content.first_invalid(TABLES, keys, 6) is None
    # the state after 5 tokens (position 4) shared block 3 with position 5,
    # which replaced it; full attention alone would read [0, 5) as valid
    assert content.first_invalid(TABLES, keys, 5) == 4
    assert content.first_invalid(TABLES, keys, 5, groups={0}) is None
    # at a block boundary the state read is the last one written into block 2
    assert content.first_invalid(TABLES, keys, 4) is None


def test_a_step_reads_its_state_before_it_writes_the_same_block():
    """Decode mid-block: the step from 6 reads the state after 6 tokens from
    block 3 and writes the state after 7 there; it read valid KV."""
    content, _keys = _loaded_prompt()
    request = _request(6, output=(7,))
    report = content.execute(_step(6, 1), _observation(request), set(), set(), 0)
    assert not report.garbage_readers
    keys = content.book.keys("r", request.all_token_ids)
    assert content.first_invalid(TABLES, keys, 7) is None
    assert content.first_invalid(TABLES, keys, 6) == 5  # replaced by the state after 7


def test_a_resume_mid_block_reads_a_replaced_state():
    """The recompute of the last prompt token from 5 reads position 4, whose
    state position 5's load replaced: a garbage reader."""
    content, _keys = _loaded_prompt()
    report = content.execute(_step(5, 1), _observation(_request(5)), set(), set(), 0)
    assert report.garbage_readers == {"r": 4}


# -- the reference, the mutant and the connector contract -----------------------------

STATE_CONFIG = make_config(block_size=2, num_blocks=13, max_num_batched_tokens=6,
                           max_num_seqs=1, max_model_len=12, async_scheduling=True,
                           groups=make_groups("state", 2, 1))
PROMPT_6 = [1, 2, 3, 4, 5, 10]


def _cached_whole() -> list[dict]:
    """r0 computes a prompt of three whole blocks (it is cached whole); r1
    arrives with the same prompt and hits it."""
    return [{"op": "add", "id": "r0", "prompt": PROMPT_6, "max_tokens": 1},
            {"op": "drain"},
            {"op": "add", "id": "r1", "prompt": PROMPT_6, "max_tokens": 2},
            {"op": "drain"}]


def test_a_prompt_cached_whole_resumes_at_a_whole_block():
    """The reference hits whole blocks below the last token (4 of 6 tokens):
    the step from 4 reads the state after 4 tokens, the last state of block 1."""
    runner = Runner("impl", STATE_CONFIG)
    assert runner.run(_cached_whole()) is None
    assert runner.checker.witnessed["computed_means_valid"] > 0


def test_resuming_a_prompt_cached_whole_mid_block_is_caught():
    """The mutant hits all three blocks and resumes at 5: the step reads the
    state after 5 tokens from block 2, which holds the state after 6."""
    mutant = MUTANTS["mamba_resume_mid_block"]
    found = Runner(f"mutant:{mutant.name}", STATE_CONFIG).run(_cached_whole())
    assert found is not None
    assert {v.invariant for v in found.violations} & mutant.catching_claims, found.violations


def test_with_a_mamba_group_no_hit_covers_the_last_token():
    """The connector contract: NIXL backs a remote prefill off one token for
    Mamba, so an async offer of the whole prompt loads all but its last token."""
    runner = Runner("impl", STATE_CONFIG)
    found = runner.run([{"op": "add", "id": "r0", "prompt": PROMPT_6, "max_tokens": 2,
                         "ext": 6, "async": True}, {"op": "drain"}])
    assert found is None, found.violations
    assert [a for a in runner.env.answer_log if a[2]] == [("r0", 0, 5)]
