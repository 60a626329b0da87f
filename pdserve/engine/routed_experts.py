"""Routed experts (R3): the top-k expert ids each token of a request was routed to, in every mixture-of-experts
layer, for a request that asks (SamplingParams.return_routed_experts). A trainer replays them so that its MoE
routes a rollout's tokens as the sampler did.

Which positions: the experts of the token at position p (prompt then output, one sequence) are the ones the
forward routed it to when it was an input. A request of P prompt tokens and N output tokens has P + N - 1
entries, positions 0 .. P + N - 2: the last output token is never fed back, so it has none. Each entry is
[moe layers][top_k] ints, the layers in model order and each layer's k ids in the router's top-k order (most
probable first).

Where they travel: each sampled token carries the entries of the positions computed since the last one was
sent, up to the position that sampled it (RoutedLog.take): the first token carries the prompt's P entries,
every later output token the one entry of the token before it. On a prefill worker those are the whole
prompt's (it computes every position: see below), sent with the first token; the decode worker's log starts
after the tokens whose KV it received, so it sends the output's entries alone.

What is computed once is kept: a position computed again (a preemption's recompute, a weight update's
"recompute" policy) keeps the entry computed first, which is the one already sent. A position served from a
prefix cache is not computed, so its experts are unknown: a request that asks for routed experts therefore
takes no prefix-cache hit on any worker (its prompt is computed whole, as for prompt logprobs), and the router
never gives it a partial hand-off or a decode worker's local prefill.

Cheap capture: the MoE blocks record their top-k ids (ints, never logits) only in a step where some chunk
asks (RouteCapture), and the runner copies them to the host once per such step.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pdserve.model.moe import MoE


@dataclass(frozen=True)
class RoutedExperts:
    """Consecutive positions' experts: entries start, start + 1, ... of a request's sequence."""

    start: int  # position of ids[0]
    ids: np.ndarray  # [positions, moe layers, top_k] int32

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def to_list(self) -> list[list[list[int]]]:
        return self.ids.tolist()

    def to_base64(self) -> str:
        """The entries as base64 of their int32 bytes (little-endian, C order): SGLang's wire form."""
        return base64.b64encode(np.ascontiguousarray(self.ids, dtype="<i4").tobytes()).decode("ascii")

    def json(self) -> dict:
        """The HTTP API's object (the gRPC message's fields): expert_ids base64 of [positions][num_layers][top_k]
        int32, little-endian."""
        return {"start": self.start, "num_layers": int(self.ids.shape[1]), "top_k": int(self.ids.shape[2]),
                "expert_ids": self.to_base64()}


def check_asked(params, routes: bool) -> None:
    """ValueError if a request's parameters ask for routed experts of an engine whose steps route no tokens to
    experts (a dense model, or a simulated one)."""
    if params.return_routed_experts and not routes:
        raise ValueError("return_routed_experts needs a mixture-of-experts model; the model served routes no "
                         "tokens to experts")


def join(parts: list[RoutedExperts], layers: int = 0, top_k: int = 0) -> RoutedExperts:
    """Consecutive parts as one (an empty one at position 0 if there are none)."""
    if not parts:
        return RoutedExperts(0, np.zeros((0, layers, top_k), dtype=np.int32))
    for a, b in zip(parts, parts[1:]):
        assert a.start + len(a) == b.start, "routed experts' parts must be consecutive"
    return RoutedExperts(parts[0].start, np.concatenate([p.ids for p in parts]))


class RoutedLog:
    """A request's routed experts on one worker: the entries computed and not yet sent (module docstring).
    Positions before `start` are another worker's (the KV a decode worker received) or already sent."""

    def __init__(self, start: int = 0):
        self.known = start  # positions 0 .. known - 1 have an entry (here or where they were sent from)
        self.sent = start
        self._pending: list[np.ndarray] = []  # entries sent .. known - 1, in order

    def note(self, start: int, ids: np.ndarray) -> None:
        """Entries computed for positions start, start + 1, ...; those of positions known already are kept."""
        assert start <= self.known, f"routed experts of position {start} before those of {self.known}"
        new = ids[self.known - start:]
        if len(new):
            self._pending.append(new)
            self.known += len(new)

    def take(self, upto: int) -> RoutedExperts | None:
        """The entries not sent yet of positions before `upto`, marked sent; None if there are none."""
        upto = min(upto, self.known)
        if upto <= self.sent:
            return None
        pending = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        n = upto - self.sent
        out = RoutedExperts(self.sent, pending[:n])
        self._pending = [pending[n:]] if n < len(pending) else []
        self.sent = upto
        return out


def relay(log: RoutedLog | None, parts) -> RoutedExperts | None:
    """The router's side: parts (RoutedExperts or None) a worker sent for a request whose log of what was
    streamed is `log`, and what of them is new to the client. A resumed attempt's prefill computes the
    positions streamed already again: those are dropped, the client keeps what it was sent."""
    if log is None:
        return None
    for part in parts:
        if part is not None:
            log.note(part.start, part.ids)
    return log.take(log.known)


class RouteCapture:
    """Records the top-k ids of every MoE block of a model over one forward, when asked (a context manager):
    ids() is then [tokens, moe layers, top_k] int32 on the host, in the forward's row order."""

    def __init__(self, model: nn.Module):
        self.blocks = [m for m in model.modules() if isinstance(m, MoE)]

    def __enter__(self) -> RouteCapture:
        for b in self.blocks:
            b.routed = []
        return self

    def __exit__(self, *exc) -> None:
        self._ids = [b.routed for b in self.blocks]
        for b in self.blocks:
            b.routed = None

    def ids(self) -> np.ndarray:
        assert all(len(r) == 1 for r in self._ids), "each MoE block routes once a forward"
        stacked = torch.stack([r[0] for r in self._ids], dim=1)  # [tokens, moe layers, top_k]
        return stacked.to(device="cpu", dtype=torch.int32).numpy()


def note_step(requests, chunks, found: dict[int, np.ndarray]) -> None:
    """A step's captured experts (StepResult.routed_experts: chunk index -> [chunk tokens, layers, k]) into
    their requests' logs, by position."""
    for i, ids in found.items():
        log = requests[i].routed
        if log is not None:
            log.note(chunks[i].start, ids)
