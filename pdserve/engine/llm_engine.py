"""The offline engine: one process, no Ray, no gRPC. Continuous batching over the paged cache.

It is the reference that the disaggregated cluster must match token for token.
"""
from __future__ import annotations

import collections
import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.grammar import Grammars
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_offload import attach_tiers
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.engine.output import RequestOutput, TextOutput, token_output
from pdserve.engine.request import NO_TOKEN, SAMPLE_SEP, FinishReason, Request, RequestStatus, validate_prompt
from pdserve.engine.routed_experts import RoutedExperts, check_asked, join
from pdserve.engine.runner import ModelRunner, StepResult
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_types import Role, SampledToken, ScheduledStep
from pdserve.engine.scheduler_spec import graph_rows, pipelined, speculation_for
from pdserve.engine.sim_runner import SimRunner
from pdserve.model.loader import LoadedModel, ModelInfo, load, load_info, load_shard
from pdserve.weights.update import StagedUpdate, export_checkpoint, stage, stage_checkpoint


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None  # one per token, if asked (SamplingParams.logprobs)
    prompt_logprobs: PromptLogprobs | None = None  # if asked (SamplingParams.prompt_logprobs)
    # If asked (SamplingParams.return_routed_experts): positions 0 .. len(prompt) + len(tokens) - 2, each
    # [moe layers][top_k] (pdserve.engine.routed_experts).
    routed_experts: RoutedExperts | None = None


class EngineCore:
    """Model, paged cache and continuous-batching scheduler: what every worker and the offline engine run.

    The role (pdserve.engine.scheduler_types.Role) is the scheduler's policy; the rest is the same on every worker.
    It deals in token ids only; text (detokenization, stop strings) is the caller's business.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, role: Role = Role.COLOCATED,
                 ranks=None, on_fatal: Callable[[str], None] | None = None, threads: int | None = None):
        """Tensor parallelism: ranks starts the other ranks (pdserve.engine.tp_runner; None: processes of
        their own), on_fatal(why) is called if they are lost, threads is each rank's torch threads."""
        self.config = config
        tp = config.tensor_parallel_size
        if config.load_format == "sim":  # no model: a step takes the cost model's time (pdserve.engine.sim_runner)
            assert loaded is None, "a simulated engine has no model to be given"
            self.runner = SimRunner(config)
            self.info = self.runner.info
        else:
            self.info, self.runner = self._model_runner(config, loaded, role, ranks, on_fatal, threads)
        self.model_config = self.info.config
        self.tokenizer = self.info.tokenizer
        self.max_model_len = self.info.max_model_len
        self.eos_token_ids = self.info.eos_token_ids
        self.pool = BlockPool(self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        if config.cache.offload_bytes and config.cache.enable_prefix_caching:  # KV tiers beneath the cache
            if tp > 1:
                raise ValueError("--kv-offload-mib: KV tiers are not supported with tensor parallelism yet")
            attach_tiers(self.kv, self.runner.kv_cache[:, :, :, :self.runner.num_blocks], config,
                         self.model_config.num_params)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.eos_token_ids, self.max_model_len, role)
        # A group's forked samples copy the prompt's partial last block where the runner can (one process);
        # a tensor-parallel engine's compute that part again instead.
        self.scheduler.can_copy_blocks = self.runner.can_copy_blocks
        # Structured output: compiled with this worker's tokenizer, for its logits' width (on first use). A
        # simulated engine's tokens follow no mask: it refuses structured requests.
        if self.tokenizer is not None and not isinstance(self.runner, SimRunner):
            self.scheduler.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.pipelined = pipelined(config, role)
        self.scheduler.speculation = speculation_for(config, role, self.runner, self.pipelined,
                                                     isinstance(self.runner, SimRunner), self.info)
        # Whether its steps route tokens to experts that a request may ask for (pdserve.engine.routed_experts): a
        # mixture of experts, not simulated.
        self.routes_experts = self.model_config.is_moe and not isinstance(self.runner, SimRunner)
        self.steps = 0
        self.tokens_processed = 0
        self.prompt_tokens_computed = 0  # prompt positions computed (tokens_processed's prompt share)
        self.kv.version = config.weight_version  # a worker started after updates comes up on the current version
        # Requests a weight update found holding older KV, by what their policy did: recomputed, kept, aborted.
        self.version_outcomes: collections.Counter[str] = collections.Counter()
        self._spare: StagedUpdate | None = None  # the update committed last (stage_weights reuses its memory)
        self._arena: list[torch.Tensor] = []  # a trainer's updates arrive here, a buffer per bucket (receive_weights)

    def expert_tokens(self) -> tuple[int, ...]:
        """A mixture of experts: tokens routed to each expert so far, over its layers; () for a dense or
        simulated model."""
        model = getattr(self.runner, "model", None)
        return tuple(model.expert_tokens()) if model is not None and self.model_config.is_moe else ()

    @staticmethod
    def _model_runner(config: EngineConfig, loaded: LoadedModel | None, role: Role, ranks,
                      on_fatal: Callable[[str], None] | None, threads: int | None) -> tuple[ModelInfo, ModelRunner]:
        """The model (loaded here unless given) and its runner; with tensor parallelism, rank 0's."""
        tp = config.tensor_parallel_size
        tp_runner = None
        if tp > 1:
            from pdserve.engine.tp_runner import TPRunner

            assert loaded is None, "a tensor-parallel engine loads its ranks' shares itself"
            info = load_info(config)
            blocks = config.cache.resolve_num_blocks(info.config, config.torch_dtype, tp)
            tp_runner = TPRunner(config, tp, blocks, ranks, on_fatal, threads)  # the others load meanwhile
            try:
                loaded = load_shard(config, tp, 0, info)
            except BaseException:
                tp_runner.close()
                raise
        loaded = loaded or load(config)
        num_blocks = config.cache.resolve_num_blocks(loaded.info.config, config.torch_dtype, tp)
        cuda = torch.device(config.device).type == "cuda"
        if config.cuda_graphs and loaded.info.config.is_moe:
            raise ValueError("CUDA graphs of a mixture-of-experts model are not supported yet (cuda_graphs=False)")
        # The fast path's graphs and pipelining are one process's: a tensor-parallel engine runs without them.
        # A mixture of experts groups its tokens by expert on the host (pdserve.model.moe): no graph holds it.
        graphs = (config.cuda_graphs if config.cuda_graphs is not None else cuda) and role is not Role.PREFILL \
            and tp == 1 and not loaded.info.config.is_moe
        runner = ModelRunner(loaded.model, num_blocks, config.cache.block_size, cuda_graphs=graphs,
                             max_num_seqs=config.scheduler.max_num_seqs, max_model_len=loaded.info.max_model_len,
                             graph_rows=graph_rows(config, role))
        if tp_runner is not None:
            try:
                runner = tp_runner.attach(runner)
            except BaseException:
                tp_runner.close()
                raise
        return loaded.info, runner

    def validate_prompt(self, prompt: Sequence[int]) -> None:
        validate_prompt(prompt, self.model_config.vocab_size, self.max_model_len)

    def close(self) -> None:
        """Release what lives beyond this process (a tensor-parallel engine's other ranks, the disk tier's writer)."""
        if self.kv.tier is not None:
            self.kv.tier.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def cancel(self, request_id: str) -> bool:
        """End an unfinished request, wherever it stands, and free its blocks; a group's forked samples too."""
        requests = self.scheduler.requests
        ids = [request_id] + [rid for rid in requests if rid.startswith(request_id + SAMPLE_SEP)]
        found = [requests[rid] for rid in ids if rid in requests]
        for req in found:
            self.scheduler.finish(req, FinishReason.CANCELLED)
        return bool(found)

    def cancel_all(self) -> list[str]:
        """End every queued and running request (a step failed: their state is suspect); their ids.

        Requests with no part in a step (HELD, WAITING_FOR_KV) are their owner's to end.
        """
        ids = [r.request_id for r in (*self.scheduler.running, *self.scheduler.ending, *self.scheduler.waiting)]
        for rid in ids:
            self.cancel(rid)
        return ids

    # -- weights (pdserve.weights) -----------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.kv.version

    def stage_weights(self, source: str | Iterable[tuple[str, torch.Tensor]]) -> StagedUpdate | None:
        """An update's tensors (a checkpoint path, or Hugging Face-named full tensors) validated and converted
        for this engine's model, held aside: the model is unchanged until commit_weights. Runs off the step
        thread. A simulated engine has no weights: None (its update is a version and nothing else)."""
        if isinstance(self.runner, SimRunner):
            return None
        # The memory of the update committed last is staged into again: written before, it costs no page faults.
        spare, self._spare = self._spare, None
        tp = self.config.tensor_parallel_size
        if tp > 1:  # every rank stages its share of the checkpoint (pdserve.engine.tp_runner), steps waiting
            if not isinstance(source, str):
                raise NotImplementedError("tensors given to a tensor-parallel engine's rank 0 alone (its other ranks "
                                          "receive theirs on a weight group: receive_weights)")
            return self.runner.stage_weights(source, lambda: stage_checkpoint(
                self.runner.runner.model, self.model_config, source, tp, 0, spare=spare))
        if isinstance(source, str):
            return stage_checkpoint(self.runner.model, self.model_config, source, spare=spare)
        return stage(self.runner.model, self.model_config, source, spare=spare)

    def join_weight_group(self, address, rank: int, timeout_s: float):
        """Join a trainer's weight group (pdserve.weights.group.WeightGroup) as `rank`; a tensor-parallel engine's
        rank r joins as rank + r (its group of ranks: config.tensor_parallel_size). Blocks until every rank of the
        group has joined. Returns rank 0's group."""
        from pdserve.weights.group import WeightGroup

        def join() -> WeightGroup:
            return WeightGroup.join(address, rank, timeout_s)

        if self.config.tensor_parallel_size > 1:
            return self.runner.join_weight_group(address, rank, timeout_s, join)
        return join()

    def leave_weight_group(self, group) -> None:
        """Leave the trainer's weight group joined with join_weight_group (every rank)."""
        if self.config.tensor_parallel_size > 1 and not self.runner.failed:
            self.runner.leave_weight_group()
        group.close()

    def receive_weights(self, group, metas: list, bucket_bytes: int) -> StagedUpdate | None:
        """stage_weights of an update broadcast on the trainer's weight group (every rank receives it and stages
        its share). Runs off the step thread; a tensor-parallel engine's steps wait meanwhile."""
        tp = self.config.tensor_parallel_size
        if isinstance(self.runner, SimRunner):  # no weights: the bytes are read and dropped
            for _ in group.receive(metas, bucket_bytes):
                pass
            return None
        # Each bucket arrives in a buffer of the engine's arena and its tensors are staged where they landed (no
        # copy before the commit's); the arena is written again by the next update only, after this one's commit.
        self._spare = None  # its memory may be the arena's
        if tp > 1:
            return self.runner.receive_weights(metas, bucket_bytes, lambda: stage(
                self.runner.runner.model, self.model_config, group.receive(metas, bucket_bytes, self._arena), tp, 0,
                adopt=True))
        return stage(self.runner.model, self.model_config, group.receive(metas, bucket_bytes, self._arena),
                     adopt=True)

    def export_weights(self, directory: str) -> int:
        """Write the weights this engine serves as a checkpoint (safetensors + config.json) that another engine
        of the same model loads exactly (stage_weights); its bytes. A worker that starts after a trainer's
        update, which has no checkpoint, catches up from one (router.weights)."""
        from pdserve.model.loader import _weights_dir, resolve_format

        if isinstance(self.runner, SimRunner) or self.config.tensor_parallel_size > 1:
            raise NotImplementedError("exporting the weights of a simulated or tensor-parallel engine")
        path, fmt = resolve_format(self.config.model, self.config.load_format)
        if fmt == "dummy":
            raise NotImplementedError("exporting dummy weights")
        config_json = _weights_dir(path, fmt) / "config.json"
        return export_checkpoint(self.runner.model, self.model_config, directory, config_json)

    def commit_weights(self, staged: StagedUpdate | None, version: int) -> list[SampledToken]:
        """Between two steps: the staged update becomes the model's weights and `version` this engine's
        weight version; every request holding KV of older weights follows its version policy
        (SamplingParams.version_policy). Returns the tokens of steps launched before the update (pipelined
        decode: they resolve first, on the old weights) and an ABORT end (token NO_TOKEN) per aborted request."""
        if version <= self.weight_version:
            raise ValueError(f"weight version {version} is not newer than the version served, {self.weight_version}")
        out: list[SampledToken] = []
        while self.scheduler.launched:  # the pipeline drains on the weights its steps were launched with
            out += self.run_pipelined(ScheduledStep([], [], []))
        if staged is not None:
            self.runner.commit_weights(staged)
            self._spare = staged  # its memory: the next update's staging area
        self.kv.version = version
        return out + self._version_changed()

    def _version_changed(self) -> list[SampledToken]:
        """Each request holding KV here of another version than this engine's follows its policy (version_policy).
        KV held for a hand-off, or on its way to a decode worker, carries its version: the decode worker
        decides when it lands."""
        ended = []
        for req in list(self.scheduler.requests.values()):
            holds = req.block_ids and (req.status is RequestStatus.RUNNING or req.kept_kv or req.tier_load is not None)
            if holds and not req.unresolved and (end := self.version_policy(req)) is not None:
                ended.append(end)
        return ended

    def version_policy(self, req: Request) -> SampledToken | None:
        """A request whose KV here was computed by another weight version than this engine's, by its policy:
        kept (KV no more than max_staleness versions old), recomputed (its KV freed; prompt and tokens so far
        computed again), or aborted (its ABORT end, token NO_TOKEN, returned). A prefill worker's prompts are
        recomputed whatever the policy (none has streamed a token yet)."""
        version, s, p = self.weight_version, self.scheduler, req.params
        if req.kv_version == version:
            return None
        if s.role is not Role.PREFILL and self.keeps(p, req.kv_version):
            self.version_outcomes["kept"] += 1
        elif s.role is not Role.PREFILL and p.version_policy == "abort":
            s.finish(req, FinishReason.ABORT)
            self.version_outcomes["aborted"] += 1
            return SampledToken(req, NO_TOKEN, FinishReason.ABORT, req.num_output_tokens, version=version)
        else:
            s.recompute(req)
            self.version_outcomes["recomputed"] += 1
        return None

    def keeps(self, params, kv_version: int) -> bool:
        """Whether a request's version policy keeps KV computed by weight version kv_version here."""
        return params.version_policy == "keep" and (params.max_staleness is None
                                                    or self.weight_version - kv_version <= params.max_staleness)

    @property
    def has_work(self) -> bool:
        """A step would compute something, or a launched step is still to resolve."""
        return self.scheduler.has_work or bool(self.scheduler.launched)

    def step(self) -> list[SampledToken]:
        """One step: the tokens it sampled (pipelined: those of the step launched before it)."""
        if self.pipelined:
            return self.step_pipelined()
        step = self.scheduler.schedule()
        if not step.chunks:
            if self.kv.tier is not None:  # nothing to compute but prefixes loading from a tier: wait a little for one
                self.kv.tier.wait_load(0.05)
            return []
        return self.account(step, self.execute(step))

    def step_pipelined(self) -> list[SampledToken]:
        out = self.run_pipelined(ScheduledStep([], [], [])) if self.scheduler.must_resolve else []
        return out + self.run_pipelined(self.scheduler.schedule())

    def run_pipelined(self, step: ScheduledStep, layer_done: Callable[[int], None] | None = None) -> list[SampledToken]:
        """Launch a scheduled step (its pending tokens read on the device from the step launched before
        it), then resolve that earlier step: on a GPU the host's work for step t+1 overlaps step t's.
        With no chunks, the launched step is resolved (the pipeline drains)."""
        launched = self.scheduler.launched
        if step.chunks:
            previous = launched[-1].result.sampled if launched else None
            self.kv.fence()
            self._copy_blocks()
            self._count(step)
            self.scheduler.launch(step, self.runner.execute(step.chunks, layer_done, previous))
        if len(launched) > 1 or (launched and not step.chunks):
            return self.scheduler.resolve(launched[0])
        return []

    def execute(self, step: ScheduledStep, layer_done: Callable[[int], None] | None = None) -> StepResult:
        """Run a scheduled step's forward and sampling; layer_done(i) is called once layer i's KV is written."""
        self.kv.fence()
        self._copy_blocks()
        return self.runner.execute(step.chunks, layer_done)

    def _copy_blocks(self) -> None:
        """The block copies of the samples forked since the last step, before the step reads them."""
        copies = self.scheduler.take_block_copies()
        if copies:
            self.runner.copy_blocks(copies)

    def account(self, step: ScheduledStep, result: StepResult) -> list[SampledToken]:
        self._count(step)
        return self.scheduler.update(step, result)

    def _count(self, step: ScheduledStep) -> None:
        self.steps += 1
        self.tokens_processed += sum(len(c.token_ids) for c in step.chunks)
        self.prompt_tokens_computed += sum(max(min(c.start + len(c.token_ids), r.num_prompt_tokens) - c.start, 0)
                                           for r, c in zip(step.requests, step.chunks))


class LLMEngine:
    """The offline engine: requests in, text and tokens out, all in this process (with tensor
    parallelism, rank 0 here and the other ranks in processes of their own: close() stops them)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.core = EngineCore(config, loaded)
        self._requests: dict[str, Request] = {}
        self._text: dict[str, TextOutput] = {}
        self._groups: dict[str, list[str]] = {}  # a request of n > 1 -> its samples' ids, once forked
        self._group_of: dict[str, str] = {}  # a forked sample's id -> its request's
        self.core.scheduler.on_fork = self._forked
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (nothing to do otherwise)."""
        self.core.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The core's parts, for inspection.
    model_config = property(lambda self: self.core.model_config)
    tokenizer = property(lambda self: self.core.tokenizer)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    pool = property(lambda self: self.core.pool)
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        prompt = list(prompt_token_ids)
        self.core.validate_prompt(prompt)
        check_asked(params, self.core.routes_experts)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(rid, prompt, params, seed)
        text = TextOutput.of(self.tokenizer, prompt, params)
        self.scheduler.add(req)
        self._requests[rid] = req
        self._text[rid] = text
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request (every sample of it); the output of its first sample, or None if it is not here."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        for rid in (request_id, *self._groups.pop(request_id, ())):
            sample = self._requests.pop(rid, None)
            if sample is not None:
                self._text.pop(rid)
                self._group_of.pop(rid, None)
                self.scheduler.finish(sample, FinishReason.CANCELLED)
        return RequestOutput(request_id, [], "", FinishReason.CANCELLED, req.num_prompt_tokens, req.num_output_tokens)

    def _forked(self, group: Request, sample: Request) -> None:
        """A sample of a request of n > 1 runs as a request of its own: its text, and its way back."""
        rid = sample.request_id
        self._requests[rid] = sample
        self._text[rid] = TextOutput.of(self.tokenizer, sample.prompt_token_ids, sample.params)
        self._groups.setdefault(group.request_id, []).append(rid)
        self._group_of[rid] = group.request_id

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_work

    # -- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self.process(self.core.step())

    def process(self, sampled: list[SampledToken]) -> list[RequestOutput]:
        """Text, stop strings and outputs for the tokens a core step sampled."""
        outputs = []
        for s in sampled:
            rid = s.request.request_id
            if rid not in self._text:  # a verification's tokens past the stop string that ended it
                continue
            out = token_output(s.request, self._text[rid], s.token, s.finish_reason, s.num_output_tokens)
            out.logprobs = None if s.logprobs is None else [s.logprobs]
            out.prompt_logprobs = s.prompt_logprobs
            out.index = s.request.sample_index
            out.weight_versions = [s.version] * len(out.new_token_ids)
            out.routed_experts = s.routed_experts
            if out.finish_reason is not None:
                self.scheduler.finish(s.request, out.finish_reason)  # no-op if the token rules ended it
                del self._requests[rid], self._text[rid]
            group = self._group_of.get(rid)
            if group is not None:  # reported under its request's id
                out.request_id = group
                if out.finish_reason is not None:
                    del self._group_of[rid]
                    self._groups[group].remove(rid)
            if out.finish_reason is not None and not self._groups.get(out.request_id, True):
                del self._groups[out.request_id]
            outputs.append(out)
        return outputs

    # -- weights ----------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.core.weight_version

    def update_weights(self, source: str | Iterable[tuple[str, torch.Tensor]], version: int) -> list[RequestOutput]:
        """Load new weights between two steps (a checkpoint path, or Hugging Face-named full tensors, all or
        some of the model's) as weight version `version`; requests in flight follow their version policy.
        Raises pdserve.weights.update.WeightError with nothing applied if a tensor does not fit. Returns the
        outputs the update produced (aborted requests' ends; pipelined decode's last tokens)."""
        return self.process(self.core.commit_weights(self.core.stage_weights(source), version))

    # -- convenience ------------------------------------------------------------------------------
    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding outputs as they come."""
        while self.has_unfinished:
            yield from self.step()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """One Completion per prompt, or with params.n > 1 its n, in order of their index, prompt after prompt."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done = {(rid, i): Completion(rid, list(p), [], "", FinishReason.ERROR, [] if sp.logprobs is not None else None)
                for rid, p, sp in zip(rids, prompts, plist) for i in range(sp.n)}
        routed: dict[str, list[RoutedExperts]] = {rid: [] for rid, sp in zip(rids, plist) if sp.return_routed_experts}
        for out in self.stream():
            c = done[out.request_id, out.index]
            c.token_ids.extend(out.new_token_ids)
            c.text += out.new_text
            if out.logprobs is not None:
                c.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            if out.routed_experts is not None:
                routed[out.request_id].append(out.routed_experts)
            if out.finish_reason is not None:
                c.finish_reason = out.finish_reason
        cfg = self.model_config
        for (rid, _), c in done.items():
            if rid in routed:
                c.routed_experts = join(routed[rid], len(cfg.moe_layers), cfg.num_experts_per_tok)
        return list(done.values())
