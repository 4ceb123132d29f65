# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Spec-decode padding of a newly admitted request must survive the
long-prefill cap, or not be applied.

A waiting request with one token left to compute (here: its whole prompt but
the last token is a prefix-cache hit) is padded to ``1 + num_spec_tokens``
rows with placeholder drafts. ``long_prefill_token_threshold`` is applied after
the padding; when it is smaller than the padded width it cuts the rows but
leaves the request marked as padded, and ``schedule()`` fails
``assert num_new_tokens == 1 + self.num_spec_tokens``.
"""

import traceback

import pytest

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from .utils import create_requests, create_scheduler

pytestmark = pytest.mark.cpu_test

NUM_SPEC = 3
# Below the padded width 1 + NUM_SPEC, as in a deployment that caps prefill
# chunks very tightly.
THRESHOLD = 2


def _model_output(scheduler, output: SchedulerOutput, token: int = 100) -> None:
    req_ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[token] for _ in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        ),
    )


def _schedule(scheduler) -> SchedulerOutput:
    """One schedule(); a crash inside it fails the test with the assert that
    fired."""
    try:
        return scheduler.schedule()
    except AssertionError as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        crash = f"{frame.name}: `{frame.line}`"
    pytest.fail(
        f"schedule() raised AssertionError in {crash} admitting a request with "
        f"one token left, num_speculative_tokens={NUM_SPEC}, "
        f"long_prefill_token_threshold={THRESHOLD}"
    )


@pytest.mark.parametrize("beside", ["running_decode", "waiting_request"])
def test_spec_decode_padding_respects_long_prefill_threshold(beside: str):
    scheduler = create_scheduler(
        num_speculative_tokens=NUM_SPEC,
        long_prefill_token_threshold=THRESHOLD,
        enable_prefix_caching=True,
        block_size=16,
    )
    # Two identical 33-token prompts: r1 caches 2 full blocks, so r2 starts
    # with 32 computed tokens and one left.
    r1, r2 = create_requests(
        num_requests=2, num_tokens=33, same_prompt=True, max_tokens=16
    )
    # r1 alone: the cap does not apply to a single request, so it prefills at
    # once and caches its blocks.
    scheduler.add_request(r1)
    out = _schedule(scheduler)
    assert out.num_scheduled_tokens[r1.request_id] == 33
    _model_output(scheduler, out)

    if beside == "running_decode":
        # r1 keeps decoding, with real drafts, in the step that admits r2.
        scheduler.update_draft_token_ids(
            DraftTokenIds([r1.request_id], [list(range(1, NUM_SPEC + 1))])
        )
        scheduler.add_request(r2)
    else:
        # r1 is gone; r2 is admitted with another request waiting behind it.
        scheduler.finish_requests(r1.request_id, RequestStatus.FINISHED_ABORTED)
        (r3,) = create_requests(num_requests=1, num_tokens=40, req_ids=["r3"])
        scheduler.add_request(r2)
        scheduler.add_request(r3)

    out = _schedule(scheduler)

    # r2 runs its last prompt token; whatever drafts come with it must be
    # backed by scheduled rows: 1 + len(drafts) == its scheduled tokens.
    assert r2.request_id in out.num_scheduled_tokens
    drafts = out.scheduled_spec_decode_tokens.get(r2.request_id, [])
    assert out.num_scheduled_tokens[r2.request_id] == 1 + len(drafts), (
        f"r2 scheduled for {out.num_scheduled_tokens[r2.request_id]} tokens "
        f"with {len(drafts)} placeholder drafts"
    )
