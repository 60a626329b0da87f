"""What a structured-output token mask costs per decode step: xgrammar against llguidance, beside the engine's
decode step, measured side by side in one run.

    .venv/bin/python -m bench.engine.grammar_mask [--steps 40] [--engine-steps 16] [--skip-engine]

The mask of one step, per library: fill the token bitmask of every row (one matcher per row; the library's own
batched fill too) and apply it to the [rows, vocab] fp32 logits with the engine's own apply
(pdserve.engine.sampling.apply_token_bitmask, the same for both: the bitmask format is the same), at batch 1 and
32. The grammar is a realistic JSON schema (an object of typed properties, an enum, an array of objects)
compiled once with SmolLM2-135M-Instruct's tokenizer (vocab 49152); each row's matcher walks a real JSON
document that validates against it, rows starting at different offsets so that every row is mid-document
(inside strings, numbers, the array), and advances one token after each timed mask (accepting the token is
timed apart: it is the host's other per-token cost). A row that reaches the end starts the document again
(untimed). Median milliseconds over --steps steps.

The engine's decode step (as bench.engine.decode_attention times it: schedule + forward + sampling +
bookkeeping) on the default model, default EngineConfig, batch 1 and 32, prompts of 16-512 random tokens,
median over --engine-steps steps, in the same run. The share is the mask (fill + apply) over that step.
"""
from __future__ import annotations

import json
import random
import statistics
import time

import torch

from bench.common import Table, parser, run_header

VOCAB = 49152  # SmolLM2-135M's logits
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "addresses": {"type": "array", "items": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        }},
    },
    "required": ["name", "age", "role", "tags"],
}
DOCUMENT = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True, "score": 97.25,
    "role": "editor", "tags": ["mathematics", "engines", "poetry"],
    "addresses": [{"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
                  {"street": "Ockham Park", "city": "Surrey"}],
}


class Rows:
    """One library's matchers for a batch: fill the bitmask of every row, accept each row's next token."""

    def __init__(self, lib: str, grammar, doc: list[int], batch: int, batched: bool):
        import llguidance
        import xgrammar as xgr

        self.lib, self.doc, self.batched = lib, doc, batched
        self.pos = [(r * 17 + 5) % len(doc) for r in range(batch)]  # every row somewhere mid-document
        self.bitmask = xgr.allocate_token_bitmask(batch, VOCAB)
        if lib == "xgrammar":
            self.matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
            self.pool = xgr.BatchGrammarMatcher() if batched else None
        else:
            self.matchers = [llguidance.LLMatcher(grammar[0], grammar[1], log_level=0) for _ in range(batch)]
            self.pool = llguidance.LLExecutor() if batched else None
        for m, p in zip(self.matchers, self.pos):
            assert self._accept(m, doc[:p]), f"{lib} refused the document's first {p} tokens"

    def _accept(self, m, tokens: list[int]) -> bool:
        if self.lib == "xgrammar":
            return all(m.accept_token(t) for t in tokens)
        return m.consume_tokens(tokens) if tokens else True

    def fill(self) -> None:
        import llguidance.torch as llgt

        if self.lib == "xgrammar":
            if self.pool is not None:
                self.pool.batch_fill_next_token_bitmask(self.matchers, self.bitmask)
            else:
                for i, m in enumerate(self.matchers):
                    m.fill_next_token_bitmask(self.bitmask, i)
        elif self.pool is not None:
            llgt.fill_next_token_bitmask_par(self.pool, [(m, i) for i, m in enumerate(self.matchers)], self.bitmask)
        else:
            for i, m in enumerate(self.matchers):
                llgt.fill_next_token_bitmask(m, self.bitmask, i)

    def accept(self) -> None:
        for r, m in enumerate(self.matchers):
            assert self._accept(m, [self.doc[self.pos[r]]]), f"{self.lib} refused a document token"
            self.pos[r] += 1

    def wrap(self) -> None:
        """Rows at the document's end start it again."""
        for r, m in enumerate(self.matchers):
            if self.pos[r] == len(self.doc):
                m.reset()
                self.pos[r] = 0


def grammars(hf_tokenizer, eos: tuple[int, ...]) -> dict:
    """Each library's tokenizer info and compiled schema, and the time each took."""
    import llguidance
    import llguidance.hf
    import xgrammar as xgr

    out = {}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=VOCAB, stop_token_ids=list(eos))
    t1 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    out["xgrammar"] = (compiled, t1 - t0, time.perf_counter() - t1)
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    err = llguidance.LLMatcher.validate_grammar(grammar, tok)
    assert not err, err
    out["llguidance"] = ((tok, grammar), t1 - t0, time.perf_counter() - t1)
    return out


def mask_costs(compiled: dict, doc: list[int], batches: tuple[int, ...], steps: int) -> dict:
    """(library, fill kind, batch) -> (fill ms, apply ms, accept ms), medians."""
    from pdserve.engine.sampling import apply_token_bitmask

    out = {}
    for batch in batches:
        logits = torch.randn(batch, VOCAB)
        rows_all = torch.arange(batch)
        for _ in range(5):  # the apply's first calls at a new shape allocate
            apply_token_bitmask(logits, rows_all, torch.full((batch, VOCAB // 32), -1, dtype=torch.int32))
        for lib in compiled:
            for batched in (False, True):
                rows = Rows(lib, compiled[lib][0], doc, batch, batched)
                fill, apply, accept = [], [], []
                for step in range(steps + 3):
                    rows.wrap()
                    t0 = time.perf_counter()
                    rows.fill()
                    t1 = time.perf_counter()
                    work = apply_token_bitmask(logits, rows_all, rows.bitmask)
                    t2 = time.perf_counter()
                    rows.accept()
                    t3 = time.perf_counter()
                    if step >= 3:  # warm-up
                        fill.append(t1 - t0)
                        apply.append(t2 - t1)
                        accept.append(t3 - t2)
                    assert torch.isfinite(work).any(dim=-1).all(), "a row with no token allowed"
                out[lib, "batched" if batched else "per row", batch] = tuple(
                    1e3 * statistics.median(v) for v in (fill, apply, accept))
    return out


def engine_steps(batches: tuple[int, ...], steps: int, seed: int) -> dict[int, float]:
    """batch -> the engine's median decode step (ms), free text."""
    from pdserve.config import EngineConfig
    from pdserve.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig())
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    out = {}
    for batch in batches:
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        rids = [engine.add_request([rng.randrange(vocab) for _ in range(rng.randint(16, 512))], params)
                for _ in range(batch)]
        timed: list[float] = []
        decodes = 0
        while engine.has_unfinished and len(timed) < steps:
            t = time.perf_counter()
            step = engine.scheduler.schedule()
            result = engine.runner.execute(step.chunks)
            engine.process(engine.core.account(step, result))
            dt = time.perf_counter() - t
            if len(step.chunks) == batch and all(len(c.token_ids) == 1 for c in step.chunks):
                decodes += 1
                if decodes > 2:  # warm-up
                    timed.append(dt)
        for rid in rids:
            engine.abort(rid)
        out[batch] = 1e3 * statistics.median(timed)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=40, help="timed mask steps per library, fill kind and batch")
    ap.add_argument("--engine-steps", type=int, default=16, help="timed engine decode steps per batch")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    run_header()
    from pdserve.model.loader import default_model_path
    from pdserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_path())
    doc = tok.hf_tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    compiled = grammars(tok.hf_tokenizer, tok.eos_token_ids)
    print(f"torch threads {torch.get_num_threads()}; document {len(doc)} tokens; set-up per worker (s):")
    for lib, (_, info_s, compile_s) in compiled.items():
        print(f"  {lib:10s} tokenizer info {info_s:.3f}, schema compile {compile_s:.4f}")
    batches = tuple(args.batches)
    costs = mask_costs(compiled, doc, batches, args.steps)
    steps = {} if args.skip_engine else engine_steps(batches, args.engine_steps, args.seed)
    t = Table(("library", 10, "<s"), ("fill", 7, "<s"), ("batch", 5, "d"), ("fill ms", 8, ".3f"),
              ("apply ms", 8, ".3f"), ("mask ms", 8, ".3f"), ("accept ms", 9, ".3f"), ("step ms", 8, ".1f"),
              ("mask/step", 9, "s"))
    print(t.header())
    for (lib, kind, batch), (fill, apply, accept) in costs.items():
        step = steps.get(batch)
        share = f"{(fill + apply) / step:.1%}" if step else "-"
        print(t.row(lib, kind, batch, fill, apply, fill + apply, accept, step or float("nan"), share))


if __name__ == "__main__":
    main()
