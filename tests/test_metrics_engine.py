"""Engine metrics: `engine.metrics_text()` and an exporter on 127.0.0.1, scraped over HTTP, equal
`engine.stats` (API.md names)."""

from __future__ import annotations

import copy
import urllib.request
import warnings

import pytest

import fuser
from tiny import random_prompts, tiny_model

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_exporter_scraped_over_http_equals_stats() -> None:
    target = tiny_model("llama", layers=1, seed=3)
    draft = copy.deepcopy(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
            max_seq_len=40, gamma=2, max_batch_size=2))
    ids, mask = random_prompts(2, [4, 6], target.config.vocab_size, seed=0)
    engine.generate(ids, 11, attention_mask=mask, eos_token_id=[])
    engine.generate(ids[:1], 5, eos_token_id=[])
    stats = engine.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    server = engine.start_metrics_server(0, addr="127.0.0.1")
    try:
        assert server.addr == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            scraped = samples(r.read().decode())
    finally:
        server.shutdown()
    want = {
        ("fuser_spec_decode_num_drafts_total", ()): stats.num_drafts,
        ("fuser_spec_decode_num_draft_tokens_total", ()): stats.num_draft_tokens,
        ("fuser_spec_decode_num_accepted_tokens_total", ()): stats.num_accepted_tokens,
        ("fuser_generation_tokens_total", ()): stats.num_generated_tokens,
        ("fuser_spec_decode_gamma", ()): stats.gamma,
        ("fuser_spec_decode_enabled", ()): 1,
    }
    for i, n in enumerate(stats.accepted_per_position):
        want[("fuser_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))] = n
    for key, value in want.items():
        assert scraped[key] == value, key
    # 2 rows x 11 + 1 x 5 tokens, each observed once in the time-per-output-token histogram.
    assert stats.num_generated_tokens == 27
    assert scraped[("fuser_time_per_output_token_seconds_count", ())] == 27
    stats.reset()
    assert samples(engine.metrics_text())[("fuser_spec_decode_num_drafts_total", ())] == 0
