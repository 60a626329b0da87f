"""The cluster's weights as the router runs them: updates from a checkpoint, pause and resume, versions.

Each worker serves one complete weight version at a time (pdserve.weights; EngineCore.commit_weights): an
update is read and converted on every worker while it serves (stage), then switched in between two of its
steps (commit). Two modes:

- "pause" (the default): new requests wait at the cluster's gate, every worker stops after its step under way,
  all commit, all resume. Nothing runs across the switch, so every token of a request started after the
  update is the new version's; requests in flight follow the pause mode: "keep" (they stay where they are and
  go on with their version policy, SamplingParams.version_policy), "wait" (the update waits for them to end)
  or "abort" (they end with FinishReason.ABORT and their tokens so far).
- "rolling": each worker commits as soon as its copy is staged, the others serving on; a request that meets
  another version (on its worker, or on the hand-off) follows its version policy.

A worker started after an update (a replacement, a scale-up) loads the latest checkpoint at its version. An
update that fails on any worker before the switch (a bad path, a tensor that does not fit) applies nothing
anywhere; a worker whose commit fails part-way exits and is replaced at the version the cluster serves.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass

from pdserve.serving.messages import WeightUpdateReport
from pdserve.weights.update import checkpoint_path, default_weights_root
from router.cluster import Cluster

log = logging.getLogger(__name__)

UPDATE_MODES = ("pause", "rolling")
PAUSE_MODES = ("keep", "wait", "abort")


@dataclass(frozen=True)
class UpdateResult:
    version: int
    seconds: float
    workers: tuple[WeightUpdateReport, ...]


@dataclass(frozen=True)
class WorkerVersion:
    worker_id: str
    pool: str
    version: int
    paused: bool
    ranks: int = 1  # its processes (tensor-parallel size)


class NotNewer(ValueError):
    """An update's version is not greater than the one the cluster serves."""


class WorldChanged(ValueError):
    """A weight group's size does not match the cluster's workers (one came or went)."""


class NoGroup(ValueError):
    """A group update without its group (or its Begin)."""


class GroupJoinFailed(RuntimeError):
    """Workers could not join a trainer's group (unreachable, or the timeout passed)."""


# The bounds of a control call's values (#47). Versions: every token carries its version as an int64
# (GenerateResponse.weight_versions): a larger one was accepted, then every Generate failed to serialize.
# Timeouts: finite and bounded, so no call holds the router's state for ever: a pause waits for requests in
# flight at most MAX_WAIT_S (an hour), a group's join and collectives at most MAX_GROUP_TIMEOUT_S.
MAX_VERSION = (1 << 63) - 1
MAX_WAIT_S = 3600.0
MAX_GROUP_TIMEOUT_S = 600.0
MAX_BUCKET_BYTES = 1 << 32
_GROUP_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_HOST = re.compile(r"[A-Za-z0-9.:\[\]-]{1,253}")


def check_version(version: int) -> None:
    if not 1 <= version <= MAX_VERSION:
        raise ValueError(f"version must be in [1, 2**63 - 1], got {version}")


def check_timeout(name: str, seconds: float, most: float) -> None:
    if not 0 < seconds <= most:  # NaN fails it too
        raise ValueError(f"{name} must be in (0, {most:g}] seconds, got {seconds!r}")


def check_group(host: str, port: int, name: str, timeout_s: float) -> None:
    """A trainer's group address: a host name or IP address, a port, a name the store keys are prefixed with."""
    if not _HOST.fullmatch(host or ""):
        raise ValueError("host must be a host name or an IP address (the trainer's, as the workers reach it)")
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    if not _GROUP_NAME.fullmatch(name or ""):
        raise ValueError("name must be 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', ':' and '-'")
    check_timeout("timeout_seconds", timeout_s, MAX_GROUP_TIMEOUT_S)


class WeightControl:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.version = 0  # the last version every worker switched to
        self.paused = False  # Pause without its Resume yet (an update's own pause is not this)
        self._lock = asyncio.Lock()  # one update, pause, resume or catch-up at a time
        self._group_lock = asyncio.Lock()  # the trainer's group: made, joined, torn down (never across _lock)
        self._members: list = []  # the workers in the trainer's weight group, rank 1 first
        self._incoming: int | None = None  # the version being received on it
        self.client_group: str | None = None  # the name of a client's group (pdserve.weights.compat), if one is made
        self._compat: tuple[int, frozenset[str]] | None = None  # a client's update under way: version, names so far
        # The checkpoint of the version served, for a worker that starts (catch_up): the update's path, or one a
        # worker wrote (after a trainer's update); None until one is needed.
        self._source: tuple[str, int] | None = None
        self._snapshot_dir: str | None = None
        cluster.scaling.catch_up = self.catch_up

    async def versions(self) -> list[WorkerVersion]:
        """Each worker's version now (one stats call each)."""
        stats = await self.cluster.stats()
        return [WorkerVersion(s.worker_id, s.pool, s.weight_version, s.paused, self._ranks(s.pool)) for s in stats]

    def _ranks(self, pool: str) -> int:
        """The processes of each worker of `pool` (its tensor-parallel size)."""
        c = self.cluster.config
        return c.engine_for(getattr(c, pool)).tensor_parallel_size

    async def update(self, path: str, version: int, mode: str = "pause", pause_mode: str = "keep",
                     wait_timeout_s: float = 600.0) -> UpdateResult:
        """Load checkpoint `path` as weight version `version` on every worker. Raises ValueError (nothing
        applied) for a version not newer than the one served, a mode unknown, or a checkpoint a worker
        refuses (pdserve.weights.update.WeightError, FileNotFoundError)."""
        _check_modes(mode, pause_mode)
        check_version(version)
        c = self.cluster
        # Refused here at once if outside the weights root; each worker checks again on its own filesystem.
        path = checkpoint_path(path, c.config.engine.weights_root or default_weights_root(c.info.path))
        async with self._lock:
            if version <= self.version:
                raise NotNewer(f"weight version {version} is not newer than the version served, {self.version}")
            t0 = time.monotonic()
            workers = list(self.cluster.scaling.workers)
            if mode == "rolling":  # each worker reads and switches on its own
                results = await asyncio.gather(*(w.handle.update_weights.remote(path, version) for w in workers),
                                               return_exceptions=True)
                return self._switched(workers, version, path, mode, results, t0)
            # Read and convert everywhere first: a checkpoint one worker refuses is applied nowhere.
            await asyncio.gather(*(w.handle.stage_weights.remote(path, version) for w in workers))
            return await self._commit(workers, version, path, mode, pause_mode, wait_timeout_s, t0)

    async def _commit(self, workers: list, version: int, path: str | None, mode: str, pause_mode: str,
                      wait_timeout_s: float, t0: float) -> UpdateResult:
        """Under the lock: switch workers that hold `version` staged, in `mode`. path: its checkpoint, which a
        worker started from now loads (None: an update from a trainer's group, which has none)."""
        if mode == "rolling":
            results = await self._commit_all(workers, version)
        else:
            was_paused = self.paused
            if not was_paused:
                await self._pause(pause_mode, wait_timeout_s)
            try:
                results = await self._commit_all(workers, version)
            finally:
                if not was_paused:
                    await self._resume()
        return self._switched(workers, version, path, mode, results, t0)

    def _switched(self, workers: list, version: int, path: str | None, mode: str, results: list,
                  t0: float) -> UpdateResult:
        """The cluster serves `version` once any worker switched to it; a worker that did not (it died at its
        switch, or exited on a failed one) is replaced, loading this version."""
        reports = [r for r in results if isinstance(r, WeightUpdateReport)]
        failed = [(w, r) for w, r in zip(workers, results) if not isinstance(r, WeightUpdateReport)]
        if not reports:  # no worker switched: the update did not happen
            raise failed[0][1]
        for w, e in failed:
            log.warning("weight version %d: %s did not switch (%s); it is replaced", version, w.worker_id, cause_of(e))
        self._source = (path, version) if path is not None else None
        self.version = version
        result = UpdateResult(version, time.monotonic() - t0, tuple(reports))
        log.info("weight version %d from %s on %d workers (%s mode) in %.2f s", version,
                 path or "the trainer's group", len(workers), mode, result.seconds)
        return result

    async def catch_up(self, w) -> None:
        """A worker that has started, before it is routable: it loaded the configured model; it takes the version
        the cluster serves, from that update's checkpoint, or (a trainer's update has none) from a checkpoint a
        worker serving it writes, once per version."""
        async with self._lock:
            if self.version == 0:
                return
            if self._source is None:
                self._source = (await self._snapshot(), self.version)
            path, version = self._source
            log.info("worker %s catches up to weight version %d from %s", w.worker_id, version, path)
            # A checkpoint this router had written is its own (outside the weights root, wherever tempfile puts it).
            await w.handle.update_weights.remote(path, version, path == self._snapshot_dir)

    async def _snapshot(self) -> str:
        """A checkpoint of the version served, written by a worker that serves it (the previous one removed)."""
        import shutil
        import tempfile

        workers = [w for w in self.cluster.scaling.workers if w.alive]
        stats = await asyncio.gather(*(w.handle.stats.remote() for w in workers), return_exceptions=True)
        source = next((w for w, s in zip(workers, stats)
                       if not isinstance(s, BaseException) and s.weight_version == self.version
                       and self._ranks(w.pool) == 1), None)
        if source is None:
            raise RuntimeError(f"no worker serves weight version {self.version} to copy it from")
        if self._snapshot_dir is not None:
            shutil.rmtree(self._snapshot_dir, ignore_errors=True)
        self._snapshot_dir = tempfile.mkdtemp(prefix=f"pdserve-weights-v{self.version}-")
        await source.handle.export_weights.remote(self._snapshot_dir)
        return self._snapshot_dir

    def close(self) -> None:
        """Remove the checkpoint written for workers to catch up from, if any."""
        import shutil

        if self._snapshot_dir is not None:
            shutil.rmtree(self._snapshot_dir, ignore_errors=True)
            self._snapshot_dir = None

    @staticmethod
    async def _commit_all(workers: list, version: int) -> list:
        """Every worker's commit: its report, or the exception of one that failed (a worker that died)."""
        return await asyncio.gather(*(w.handle.commit_weights.remote(version) for w in workers),
                                    return_exceptions=True)

    # -- a trainer's weight group (pdserve.weights.group; the trainer's side: pdserve.weights.trainer) ------
    async def init_group(self, host: str, port: int, world_size: int, name: str,
                         timeout_s: float = 60.0) -> list[str]:
        """Every rank of every worker joins the trainer's group as ranks 1.. (the trainer joins as rank 0
        meanwhile; a tensor-parallel worker's ranks take consecutive ranks); the workers' ids in rank order.
        ValueError for a bad address or timeout, or a world_size that is not 1 + the workers' ranks.

        The join waits on the trainer (up to timeout_s) holding the group's own lock only: updates, pauses and
        workers catching up before they are routable (a replacement) go on meanwhile. A failed join says so
        without the address's details (they are logged): no port scans through the router."""
        from pdserve.weights.group import GroupAddress

        check_group(host, port, name, timeout_s)
        async with self._group_lock:
            await self._destroy_group()
            workers = sorted(self.cluster.scaling.workers, key=lambda w: w.worker_id)
            ranks = [self._ranks(w.pool) for w in workers]
            if world_size != 1 + sum(ranks):
                raise WorldChanged(f"world_size {world_size} does not match the trainer and the cluster's "
                                   f"{len(workers)} workers of {sum(ranks)} ranks ({1 + sum(ranks)})")
            return await self._join(workers, GroupAddress(host, port, world_size, name), 1, timeout_s)

    async def _join(self, workers: list, address, first: int, timeout_s: float) -> list[str]:
        """Under the group's lock: worker i's ranks join `address` from rank first + the ranks of the workers
        before it; the workers' ids in rank order, or GroupJoinFailed (no worker stays in the group)."""
        ranks = [self._ranks(w.pool) for w in workers]
        firsts = [first + sum(ranks[:i]) for i in range(len(workers))]
        results = await asyncio.gather(*(w.handle.join_weight_group.remote(address, f, timeout_s)
                                         for f, w in zip(firsts, workers)), return_exceptions=True)
        self._members = workers
        failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
        if failed:
            await self._destroy_group()
            for w, e in failed:
                log.warning("weight group %r: %s did not join: %s", address.name, w.worker_id, cause_of(e))
            raise GroupJoinFailed(f"{len(failed)} of {len(workers)} workers could not join the weight group "
                                  f"{address.name!r} within {timeout_s:g} s (the router's log says why)")
        return [w.worker_id for w in workers]

    async def begin(self, metas: list, version: int, bucket_bytes: int) -> None:
        """Check an update's tensors against the model (WeightError: nothing sent) and set every member
        receiving it."""
        from pdserve.weights.update import check_metas

        check_version(version)
        if not self._members or self.client_group:
            raise NoGroup("no weight group of pdserve's own: make one first (InitWeightGroup)")
        if version <= self.version:
            raise NotNewer(f"weight version {version} is not newer than the version served, {self.version}")
        if not 0 < bucket_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes must be in [1, {MAX_BUCKET_BYTES}] (each worker holds a bucket twice "
                             f"while it receives), got {bucket_bytes}")
        check_metas(metas, self.cluster.info.config)
        await asyncio.gather(*(w.handle.receive_weights.remote(metas, bucket_bytes, version)
                               for w in self._members))
        self._incoming = version

    async def finish(self, version: int, mode: str = "pause", pause_mode: str = "keep",
                     wait_timeout_s: float = 600.0) -> UpdateResult:
        """Wait for every member to hold the whole update, then switch them all (update()'s modes). A member
        whose receive failed fails the update: nothing is applied anywhere, and the group is torn down."""
        _check_modes(mode, pause_mode)
        check_version(version)
        if self._incoming != version:
            raise NoGroup(f"no update of version {version} is being received (BeginWeightUpdate first)")
        self._incoming = None
        members = self._members
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(w.handle.weights_received.remote(version) for w in members))
        except BaseException:
            async with self._group_lock:
                await self._destroy_group()
            raise
        async with self._lock:
            return await self._commit(members, version, None, mode, pause_mode, wait_timeout_s, t0)

    # -- a client's group, as the RL frameworks make it with SGLang (pdserve.weights.compat) ---------------
    async def init_client_group(self, host: str, port: int, rank_offset: int, world_size: int, name: str,
                                backend: str = "gloo", timeout_s: float = 60.0) -> list[str]:
        """Every rank of every worker joins a client's group by its rendezvous (torch's tcp:// store hosted by the
        trainer, rank 0), as ranks rank_offset.. in worker order (a tensor-parallel worker's ranks consecutive);
        the workers' ids in rank order. ValueError for a bad address, or ranks that do not fit world_size."""
        from pdserve.weights.compat import CompatAddress

        check_group(host, port, name, timeout_s)
        async with self._group_lock:
            await self._destroy_group()
            workers = sorted(self.cluster.scaling.workers, key=lambda w: w.worker_id)
            n = sum(self._ranks(w.pool) for w in workers)
            if not 1 <= rank_offset or rank_offset + n > world_size:
                raise WorldChanged(f"rank_offset {rank_offset} and world_size {world_size} leave no room for the "
                                   f"cluster's {n} ranks (rank 0 is the trainer's: rank_offset >= 1 and "
                                   f"rank_offset + {n} <= world_size)")
            address = CompatAddress(host, port, world_size, name, backend, MAX_GROUP_TIMEOUT_S)
            ids = await self._join(workers, address, rank_offset, timeout_s)
            self.client_group = name
            return ids

    async def receive_client_update(self, metas: list, version: int | None) -> UpdateResult | None:
        """One client call of an update on its group: metas (pdserve.weights.update.TensorMeta) in the order the
        trainer broadcasts them. Every member receives them and keeps them aside; the call that completes the
        model (every tensor it holds has arrived, in this call or earlier ones) stages and commits them all, as
        `version` (the client's; None: the update under way's, or the version served + 1): its result, else None.

        A call whose tensors do not fit the model (WeightError), or whose version is not newer (NotNewer), is
        refused: its tensors are still received (the trainer sends them whatever the answer) and dropped with the
        rest of the update under way; nothing is applied. A failed receive (the trainer gone) closes the group."""
        from pdserve.weights.compat import Announced, announced_bytes
        from pdserve.weights.update import check_metas, expected_tensors

        cfg = self.cluster.info.config
        async with self._group_lock:
            if not self._members or not self.client_group:
                raise NoGroup("no weight group made by a client: make one first (/init_weights_update_group)")
            under_way = self._compat
            version = version if version is not None else under_way[0] if under_way else self.version + 1
            try:
                check_version(version)
                if version <= self.version:
                    raise NotNewer(f"weight version {version} is not newer than the version served, {self.version}")
                applied = check_metas(metas, cfg)
            except ValueError:
                self._compat = None
                full = sum(math.prod(s) * 4 for s in expected_tensors(cfg).values())
                if announced_bytes(metas) <= full:  # drained, so the group stays in step with the trainer
                    await self._client_call(Announced(metas, discard=True), version)
                else:
                    await self._destroy_group()
                raise
            names = (under_way[1] if under_way else frozenset()) | {m.name.removeprefix("model.") for m in applied}
            last = names >= {k.removeprefix("model.") for k in expected_tensors(cfg)}
            t0 = time.monotonic()
            await self._client_call(Announced(metas, last=last), version)
            self._compat = None if last else (version, names)
            if not last:
                return None
            members = self._members
        async with self._lock:
            return await self._commit(members, version, None, "pause", "keep", MAX_WAIT_S, t0)

    async def commit_client_update(self) -> UpdateResult | None:
        """Stage and commit what a client's update under way has sent so far (the tensors not sent keep their
        values), as its version: a client that continues generation has sent all it will. None if no update is
        under way. The continue route calls it before it resumes the cluster."""
        from pdserve.weights.compat import Announced

        async with self._group_lock:
            under_way, self._compat = self._compat, None
            if under_way is None:
                return None
            t0 = time.monotonic()
            await self._client_call(Announced([], last=True), under_way[0])
            members = self._members
        async with self._lock:
            return await self._commit(members, under_way[0], None, "pause", "keep", MAX_WAIT_S, t0)

    async def _client_call(self, announced, version: int) -> None:
        """Under the group's lock: every member receives the announced tensors (Announced); a failure closes the
        group (the members that received drop what they kept) and raises."""
        members = self._members
        try:
            await asyncio.gather(*(w.handle.receive_weights.remote(announced, 1, version) for w in members))
            await asyncio.gather(*(w.handle.weights_received.remote(version) for w in members))
        except BaseException:
            await self._destroy_group()
            raise

    async def destroy_group(self) -> None:
        async with self._group_lock:
            await self._destroy_group()

    async def _destroy_group(self) -> None:
        members, self._members, self._incoming = self._members, [], None
        self.client_group, self._compat = None, None
        await asyncio.gather(*(w.handle.leave_weight_group.remote() for w in members if w.alive),
                             return_exceptions=True)

    async def pause(self, mode: str = "keep", wait_timeout_s: float = 600.0) -> None:
        """New requests wait until resume(); requests in flight: "keep" (the workers stop after their step under
        way; requests go on at resume), "wait" (returns once they have ended; TimeoutError after
        wait_timeout_s, still paused) or "abort" (they end now, FinishReason.ABORT)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        check_timeout("timeout_seconds", wait_timeout_s, MAX_WAIT_S)
        async with self._lock:
            self.paused = True
            await self._pause(mode, wait_timeout_s)

    async def resume(self) -> None:
        async with self._lock:
            self.paused = False
            await self._resume()

    async def _pause(self, mode: str, wait_timeout_s: float) -> None:
        c = self.cluster
        c.gate.clear()
        if mode == "abort":
            n = c.abort_all()
            log.info("paused: %d requests in flight aborted", n)
            mode = "wait"  # they end at their next wake-up
        if mode == "wait":
            await asyncio.wait_for(c.idle.wait(), wait_timeout_s)
        await asyncio.gather(*(w.handle.pause.remote() for w in c.scaling.workers))

    async def _resume(self) -> None:
        c = self.cluster
        await asyncio.gather(*(w.handle.resume.remote() for w in c.scaling.workers))
        c.gate.set()


def _check_modes(mode: str, pause_mode: str) -> None:
    if mode not in UPDATE_MODES:
        raise ValueError(f"mode must be one of {', '.join(UPDATE_MODES)}, got {mode!r}")
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")


def cause_of(e: BaseException) -> BaseException:
    """The worker's own exception behind a failed actor call (Ray wraps it)."""
    return getattr(e, "cause", None) or e
