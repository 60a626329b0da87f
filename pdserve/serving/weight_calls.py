"""A worker's weight calls: live weight updates staged and committed, a trainer's weight group, pause and resume.

The router (router/weights.py) calls these on the worker's Ray actor: `stage_weights`, `commit_weights`,
`update_weights`, `join_weight_group`, `receive_weights`, `weights_received`, `leave_weight_group`,
`export_weights`, `pause`, `resume`, `flush_prefix_cache`. Ray finds an actor's methods on its class, so they cannot live on an
object the actor holds without a forwarding method each on the actor: `WeightCalls` is a mixin of
`WorkerActor` (pdserve.serving.worker), the only one that inherits it. Its own state (what is staged, the
group, the update counters the stats report) is set in its `__init__`, which `WorkerActor.__init__` runs
first; what it uses of the actor is declared below the class line.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pdserve.serving.messages import WeightUpdateReport
from pdserve.weights.update import checkpoint_path, default_weights_root

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import EngineCore
    from pdserve.engine.scheduler_types import SampledToken
    from pdserve.engine.step_loop import StepLoop
    from pdserve.faults import FaultPoints

log = logging.getLogger(__name__)


class WeightCalls:
    """The weight-update calls of a worker actor (a mixin of pdserve.serving.worker.WorkerActor)."""

    # The actor's, used here: its id, its engine, its step thread, its fault points, and how it publishes
    # the tokens a commit ends requests with.
    worker_id: str
    core: EngineCore
    loop: StepLoop | None
    faults: FaultPoints
    _publish: Callable[[Iterable[SampledToken]], None]

    def __init__(self) -> None:
        super().__init__()
        # A weight update read and converted, waiting for commit_weights: (version, staged, seconds to stage).
        self._staged: tuple[int, object, float] | None = None
        self._group = None  # a trainer's weight group (pdserve.weights.group.WeightGroup), once joined
        self._receiving: asyncio.Future | None = None  # an update being received on it
        self.weight_updates = 0
        self.weight_update_seconds = 0.0
        self.weight_update_bytes = 0
        self.weight_update_failures = 0

    async def stage_weights(self, source: str, version: int, own: bool = False) -> int:
        """Read and convert checkpoint `source` for weight version `version`, held aside until commit_weights
        (the worker serves meanwhile); its bytes. Raises with nothing applied if it does not fit the model, or
        if it is not under the weights root (EngineConfig.weights_root: a client's path is read there only,
        checked here, on the worker's own filesystem); own: a checkpoint the router had a worker write (a
        catch-up after a trainer's update), wherever it is."""
        await asyncio.to_thread(self.faults.hit, "stage_weights")
        t0 = time.perf_counter()
        try:
            if not own and self.core.config.load_format != "sim":  # a simulated update reads nothing
                source = checkpoint_path(source, self.core.config.weights_root or
                                         default_weights_root(self.core.info.path))
            staged = await asyncio.to_thread(self.core.stage_weights, source)
        except Exception:
            self.weight_update_failures += 1
            raise
        self._staged = (version, staged, time.perf_counter() - t0)
        return staged.num_bytes if staged is not None else 0

    async def commit_weights(self, version: int) -> WeightUpdateReport:
        """Between two steps: the staged update becomes the weights served, as `version`; requests holding
        older KV follow their version policy (aborted ones end with FinishReason.ABORT)."""
        if self._staged is None or self._staged[0] != version:
            raise ValueError(f"{self.worker_id} has no update staged for weight version {version}")
        _, staged, stage_s = self._staged
        self._staged = None
        t0 = time.perf_counter()
        await asyncio.wrap_future(self.loop.call(lambda: self._commit_weights(staged, version)))
        commit_s = time.perf_counter() - t0
        num_bytes = staged.num_bytes if staged is not None else 0
        self.weight_updates += 1
        self.weight_update_seconds += stage_s + commit_s
        self.weight_update_bytes += num_bytes
        log.info("%s: weight version %d (staged in %.2f s, committed in %.3f s, %.1f MB)", self.worker_id, version,
                 stage_s, commit_s, num_bytes / 1e6)
        return WeightUpdateReport(self.worker_id, version, stage_s, commit_s, num_bytes)

    async def update_weights(self, source: str, version: int, own: bool = False) -> WeightUpdateReport:
        """stage_weights, then commit_weights (a rolling update: this worker switches as soon as it can)."""
        await self.stage_weights(source, version, own)
        return await self.commit_weights(version)

    async def join_weight_group(self, address, rank: int, timeout_s: float) -> None:
        """Join a trainer's weight group (pdserve.weights.group) as `rank` (a tensor-parallel worker's rank r as
        rank + r); returns once every rank has."""
        await self.leave_weight_group()
        self._group = await asyncio.to_thread(self.core.join_weight_group, address, rank, timeout_s)

    async def receive_weights(self, metas: list, bucket_bytes: int, version: int) -> None:
        """Start receiving an update broadcast on the weight group, staging each tensor as it arrives (the worker
        serves meanwhile); weights_received() waits for the end."""
        if self._group is None:
            raise RuntimeError(f"{self.worker_id} is in no weight group")
        group = self._group
        loop = asyncio.get_running_loop()

        def receive() -> None:
            t0 = time.perf_counter()
            staged = self.core.receive_weights(group, metas, bucket_bytes)
            self._staged = (version, staged, time.perf_counter() - t0)

        self._receiving = loop.run_in_executor(None, receive)

    async def weights_received(self, version: int) -> int:
        """Wait for the update being received; its bytes. If it failed (the trainer gone, a timeout), the group is
        closed and this raises: nothing is staged."""
        receiving, self._receiving = self._receiving, None
        if receiving is None:
            raise RuntimeError(f"{self.worker_id} is receiving no update")
        try:
            await receiving
        except Exception:
            self.weight_update_failures += 1
            await self.leave_weight_group()
            raise
        return self._staged[1].num_bytes if self._staged and self._staged[1] is not None else 0

    async def leave_weight_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(self.core.leave_weight_group, group)

    async def export_weights(self, directory: str) -> int:
        """Write the weights served as a checkpoint in `directory` (EngineCore.export_weights), on the step
        thread: between two steps, so never half of an update; its bytes."""
        return await asyncio.wrap_future(self.loop.call(lambda: self.core.export_weights(directory)))

    async def pause(self) -> None:
        """Stop stepping after the step under way (requests stay where they are); returns once stopped."""
        await asyncio.wrap_future(self.loop.call(lambda: setattr(self.loop, "paused", True)))

    async def resume(self) -> None:
        await asyncio.wrap_future(self.loop.call(lambda: setattr(self.loop, "paused", False)))

    async def flush_prefix_cache(self) -> bool:
        """Between two steps: forget everything the prefix cache holds (its KV events tell the routers); False,
        nothing forgotten, while a request holds KV blocks (pdserve.engine.block_pool.reset_prefix_cache)."""
        return await asyncio.wrap_future(self.loop.call(self.core.pool.reset_prefix_cache))

    def _commit_weights(self, staged, version: int) -> None:
        """Step thread. A commit that fails part-way leaves a mix of two versions: the worker must not serve
        it, so it exits, and the router replaces it with a worker loaded at the version the cluster serves."""
        self.faults.hit("commit_weights")
        try:
            sampled = self.core.commit_weights(staged, version)
        except ValueError:
            raise  # refused before anything was applied (e.g. a version not newer)
        except BaseException as e:  # noqa: BLE001
            log.error("%s: weight update to version %d failed part-way (%s); the worker exits", self.worker_id,
                      version, e)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(71)
        self._publish(sampled)
