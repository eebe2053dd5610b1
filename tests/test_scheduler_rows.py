"""Many rows in the continuous-batching scheduler: an engine of 256 rows (issue #45's largest
bucket) serves 256 concurrent requests, each exactly as it runs alone (fp32 on the CPU), and
leaves every slot free. Nothing in the scheduler or its engine caps the rows below 256."""

from __future__ import annotations

import warnings

import pytest
import torch

import fuser
from fuser import SamplingParams, Scheduler
from engines import llama_target

ROWS = 256
TIMEOUT = 300.0


@pytest.mark.usefixtures("one_intra_op_thread")
def test_256_rows_serve_256_concurrent_requests() -> None:
    config = fuser.FuserConfig(max_seq_len=24, max_batch_size=ROWS, batch_buckets=(1, ROWS),
                               gamma=0, compile="fx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(llama_target(), config=config)
    assert max(engine.buckets) == ROWS
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 160, (ROWS, 6), generator=g).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    probe = [0, 1, 128, ROWS - 1]
    alone = {i: engine.generate(torch.tensor([prompts[i]]), 4, eos_token_id=[])[0, 6:].tolist()
             for i in probe}
    scheduler = Scheduler(engine, max_waiting=ROWS)
    try:
        streams = [scheduler.submit(p, params) for p in prompts]  # all queued, then started
        scheduler.start()
        outputs = [s.result(TIMEOUT) for s in streams]
        assert scheduler.wait_idle(TIMEOUT)
        assert scheduler.slots_used == 0 and scheduler.num_waiting == 0
        # all 256 rows at once: one admission (the prefill gives each its first token; a step
        # that carries prompt chunks may count as one more), then 3 steps of every row. A cap
        # below 256 rows runs the requests in two waves: at least 6 steps.
        assert scheduler.steps <= params.max_tokens
    finally:
        scheduler.close()
    assert all(len(out) == 4 for out in outputs)
    assert {i: outputs[i] for i in probe} == alone
