"""The hand-off protocol (pdserve.transfer.protocol, .sender, .receiver) over a real gloo pair: a pusher
and an intake in one process.

The sender's and the receiver's channels are two ranks of one two-rank gloo group, built by two threads
of this process at once (as two workers would); announcements go through a hook that may reorder or
hold them, where a cluster sends them as Ray calls.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.faults import FaultPoints
from pdserve.transfer.channel import RECEIVER_RANK, SENDER_RANK, PairChannel, StoreServer
from pdserve.transfer.protocol import KVAnnounce, KVMac, layer_spans, num_parts_for
from pdserve.transfer.receiver import InboundTable, KVIntake
from pdserve.transfer.sender import KVPusher, PushJob

from conftest import wait_for

LAYERS, KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 5, 2, 24, 4, 8
TIMEOUT_S = 10.0


KEY = b"the cluster's KV checksum key"


class Pair:
    """A pusher (prefill side) and an intake (decode side) joined like two workers would be."""

    def __init__(self, hold_announcements: bool = False, min_part_bytes: int = 1, checksum: bool = True,
                 sender_key: bytes = KEY):
        g = torch.Generator().manual_seed(1)
        self.src = torch.randn(LAYERS, 2, KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=g)
        self.dst = torch.zeros_like(self.src)
        self.store = StoreServer("127.0.0.1")
        self.table = InboundTable()
        self.events: list[tuple] = []
        self.lock = threading.Lock()
        self.held: list[KVAnnounce] = []
        self.hold = hold_announcements
        self.generations: list[int] = []
        self.announced: list[KVAnnounce] = []  # as the pusher built them
        self.versions: dict[str, int] = {}  # request -> the weight version its landing reported
        self.faults = FaultPoints()
        mac = KVMac(KEY) if checksum else None  # the cluster's key, on both sides
        self.intake = KVIntake("p0", "d0", self.dst, self.table, TIMEOUT_S,
                               landed=lambda rid, tok, at, v: self._landed(rid, tok, v),
                               failed=lambda rid, err: self._record("failed", rid, err),
                               cancelled=lambda rid: self._record("cancelled", rid), checksum=mac)
        self.pusher = KVPusher("p0", "d0", self.src, self._open_pair, self._announce,
                               done=lambda job, err: self._record("done", job.request_ids, err),
                               min_part_bytes=min_part_bytes, checksum=KVMac(sender_key) if checksum else None,
                               faults=self.faults)

    def _record(self, *event) -> None:
        with self.lock:
            self.events.append(event)

    def _landed(self, rid: str, tokens: tuple[int, ...], version: int) -> None:
        with self.lock:
            self.versions[rid] = version
        self._record("landed", rid, tokens)

    def _announce(self, a: KVAnnounce) -> None:
        self.announced.append(a)
        if self.hold:
            self.held.append(a)
        else:
            self.intake.announce(a)

    def release_announcements(self, order) -> None:
        for a in order(self.held):
            self.intake.announce(a)
        self.held.clear()

    def _open_pair(self, generation: int) -> PairChannel:
        self.generations.append(generation)

        def receiver() -> None:
            self.intake.install(PairChannel(self.store.host, self.store.port, "p0", "d0", RECEIVER_RANK, TIMEOUT_S,
                                            generation=generation), generation)

        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(receiver)
            channel = PairChannel(self.store.host, self.store.port, "p0", "d0", SENDER_RANK, TIMEOUT_S,
                                  generation=generation)
            fut.result(TIMEOUT_S)
        return channel

    def of(self, kind: str) -> list[tuple]:
        with self.lock:
            return [e for e in self.events if e[0] == kind]

    def close(self) -> None:
        self.pusher.stop()
        self.intake.stop()
        self.store.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def reserve(pair: Pair, rid: str, blocks: list[int]) -> None:
    pair.table.publish(rid, blocks)


def assert_moved(pair: Pair, src: list[int], dst: list[int]) -> None:
    assert torch.equal(pair.dst[:, :, :, dst], pair.src[:, :, :, src])


def test_layer_spans_and_part_sizes():
    assert layer_spans(4, 1) == [(0, 4)]
    assert layer_spans(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert layer_spans(30, 4) == [(0, 7), (7, 15), (15, 22), (22, 30)]
    assert num_parts_for(30, 4 << 20) == 30  # big layers: one part each
    assert num_parts_for(30, 200 << 10) == 5  # 6 layers make a MiB
    assert num_parts_for(30, 1) == 1


def test_layer_by_layer_push_lands_exact_kv_and_tokens(pair):
    reserve(pair, "a", [10, 11])
    reserve(pair, "b", [3])
    job = PushJob("d0", ["a", "b"], [[0, 1], [5]], LAYERS)  # nothing computed yet
    pair.pusher.push(job)
    assert job.num_parts == LAYERS  # min_part_bytes=1: a part per layer
    for layer in range(LAYERS):
        job.layer_done(layer)
    job.sampled([42, 7])
    wait_for(lambda: len(pair.of("landed")) == 2, TIMEOUT_S, what="both requests to land")
    assert [e[1:] for e in pair.of("landed")] == [("a", (42,)), ("b", (7,))]
    assert pair.of("done") == [("done", ("a", "b"), None)]
    assert_moved(pair, [0, 1, 5], [10, 11, 3])
    assert len(pair.table) == 0


def test_each_requests_weight_version_travels_with_its_kv(pair):
    """A push of HELD KV may mix requests computed before and after a weight update: the announce carries
    each request's version (a group's n first tokens under one), and landed reports each request's."""
    for rid, blocks in (("a", [10]), ("b", [11]), ("c", [12])):
        reserve(pair, rid, blocks)
    pair.pusher.push(PushJob("d0", ["a", "b", "c"], [[0], [1], [2]], LAYERS, LAYERS, [5, 50, 6, 7], None,
                             samples=[2, 1, 1], versions=[1, 0, 3]))
    wait_for(lambda: len(pair.of("landed")) == 3, TIMEOUT_S, what="three requests to land")
    assert pair.announced[-1].versions == (1, 0, 3)
    assert [e[1:] for e in pair.of("landed")] == [("a", (5, 50)), ("b", (6,)), ("c", (7,))]
    assert pair.versions == {"a": 1, "b": 0, "c": 3}
    assert_moved(pair, [0, 1, 2], [10, 11, 12])


def test_a_push_all_of_version_0_is_announced_in_the_old_form(pair):
    reserve(pair, "a", [3])
    job = PushJob("d0", ["a"], [[4]], LAYERS, LAYERS, [9], None, versions=[0])
    assert job.versions == ()
    pair.pusher.push(job)
    wait_for(lambda: pair.of("landed"), TIMEOUT_S, what="the request to land")
    assert pair.announced == [KVAnnounce("p0", 1, 0, ("a",), (1,), 1, True)]  # no versions: all 0
    assert pair.versions == {"a": 0}
    with pytest.raises(ValueError, match="2 versions for 1 requests"):
        PushJob("d0", ["a"], [[4]], LAYERS, versions=[1, 2])


def test_held_kv_is_pushed_with_the_version_that_computed_it():
    """The prefill worker's pushes of HELD KV: one per service tier, each request with its own version (KV
    held across a weight update keeps the version that computed it)."""
    from types import SimpleNamespace

    from prefill_worker.actor import PrefillActor, _HeldKV

    actor = SimpleNamespace(core=SimpleNamespace(model_config=SimpleNamespace(num_layers=LAYERS)))
    items = [("a", _HeldKV([1], (5,), 1.0, 1, 3, 0)), ("b", _HeldKV([2, 3], (6, 60), 2.0, 1, 9, 1)),
             ("c", _HeldKV([4], (7,), 2.0, 0, 9, 1))]
    jobs = PrefillActor._held_jobs(actor, "d0", items)
    assert [(j.request_ids, j.samples, j.versions) for j in jobs] == [(("c",), (), (1,)),
                                                                       (("a", "b"), (1, 2), (0, 1))]


def test_parts_of_several_layers():
    layer_bytes = 2 * KV_HEADS * 2 * BLOCK_SIZE * HEAD_DIM * 4  # K and V of 2 blocks, fp32
    pair = Pair(min_part_bytes=2 * layer_bytes)  # two layers a part at least
    try:
        reserve(pair, "a", [4, 5])
        job = PushJob("d0", ["a"], [[8, 9]], LAYERS)
        pair.pusher.push(job)
        assert job.num_parts == 2  # layers [0, 2) and [2, 5): parts of unequal length
        for layer in range(LAYERS):
            job.layer_done(layer)
        job.sampled([3])
        wait_for(lambda: pair.of("landed"), TIMEOUT_S, what="the request to land")
        assert_moved(pair, [8, 9], [4, 5])
    finally:
        pair.close()


def test_announcements_out_of_order_are_received_in_the_senders_order():
    """The intake takes transfers in (generation, seq) order whatever order their announcements arrive in
    (Ray calls to an async actor carry no order). The pusher announces each as it sends it, so the
    transfers are sent here by hand, announced in reverse."""
    pair = Pair()
    try:
        pair.pusher.stop()  # sends by hand below
        announces = [KVAnnounce("p0", 1, i, (f"r{i}",), (1,), 1, True) for i in range(4)]
        for i in range(4):
            reserve(pair, f"r{i}", [i])
        for a in reversed(announces):
            pair.intake.announce(a)
        for i, a in enumerate(announces):
            pair.pusher._send(a, PushJob("d0", [f"r{i}"], [[10 + i]], LAYERS, LAYERS, [i], None))
        wait_for(lambda: len(pair.of("landed")) == 4, TIMEOUT_S, what="four transfers")
        assert [e[1] for e in pair.of("landed")] == ["r0", "r1", "r2", "r3"]
        assert_moved(pair, [10, 11, 12, 13], [0, 1, 2, 3])
    finally:
        pair.close()


def test_queued_pushes_go_by_service_tier_then_queue_order(pair):
    """While a push is under way, the next ones queue; they go priority, default, flex, each in order."""
    for i in range(5):
        reserve(pair, f"r{i}", [i])
    first = PushJob("d0", ["r0"], [[10]], LAYERS, tier=1)  # no layer computed yet: the pusher waits on it
    pair.pusher.push(first)
    wait_for(lambda: len(pair.of("landed")) == 0 and pair.generations, TIMEOUT_S, what="the first push to start")
    for i, tier in ((1, 2), (2, 1), (3, 0), (4, 2)):  # flex, default, priority, flex
        pair.pusher.push(PushJob("d0", [f"r{i}"], [[10 + i]], LAYERS, LAYERS, [i], None, tier=tier))
    for layer in range(LAYERS):
        first.layer_done(layer)
    first.sampled([0])
    wait_for(lambda: len(pair.of("landed")) == 5, TIMEOUT_S, what="five transfers")
    assert [e[1] for e in pair.of("landed")] == ["r0", "r3", "r2", "r1", "r4"]
    assert_moved(pair, [10, 11, 12, 13, 14], [0, 1, 2, 3, 4])


def test_cancel_during_the_write_keeps_blocks_until_it_is_over(pair):
    reserve(pair, "a", [2, 3])
    reserve(pair, "b", [4])
    job = PushJob("d0", ["a", "b"], [[0, 1], [6]], LAYERS)
    pair.pusher.push(job)
    job.layer_done(0)
    wait_for(lambda: pair.table.receiving("a"), TIMEOUT_S, what="the intake to claim the transfer")
    assert pair.table.withdraw("a") is False  # being written: not free yet
    for layer in range(1, LAYERS):
        job.layer_done(layer)
    job.sampled([1, 2])
    wait_for(lambda: len(pair.events) >= 3, TIMEOUT_S, what="the transfer to end")
    assert pair.of("cancelled") == [("cancelled", "a")]
    assert [e[1] for e in pair.of("landed")] == ["b"]
    # Withdrawn before its turn: no callback at all, its bytes go nowhere.
    reserve(pair, "c", [7])
    assert pair.table.withdraw("c") is True
    pair.pusher.push(PushJob("d0", ["c"], [[8]], LAYERS, LAYERS, [3], None))
    wait_for(lambda: len(pair.of("done")) == 2, TIMEOUT_S, what="the second push")
    assert not pair.dst[:, :, :, 7].any() and pair.of("landed") == [("landed", "b", (2,))]


def test_failed_push_fails_both_sides_and_the_next_generation_works(pair):
    reserve(pair, "a", [1])
    reserve(pair, "b", [2])
    failing = PushJob("d0", ["a"], [[0]], LAYERS)
    pair.pusher.push(failing)
    pair.pusher.push(PushJob("d0", ["b"], [[4]], LAYERS, LAYERS, [9], None))  # announced on the same channel
    failing.layer_done(0)
    wait_for(lambda: pair.table.receiving("a"), TIMEOUT_S, what="the first transfer to start")
    failing.abort("the prefill step failed")
    wait_for(lambda: pair.of("landed"), TIMEOUT_S * 2, what="the second request to land on a new channel")
    assert pair.of("failed")[0][1] == "a" and [e[1:] for e in pair.of("landed")] == [("b", (9,))]
    assert pair.of("done")[0][1:2] == (("a",),) and pair.of("done")[0][2] is not None
    assert pair.generations == [1, 2]  # "b" was announced again on generation 2
    assert_moved(pair, [4], [2])


def test_checksum_sees_a_flipped_bit_and_a_misplaced_block():
    g = torch.Generator().manual_seed(3)
    mac, other = KVMac(KEY), KVMac(b"another cluster's key")
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(LAYERS, 2, KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=g).to(dtype)
        base = mac.checksum(kv)
        assert base.dtype == torch.int64 and base.dim() == 0
        assert mac.checksum(kv.clone()) == base
        flipped = kv.clone()
        flipped.view(-1)[1234:1235].view(torch.uint8)[0] ^= 1  # the lowest bit of one value
        assert mac.checksum(flipped) != base
        swapped = kv.clone()
        swapped[:, :, :, [2, 7]] = kv[:, :, :, [7, 2]]  # two blocks in each other's place
        assert mac.checksum(swapped) != base
        within = kv.clone()  # two values of one row in each other's place: an unkeyed row sum missed it
        within[0, 0, 0, 0, 0, [0, 1]] = kv[0, 0, 0, 0, 0, [1, 0]]
        assert mac.checksum(within) != base or torch.equal(within, kv)
        # Keyed: another key gives another sum, and the tag binds the channel and the transfer.
        assert other.checksum(kv) != base
        t = int(base)
        assert mac.tag("pair/p0/d0/1", 3, t) != other.tag("pair/p0/d0/1", 3, t)
        assert mac.tag("pair/p0/d0/1", 3, t) != mac.tag("pair/p0/d0/1", 4, t) != mac.tag("pair/p0/d1/1", 3, t)


def test_corrupted_transfer_fails_its_requests_and_the_channel_goes_on(pair):
    reserve(pair, "a", [1])
    pair.faults.arm("corrupt")
    pair.pusher.push(PushJob("d0", ["a"], [[0]], LAYERS, LAYERS, [5], None))
    wait_for(lambda: pair.of("failed"), TIMEOUT_S, what="the corrupted transfer to fail")
    assert pair.of("failed")[0][1] == "a" and "checksum" in pair.of("failed")[0][2]
    assert pair.of("done") == [("done", ("a",), None)]  # the sender sent it all: it frees its side
    reserve(pair, "b", [2])
    pair.pusher.push(PushJob("d0", ["b"], [[4]], LAYERS, LAYERS, [9], None))
    wait_for(lambda: pair.of("landed"), TIMEOUT_S, what="the next transfer to land")
    assert [e[1:] for e in pair.of("landed")] == [("b", (9,))]
    assert pair.generations == [1]  # everything arrived, so the channel was kept
    assert_moved(pair, [4], [2])


def test_a_transfer_checksummed_without_the_clusters_key_is_refused():
    """Finding 10: the checksum was unkeyed, so whoever could alter a transfer could compute its checksum
    again. A sender (or anyone on the wire) without the cluster's key cannot make one the decode worker takes."""
    pair = Pair(sender_key=b"not the cluster's key at all")
    try:
        reserve(pair, "a", [1])
        pair.pusher.push(PushJob("d0", ["a"], [[0]], LAYERS, LAYERS, [5], None))
        wait_for(lambda: pair.of("failed"), TIMEOUT_S, what="the transfer to fail")
        assert pair.of("failed")[0][1] == "a" and "checksum" in pair.of("failed")[0][2]
        assert not pair.of("landed")
    finally:
        pair.close()


def test_push_without_checksum():
    pair = Pair(checksum=False)
    try:
        reserve(pair, "a", [1, 2])
        pair.faults.arm("corrupt")  # nothing checks: the flipped bit lands (what the checksum is for)
        pair.pusher.push(PushJob("d0", ["a"], [[3, 4]], LAYERS, LAYERS, [5], None))
        wait_for(lambda: pair.of("landed"), TIMEOUT_S, what="the transfer to land")
        assert not torch.equal(pair.dst[:, :, :, [1, 2]], pair.src[:, :, :, [3, 4]])
        assert (pair.dst[:, :, :, [1, 2]] != pair.src[:, :, :, [3, 4]]).sum() == 1
    finally:
        pair.close()


def test_a_stopped_pusher_fails_new_jobs_at_once(pair):
    pair.pusher.stop()
    pair.pusher.push(PushJob("d0", ["a"], [[0]], LAYERS, LAYERS, [5], None))
    (done,) = pair.of("done")
    assert done[1] == ("a",) and "gone" in done[2]


def test_inbound_table_states():
    t = InboundTable()
    t.publish("a", [1, 2])
    assert t.claim("a") == [1, 2] and t.claim("x") is None
    assert t.withdraw("a") is False and t.expire("a") is False  # being written
    assert t.settle("a") is True  # it was cancelled meanwhile
    t.publish("b", [3])
    assert t.expire("b") is True and t.claim("b") is None
    assert len(t) == 0


def test_unreachable_decode_worker_fails_every_queued_job_at_once():
    done: list[tuple] = []
    calls = []
    all_queued = threading.Event()

    def open_pair(generation: int) -> PairChannel:
        calls.append(generation)
        all_queued.wait(TIMEOUT_S)
        raise TimeoutError("rendezvous timed out")

    src = torch.zeros(LAYERS, 2, KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM)
    pusher = KVPusher("p0", "d0", src, open_pair, announce=lambda a: None,
                      done=lambda job, err: done.append((job.request_ids, err)))
    try:
        for i in range(3):
            pusher.push(PushJob("d0", [f"r{i}"], [[i]], LAYERS, LAYERS, [i], None))
        all_queued.set()
        wait_for(lambda: len(done) == 3, TIMEOUT_S, what="every job to fail")
        assert [d[0] for d in done] == [("r0",), ("r1",), ("r2",)]
        assert all("no channel to d0" in d[1] for d in done)
        assert calls == [1]  # one rendezvous tried, not one per job
    finally:
        pusher.stop()


def test_parts_go_out_as_layers_finish_before_the_tokens_exist(pair):
    reserve(pair, "a", [6, 7])
    job = PushJob("d0", ["a"], [[1, 2]], LAYERS)
    pair.pusher.push(job)
    for layer in range(LAYERS):
        job.layer_done(layer)
    # Every KV part has arrived while the step is still "sampling": only the trailer is missing.
    wait_for(lambda: torch.equal(pair.dst[:, :, :, [6, 7]], pair.src[:, :, :, [1, 2]]), TIMEOUT_S,
             what="the KV parts before the tokens")
    assert pair.of("landed") == []
    job.sampled([5])
    wait_for(lambda: pair.of("landed"), TIMEOUT_S, what="the request to land")


@pytest.mark.parametrize("skip", [0, 1])
def test_a_prefill_step_tells_its_pushes_of_every_layer(skip):
    """The prefill worker's per-layer hook: a push started before the forward hears of each layer, and
    names the engine step about to run (a TP worker's other ranks wait for that step's layers). A partial
    hand-off's push leaves out the leading blocks its decode worker holds (PrefillTask.skip_blocks)."""
    from types import SimpleNamespace

    from pdserve.engine.chunk import Chunk
    from pdserve.engine.request import Request
    from pdserve.engine.sampling import SamplingParams
    from prefill_worker.actor import PrefillActor, _StepPushes

    pushed: list[PushJob] = []
    # The prefill worker's hand-off state, as the step's claim (PrefillActor._claim_ready) takes from it: a's
    # decode worker has reserved its room.
    hand_off = SimpleNamespace(_lock=threading.Lock(), _ready={"a": (0.0, "d0")}, _pushing=set())
    core = SimpleNamespace(model_config=SimpleNamespace(num_layers=LAYERS), runner=SimpleNamespace(steps=6),
                           kv=SimpleNamespace(blocks_needed=lambda n: -(-n // BLOCK_SIZE)))
    req = Request("a", list(range(6)), SamplingParams(), 0)
    req.block_ids = [3, 4]
    req.kv_version = 4  # the weights this step computes with
    step = SimpleNamespace(requests=[req], chunks=[Chunk(list(range(6)), 0, [3, 4], SamplingParams())])
    pushes = _StepPushes(step, core, {"a": skip}, True, lambda rids: PrefillActor._claim_ready(hand_off, rids),
                         pushed.append)
    pushes.layer_done(-1)
    (job,) = pushed
    assert job.block_ids == [[3, 4][skip:]] and hand_off._pushing == {"a"} and hand_off._ready == {} and job.step == 7
    assert job.destination == "d0"  # the decode worker that reserved its room
    assert job.versions == (4,)
    for layer in range(LAYERS):
        pushes.layer_done(layer)
        job.wait_layers(layer + 1, 0.01)  # reported at once: a layer not reported would time out here
    pushes.sampled({"a": [11]})
    assert job.wait_tokens(0.01)[0] == [11]


def test_fault_points_let_the_first_hits_pass():
    faults = FaultPoints()
    assert not faults.hit("step")  # nothing armed
    faults.arm("corrupt", count=2, skip=3)
    assert [faults.hit("corrupt") for _ in range(6)] == [False] * 3 + [True] * 2 + [False]
    assert faults.wait_reached("corrupt", 0)
    faults.arm("step", skip=1)
    assert not faults.hit("step") and not faults.wait_reached("step", 0)  # a pass is not the moment
    assert faults.hit("step") and faults.wait_reached("step", 0)
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.arm("nowhere")
    with pytest.raises(ValueError, match="count"):
        faults.arm("step", count=0)


def test_a_held_fault_point_waits_for_its_release():
    """Armed with math.inf, a hit stays at the point until the test releases it: reached, not passed."""
    faults = FaultPoints()
    faults.arm("step", math.inf)
    hit = threading.Thread(target=faults.hit, args=("step",))
    hit.start()
    assert faults.wait_reached("step", 30)
    hit.join(0.2)
    assert hit.is_alive()  # held there, however long the test takes
    faults.release("step")
    hit.join(30)
    assert not hit.is_alive()
    faults.arm("step", math.inf)  # armed again: held again (the last release does not carry over)
    hit = threading.Thread(target=faults.hit, args=("step",))
    hit.start()
    assert faults.wait_reached("step", 30)
    hit.join(0.2)
    assert hit.is_alive()
    faults.release("step")
    hit.join(30)
    assert not hit.is_alive()
