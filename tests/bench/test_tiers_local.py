"""bench.cluster.tiers_local's copy-heavy load: the trace it writes is one pdserve bench reads, each request a chat
whose reply can copy from its prompt, varied so the replies differ. No cluster (the script itself is a benchmark)."""
from __future__ import annotations

from bench.cluster.tiers_local import copy_prompts, copy_trace
from bench.common import ARTICLE, STORE_PY
from pdserve.loadgen.workload import load_trace, with_tiers
from pdserve.tiers import ServiceTier


def test_the_copy_trace_loads_as_chats_that_quote_their_source(tmp_path):
    prompts = copy_prompts()
    assert len(set(prompts)) == len(prompts) == 11
    path = tmp_path / "copy.jsonl"
    copy_trace(path, n=30)
    requests = load_trace(path, default_output_len=160)
    assert len(requests) == 30 and all(r.messages is not None and r.max_tokens == 160 for r in requests)
    texts = [r.messages[0][1] for r in requests]
    assert texts[:11] == prompts and texts[11:22] == prompts  # in turn, cycled
    assert all(STORE_PY in t or ARTICLE in t for t in texts)
    tiers = [r.service_tier for r in with_tiers(requests, {ServiceTier.PRIORITY: 0.2, ServiceTier.DEFAULT: 0.8}, 0)]
    assert set(tiers) == {"priority", "default"}
