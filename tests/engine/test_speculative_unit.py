"""Speculative decoding's pure parts (pdserve.engine.speculative): configuration, prompt lookup, the
acceptance rules (the sampled one checked statistically on a tiny distribution), the adaptive length. No
model, no Ray."""
from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.scheduler_spec import graph_rows, pipelined
from pdserve.engine.scheduler_types import Role
from pdserve.engine.speculative import (
    DraftState,
    SpeculativeConfig,
    accept_greedy,
    accept_sampled,
    free_rows,
    max_speculating_batch,
    propose,
)


def test_config_parses_the_vllm_spelling():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                                '"prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 1, 4)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


@pytest.mark.parametrize("text, words", [
    ('{"method": "draft_model", "model": "/no/such/draft"}', "draft model path '/no/such/draft' does not exist"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs \"model\""),
    ('{"model": "/no/such/draft"}', "does not exist"),  # model without method: a draft model, as in vLLM
    ('{"model": "/models/EAGLE-LLaMA3-Instruct-8B"}', "'eagle' is not supported yet"),
    ('{"method": "ngram", "model": "/models/x"}', "\"model\" is the draft of method \"draft_model\""),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "not supported yet"),
    ('{"method": "telepathy"}', "unknown speculative method"),
    ('{"num_speculative_tokens": 3}', "needs a method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "lookahead": 2}', "unsupported keys"),
    ('[1, 2]', "JSON object"),
    ('{"method": ', "not valid JSON"),
])
def test_config_refuses_with_a_clear_message(text, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.parse(text)


def test_config_parses_draft_model_spellings(tmp_path):
    """vLLM's two spellings of a draft model: method draft_model with model, and model alone; model "ngram" alone is
    prompt lookup."""
    c = SpeculativeConfig.parse(f'{{"method": "draft_model", "model": "{tmp_path}", "num_speculative_tokens": 3}}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", str(tmp_path), 3)
    c = SpeculativeConfig.parse(f'{{"model": "{tmp_path}", "num_speculative_tokens": 2}}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", str(tmp_path), 2)
    c = SpeculativeConfig.parse('{"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert (c.method, c.model, c.prompt_lookup_max) == ("ngram", None, 3)


def test_propose_takes_the_longest_latest_match():
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    # Suffix [1, 2, 3] (n=3) occurred at 0: the tokens after it are 4, 5, 9.
    assert propose(tokens, 3, 1, 3) == [4, 5, 9]
    # With n capped at 2, [2, 3] last occurred at 6: 7, 1.
    assert propose(tokens, 2, 1, 2) == [7, 1]
    # Fewer tokens follow the match than k: those there are.
    assert propose([5, 6, 7, 5, 6], 4, 2, 2) == [7, 5, 6]


def test_propose_nothing_when_no_suffix_repeats():
    assert propose([1, 2, 3, 4, 5], 4, 1, 3) == []
    assert propose([1, 2, 3, 1], 4, 2, 3) == []  # only a 1-gram repeats, below the minimum
    assert propose([7], 4, 1, 3) == []
    assert propose([1, 2, 1, 2], 0, 1, 3) == []


def test_propose_overlapping_run():
    assert propose([4, 4, 4, 4], 3, 1, 2) == [4, 4]  # [4, 4] at 0 has two 4s after it, the latest (at 1) one
    assert propose([4, 4, 4, 4, 4, 4], 3, 2, 2) == [4, 4, 4]


def _propose_by_rule(tokens, k, lookup_min, lookup_max):
    """propose's rule as its docstring states it, by brute force (the reference its numpy search must equal)."""
    if k <= 0 or len(tokens) < lookup_min + 1:
        return []
    size = len(tokens)
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        starts = [i for i in range(size - n) if tokens[i:i + n] == tokens[size - n:]]
        if starts:
            with_k = [i for i in starts if i + n + k <= size]
            i = with_k[-1] if with_k else starts[0]
            return tokens[i + n:i + n + k]
    return []


def test_propose_equals_its_rule_by_brute_force_and_reads_a_growing_buffer():
    from pdserve.engine.speculative import TokenBuffer

    g = torch.Generator().manual_seed(3)
    checked = matched = 0
    for trial in range(60):
        vocab = (2, 3, 5, 50)[trial % 4]  # small vocabularies: many matches, overlaps, runs
        tokens = torch.randint(0, vocab, (int(torch.randint(1, 120, (1,), generator=g)),), generator=g).tolist()
        buffer = TokenBuffer()
        for end in range(1, len(tokens) + 1, 7):
            prefix = tokens[:end]
            for k, lo, hi in ((4, 1, 5), (3, 2, 2), (1, 1, 1), (6, 3, 8)):
                want = _propose_by_rule(prefix, k, lo, hi)
                assert propose(prefix, k, lo, hi) == want
                assert propose(buffer.view(prefix), k, lo, hi) == want
                checked, matched = checked + 1, matched + bool(want)
    assert matched > checked // 3  # the cases drafted, not only found nothing
    buffer = TokenBuffer()
    assert buffer.view([1, 2, 3]).tolist() == [1, 2, 3]
    assert buffer.view([1, 2, 3] + list(range(300))).tolist() == [1, 2, 3] + list(range(300))  # grown
    assert buffer.view([9, 9]).tolist() == [9, 9]  # shorter: read again
    assert buffer.view([9, 8, 7]).tolist() == [9, 8, 7]  # its last buffered token changed: read again


@pytest.mark.parametrize("target, draft, out", [
    ([5, 6, 7], [5, 6], [5, 6, 7]),  # all kept, then the bonus
    ([5, 8, 7], [5, 6], [5, 8]),  # the second rejected: the target's token replaces it
    ([9, 6, 7], [5, 6], [9]),  # the first rejected
    ([3], [], [3]),  # nothing drafted: a plain step
])
def test_accept_greedy(target, draft, out):
    assert accept_greedy(target, draft) == out


def _freqs(samples, vocab):
    c = collections.Counter(samples)
    return torch.tensor([c[i] / len(samples) for i in range(vocab)])


def test_accept_sampled_keeps_the_target_distribution():
    """Over many draws the first emitted token is distributed as p0 whatever the draft, and the second, where
    the first draft was kept, as p1: the rejection rule changes the speed, never the distribution."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    g = torch.Generator().manual_seed(0)
    n = 20000
    for draft in ([1, 3], [3, 0], [0, 2]):
        runs = [accept_sampled(p, draft, g) for _ in range(n)]
        assert (_freqs([r[0] for r in runs], 4) - p[0]).abs().max() < 0.015, draft
        second = [r[1] for r in runs if len(r) > 1]
        assert len(second) == pytest.approx(n * p[0, draft[0]].item(), rel=0.05)
        assert (_freqs(second, 4) - p[1]).abs().max() < 0.02, draft
        assert all(1 <= len(r) <= 3 for r in runs)
        # A kept draft is the draft; a run ends at its first token that differs from it (or at the bonus).
        for r in runs[:500]:
            kept = next((i for i, (t, d) in enumerate(zip(r, draft)) if t != d), len(r) - 1)
            assert len(r) == kept + 1 or (kept == len(draft) and len(r) == len(draft) + 1)


def test_accept_sampled_with_a_draft_distribution_keeps_the_target_distribution():
    """A draft model's drafts are drawn from its own q; accepting with min(1, p/q) and resampling from
    max(0, p - q) keeps the emitted tokens distributed as p, however far q is from p. Drawing the drafts from q
    here, the first emitted token follows p0 and, where the first draft was kept, the second p1; the share of
    first drafts kept is sum(min(p0, q0)), the overlap of the two (the one-hot rule, correct for any draft but
    blind to q, would keep sum(p0 q0): 0.16 and 0.25 here, against 0.4 and 0.7)."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    g = torch.Generator().manual_seed(0)
    n = 20000
    for q in (torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.4, 0.3, 0.2, 0.1]]),
              torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.5, 0.5]])):
        runs, kept = [], 0
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(2)], 1)
        for draft in drafts.tolist():
            r = accept_sampled(p, draft, g, q)
            kept += r[0] == draft[0] and len(r) > 1
            runs.append(r)
        assert (_freqs([r[0] for r in runs], 4) - p[0]).abs().max() < 0.015, q
        assert (_freqs([r[1] for r in runs if len(r) > 1], 4) - p[1]).abs().max() < 0.02, q
        assert kept / n == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.015)


def test_accept_sampled_one_hot_target_accepts_its_token():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(1)
    assert accept_sampled(p, [1], g) == [1, 2]
    assert accept_sampled(p, [0], g) == [1]


def test_draft_state_follows_recent_acceptance():
    s = DraftState(4)
    for _ in range(3):
        s.update(4, 4, 4)
    assert s.k == 4  # capped at the configured k
    s.update(4, 1, 4)
    assert s.k == 4  # one miss between copied spans does not cut k
    shrunk = []
    for _ in range(10):
        s.update(s.k, 0, 4)
        shrunk.append(s.k)
    assert shrunk == sorted(shrunk, reverse=True) and shrunk[-1] == 1  # nothing kept, again and again: one draft
    s.update(0, 0, 4)
    assert s.k == 1  # nothing drafted: unchanged
    grown = []
    for _ in range(6):
        s.update(s.k, s.k, 4)
        grown.append(s.k)
    assert grown == sorted(grown) and grown[-1] == 4 and grown[0] < 4  # back to k as drafts are kept again


@pytest.mark.parametrize("k_max", [1, 4, 8])
def test_best_draft_length_pays_for_its_rows(k_max):
    from pdserve.engine.speculative import ROW_COST, best_draft_length
    from pdserve.perf.speculation import tokens_per_step

    lengths = []
    for a in [i / 20 for i in range(21)]:
        k = best_draft_length(a, k_max)
        value = [tokens_per_step(a, j) / (1 + ROW_COST * j) for j in range(1, k_max + 1)]
        assert value[k - 1] == max(value)
        lengths.append(k)
    assert lengths == sorted(lengths)  # a higher rate never drafts less
    assert lengths[0] == 1 and lengths[-1] == k_max


def test_batch_rule_from_the_roofline():
    # H100-like: 989 TFLOP/s, 3.35 TB/s, 2-byte weights: ridge ~295 rows; k=4 -> 59 requests.
    rows = free_rows(989e12, 3.35e12, 2)
    assert 290 <= rows <= 300
    assert max_speculating_batch(SpeculativeConfig(num_speculative_tokens=4), rows) == rows // 5
    assert max_speculating_batch(SpeculativeConfig(disable_by_batch_size=8), rows) == 8


def test_serve_flag_sets_decode_colocated_and_fast_lane_pools():
    from router.cli import cluster_config_from_args, parse_args

    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    c = cluster_config_from_args(parse_args(["serve", "--speculative-config", flag, "--fast-lane-workers", "1",
                                             "--fast-lane-speculative-config", '{"method": "ngram", '
                                             '"num_speculative_tokens": 6}']))
    assert c.engine_for(c.prefill).speculative is None  # a prefill pool never speculates
    assert c.engine_for(c.decode).speculative.num_speculative_tokens == 3
    assert c.engine_for(c.fast).speculative.num_speculative_tokens == 6
    c = cluster_config_from_args(parse_args(["serve", "--mode", "colocated", "--speculative-config", flag]))
    assert c.engine_for(c.colocated).speculative.num_speculative_tokens == 3
    c = cluster_config_from_args(parse_args(["serve"]))
    assert c.engine_for(c.decode).speculative is None


def test_serve_refuses_other_methods_at_start(capsys):
    from router.cli import main

    assert main(["serve", "--speculative-config", '{"method": "eagle", "model": "m"}']) == 2
    assert "not supported yet" in capsys.readouterr().err
    assert main(["serve", "--speculative-config", '{"method": "draft_model", "model": "/no/such/draft"}']) == 2
    assert "draft model path '/no/such/draft' does not exist" in capsys.readouterr().err


def test_worker_metrics_export_speculation():
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.serving.messages import WorkerStats
    from router.metrics import WorkerCollector

    stats = [WorkerStats("d0", "decode", 0, 0, 1, 1, 10, speculation={
        "drafted": 10, "accepted": 7, "verifications": 3, "acceptance_lengths": {4: 1, 3: 1, 0: 1}}),
        WorkerStats("d1", "decode", 0, 0, 1, 1, 10, speculation={
            "method": "draft_model", "drafted": 4, "accepted": 4, "verifications": 1, "acceptance_lengths": {4: 1},
            "draft_stale": True}),
        WorkerStats("p0", "prefill", 0, 0, 0, 0, 10)]
    reg = CollectorRegistry()
    reg.register(WorkerCollector(lambda: stats))
    text = generate_latest(reg).decode()
    assert 'pdserve_worker_spec_drafted_tokens_total{pool="decode",worker="d0"} 10.0' in text
    assert 'pdserve_worker_spec_accepted_tokens_total{pool="decode",worker="d0"} 7.0' in text
    assert 'pdserve_worker_spec_acceptance_length_bucket{le="2.0",pool="decode",worker="d0"} 1.0' in text
    assert 'pdserve_worker_spec_acceptance_length_bucket{le="3.0",pool="decode",worker="d0"} 2.0' in text
    assert 'pdserve_worker_spec_acceptance_length_sum{pool="decode",worker="d0"} 7.0' in text
    assert 'pdserve_worker_spec_draft_stale{pool="decode",worker="d1"} 1.0' in text
    assert 'spec_draft_stale{pool="decode",worker="d0"}' not in text  # prompt lookup has no draft to go stale
    assert 'worker="p0"' not in "".join(l for l in text.splitlines() if "spec_" in l)


def test_a_speculating_pool_is_not_pipelined_by_default_and_its_graphs_hold_the_drafts():
    """pipelined(): on CUDA by default, unless the engine speculates; asked for explicitly, it stays on (and the
    engine does not speculate: speculation_for). graph_rows(): the speculating batch's k + 1 rows a request."""
    spec = SpeculativeConfig(num_speculative_tokens=4)
    cuda, spec_cuda = EngineConfig(device="cuda"), EngineConfig(device="cuda", speculative=spec)
    assert pipelined(cuda, Role.DECODE) and not pipelined(cuda, Role.PREFILL)
    assert not pipelined(spec_cuda, Role.DECODE) and not pipelined(spec_cuda, Role.COLOCATED)
    assert pipelined(replace(spec_cuda, pipelined_decode=True), Role.DECODE)
    assert not pipelined(EngineConfig(), Role.DECODE)  # a CPU engine
    seqs = cuda.scheduler.max_num_seqs
    assert graph_rows(cuda, Role.DECODE) == seqs and graph_rows(spec_cuda, Role.DECODE) == 5 * seqs
    capped = replace(spec_cuda, speculative=replace(spec, disable_by_batch_size=8))
    assert graph_rows(capped, Role.DECODE) == max(seqs, 40)
    assert graph_rows(replace(spec_cuda, pipelined_decode=True), Role.DECODE) == seqs
