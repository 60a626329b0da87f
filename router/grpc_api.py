"""The gRPC door: the Generation service's wire format to the front (router.frontend) and back.

A GenerateRequest becomes an Ask (router.admission.ask_from_grpc); each output a GenerateResponse. Errors
are mapped to status codes here: ValueError from the front's checks or the cluster's is INVALID_ARGUMENT;
a full admission queue is RESOURCE_EXHAUSTED at once; a request the workers failed is UNAVAILABLE; a client
deadline or cancel cancels the handler, whose cleanup cancels the request on every worker. (The Weights
service, router.weights, and the API key, router.security, set their own.)
"""
from __future__ import annotations

import asyncio

import grpc

from pdserve.engine.logprobs import TokenLogprob
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import FinishReason
from pdserve.tiers import TIERS
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.admission import Malformed, Overloaded, RequestFailed, Samples, ask_from_grpc
from router.chat_reply import Reply
from router.frontend import Frontend
from router.tracking import Timeline

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
           FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED, FinishReason.ERROR: pb.FINISH_REASON_ERROR,
           FinishReason.ABORT: pb.FINISH_REASON_ABORT}


def _fill_logprob(msg: pb.TokenLogprob, lp: TokenLogprob) -> None:
    msg.token_id, msg.logprob, msg.rank = lp.token_id, lp.logprob, lp.rank
    top = msg.top
    for token_id, logprob in lp.top:
        top.add(token_id=token_id, logprob=logprob)


class GenerationService(pb_grpc.GenerationServicer):
    """The Generation service over the front: each RPC's message to the front's terms and back."""

    def __init__(self, front: Frontend):
        self.front = front

    # -- Generate ---------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest | Malformed, context: grpc.aio.ServicerContext):
        t = Timeline("grpc")
        try:
            async for resp in self._generate(request, context, t):
                yield resp
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            t.code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            t.finish_reason = "cancelled"
            raise
        finally:
            t.record(self.front.metrics)

    async def _generate(self, request, context, t: Timeline):
        async def abort(code: grpc.StatusCode, message: str) -> None:
            t.code = code.name
            await context.abort(code, message)

        if isinstance(request, Malformed):
            await abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        if not self.front.serving:
            await abort(grpc.StatusCode.UNAVAILABLE, "the router is draining; retry on another replica")
        try:
            prepared = await self.front.prepare_compiled(ask_from_grpc(request))
        except ValueError as e:
            await abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        samples = Samples(prepared.params.n)
        replies: list[Reply] = []  # a chat's replies read for reasoning and calls, once the prompt is known
        try:
            async for out in self.front.run(prepared, t):
                last = samples.add(out)
                if prepared.reply is not None and not replies:
                    replies = [prepared.reply.reply(self.front.info.tokenizer, prepared.prompt)
                               for _ in range(prepared.params.n)]
                yield response_message(out, t, samples.completion_tokens if last else None,
                                       replies[out.index] if replies else None)
        except RequestFailed as e:
            await abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Overloaded as e:
            await abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:  # the cluster's own checks (context length, duplicate request id, ...)
            await abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # -- info and status --------------------------------------------------------------------------
    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        info = self.front.info
        c = info.config
        return pb.ModelInfo(name=info.path, architecture=c.architecture, vocab_size=c.vocab_size,
                            max_model_len=info.max_model_len, num_layers=c.num_layers, hidden_size=c.hidden_size,
                            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, num_params=c.num_params,
                            dtype=self.front.cluster.config.engine.dtype,
                            has_chat_template=bool(info.tokenizer and info.tokenizer.has_chat_template),
                            eos_token_ids=list(info.eos_token_ids))

    async def GetClusterStatus(self, request, context) -> pb.ClusterStatus:
        front = self.front
        out = pb.ClusterStatus(mode=front.cluster.config.mode, requests_running=front.admitted,
                               requests_queued=front.admitting, queue_capacity=front.config.max_queued,
                               serving=front.serving, queued_by_service_tier={t.value: front.queued(t) for t in TIERS})
        for view in await front.pools():
            scale, ws = view.scale, [s for _, s in view.members if s is not None]
            total = sum(s.kv_blocks_total for s in ws)
            out.pools.append(pb.PoolStatus(name=scale.pool, workers=[_worker_status(w, s, scale.pool)
                                                                     for w, s in view.members],
                                           waiting_requests=sum(s.waiting for s in ws),
                                           kv_usage=sum(s.kv_blocks_used for s in ws) / total if total else 0.0,
                                           busy_fraction=sum(s.busy_fraction for s in ws) / len(ws) if ws else 0.0,
                                           current_workers=scale.ready + scale.starting,
                                           desired_workers=scale.desired, min_workers=scale.min_workers,
                                           max_workers=scale.max_workers,
                                           tensor_parallel_size=scale.tensor_parallel_size))
        return out


def _worker_status(w, s, pool: str) -> pb.WorkerStatus:
    if s is None:  # starting: nothing to report yet
        return pb.WorkerStatus(worker_id=w.worker_id, pool=pool, state=w.state)
    return pb.WorkerStatus(worker_id=s.worker_id, pool=s.pool, waiting_requests=s.waiting,
                           waiting_tokens=s.waiting_tokens, running_requests=s.running,
                           kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
                           busy_fraction=s.busy_fraction, steps=s.steps, tokens_processed=s.tokens_processed,
                           state=w.state, prompt_tokens_requested=s.prompt_tokens_requested,
                           prompt_tokens_computed=s.prompt_tokens_computed, weight_version=s.weight_version)


def response_message(out: RequestOutput, t: Timeline, completion_tokens: int | None = None,
                     reply: Reply | None = None) -> pb.GenerateResponse:
    """The message of one output (one sample's tokens). completion_tokens: given on the stream's last message
    only (every sample's output tokens), which alone carries the usage, timings and tier served: with n > 1
    a client then reads them once, as with n = 1, and sums nothing. reply: the sample's reply read for
    reasoning and calls (router.chat_reply): text is then its content, reasoning_text its reasoning, and its
    calls come on its last message."""
    resp = pb.GenerateResponse(request_id=out.request_id, text=out.new_text, token_ids=out.new_token_ids,
                               index=out.index, weight_versions=out.weight_versions)
    if reply is not None:
        piece = reply.add(out.new_text, out.finished)
        resp.text, resp.reasoning_text = piece.content, piece.reasoning
        if out.finished:
            for call in reply.calls:
                resp.tool_calls.add(id=call.id, type="function",
                                    function=pb.FunctionCall(name=call.name, arguments=call.arguments))
    if out.finish_reason is not None:
        resp.finish_reason = _FINISH[out.finish_reason]
    if completion_tokens is not None:
        resp.service_tier = out.service_tier
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=completion_tokens,
                                     cached_prompt_tokens=out.num_cached_tokens))
        resp.timings.CopyFrom(pb.Timings(queue_seconds=t.admitted - t.arrived,
                                         time_to_first_token_seconds=t.token_times[0] - t.arrived,
                                         end_to_end_seconds=t.token_times[-1] - t.arrived,
                                         prefill_worker=out.placement[0] if out.placement else "",
                                         decode_worker=out.placement[-1] if out.placement else ""))
    # Both are None unless the request asked for them: without logprobs a message costs these two checks.
    if out.logprobs is not None:
        for lp in out.logprobs:
            _fill_logprob(resp.logprobs.add(), lp)
    if out.prompt_logprobs is not None:
        for lp in out.prompt_logprobs:
            entry = resp.prompt_logprobs.add()
            if lp is not None:  # the prompt's first token: listed, with no logprob
                _fill_logprob(entry.token, lp)
    if out.routed_experts is not None:
        ids = out.routed_experts.ids  # [positions, moe layers, k]
        resp.routed_experts.CopyFrom(pb.RoutedExperts(start=out.routed_experts.start, num_layers=ids.shape[1],
                                                      top_k=ids.shape[2], expert_ids=ids.ravel().tolist()))
    return resp
