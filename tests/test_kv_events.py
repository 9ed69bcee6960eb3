"""KV-cache events: a ZMQ subscriber follows the prefix cache through a run with prefix hits and evictions; the bytes
have vLLM's layout (and decode with vLLM's msgspec structs); a full queue drops batches instead of stalling a step;
bad configurations are rejected."""
from __future__ import annotations

import sys
import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.config import EngineArgs, KVEventsConfig  # noqa: E402
from nanovllm.engine import kv_events  # noqa: E402
from nanovllm.engine.block_manager import hash_block  # noqa: E402

BS = 16


class Subscriber:
    """What a router runs: a SUB socket on the engine's PUB endpoint, and a DEALER on its replay endpoint (a REQ
    socket would take only the first batch of a replay)."""

    def __init__(self, ctx, topic: bytes, endpoint: str, replay: str):
        self.topic = topic
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        assert monitor.poll(5000), "could not connect to the engine's PUB socket"   # (then it has our subscription)
        self.sub.disable_monitor()
        monitor.close(linger=0)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.batches: dict[int, bytes] = {}

    def drain(self, until_seq: int, timeout: float = 5.0) -> None:
        """Receive until batch `until_seq - 1` has arrived (or the timeout passes)."""
        deadline = time.monotonic() + timeout
        while (not self.batches or max(self.batches) < until_seq - 1) and time.monotonic() < deadline:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == self.topic and len(seq) == 8
                self.batches[int.from_bytes(seq, "big")] = payload

    def ask_replay(self, start: int) -> dict[int, bytes]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        got = {}
        while self.replay.poll(2000):
            empty, seq, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return got
            got[seq] = payload
        raise AssertionError("no end-of-replay marker")


def check_layout(batch) -> list:
    """vLLM's KVEventBatch as a positional array: [ts, events, data_parallel_rank]; each event tagged by name."""
    assert isinstance(batch, list) and len(batch) == 3
    ts, events, dp_rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 60 and dp_rank == 0 and events
    for ev in events:
        if ev[0] == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = ev
            assert hashes and all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
            assert parent is None or isinstance(parent, int)
            assert len(tokens) == BS * len(hashes) and all(isinstance(t, int) for t in tokens)
            assert (block_size, lora_id, medium, lora_name) == (BS, None, "GPU", None)
        elif ev[0] == "BlockRemoved":
            _, hashes, medium = ev
            assert hashes and all(isinstance(h, int) for h in hashes) and medium == "GPU"
        else:
            assert ev == ["AllBlocksCleared"]
    return events


def test_subscriber_follows_the_prefix_cache(tiny_ckpt, tmp_path):
    ctx = zmq.Context()
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": f"ipc://{tmp_path}/r",
           "topic": "kv"}   # (a free port)
    llm = LLM(tiny_ckpt(), device="cpu", kvcache_block_size=BS, num_kvcache_blocks=14, max_model_len=128,
              max_num_seqs=4, kv_events_config=cfg)
    bm, pub = llm.engine.block_manager, llm.engine.kv_events
    sub = Subscriber(ctx, b"kv", pub.endpoint, pub.replay_endpoint)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        system = list(range(100, 148))   # three full blocks every prompt of a round shares
        for r in range(4):   # each round's other prompts push the last round's blocks out (14 blocks)
            prompts = [system + [200 + r * 10 + i] * 21 for i in range(3)] + [[300 + r] * 40]
            llm.generate(prompts, params, use_tqdm=False)
        assert bm.prefix_hits > 0
        sub.drain(pub.num_batches)
        live = dict(sub.batches)
        # a subscriber that joined late (a PUB socket drops what it sends before the subscription reaches it) asks
        # for what it missed; here: everything kept
        replayed = sub.ask_replay(0)
        assert set(replayed) == set(range(pub.num_batches))
        assert all(live[s] == payload for s, payload in replayed.items() if s in live) and live
        batches = replayed

        cached: set[int] = set()
        num_removed = 0
        for seq in range(pub.num_batches):
            for ev in check_layout(msgpack.unpackb(batches[seq])):
                if ev[0] == "BlockStored":
                    _, hashes, parent, tokens = ev[:4]
                    for i, h in enumerate(hashes):   # the chain: each block's hash from its parent's and its tokens
                        assert h == hash_block(parent, tokens[i * BS:(i + 1) * BS]) and h not in cached
                        cached.add(h)
                        parent = h
                elif ev[0] == "BlockRemoved":
                    assert set(ev[1]) <= cached
                    cached -= set(ev[1])
                    num_removed += len(ev[1])
        assert num_removed > 0   # the cache was too small for the run: blocks were evicted
        assert cached == set(bm.hash_to_block) and cached

        n = pub.num_batches
        assert llm.reset_prefix_cache() and not bm.hash_to_block
        sub.drain(n + 1)
        assert check_layout(msgpack.unpackb(sub.batches[n])) == [["AllBlocksCleared"]]
    finally:
        llm.shutdown()
        sub.sub.close(linger=0)
        sub.replay.close(linger=0)
        ctx.term()


STORED = kv_events.BlockStored([11, 12], 10, [tuple(range(16)), tuple(range(16, 32))], 16)
EVENTS = [STORED, kv_events.BlockRemoved([10]), kv_events.AllBlocksCleared()]


def test_decodes_with_vllms_msgspec_structs():
    """vLLM's structs as its subscriber example declares them: the positional layout, and the map layout of vLLM's
    newer releases (events as maps in the positional batch)."""
    msgspec = pytest.importorskip("msgspec")

    def structs(array_like: bool):
        opts = {"array_like": array_like, "omit_defaults": True, "gc": False, "tag": True}
        stored = msgspec.defstruct("BlockStored", [
            ("block_hashes", list[int]), ("parent_block_hash", int | None), ("token_ids", list[int]),
            ("block_size", int), ("lora_id", int | None), ("medium", str | None), ("lora_name", str | None)], **opts)
        removed = msgspec.defstruct("BlockRemoved", [("block_hashes", list[int]), ("medium", str | None)], **opts)
        cleared = msgspec.defstruct("AllBlocksCleared", [], **opts)
        return msgspec.defstruct("KVEventBatch", [
            ("ts", float), ("events", list[stored | removed | cleared]), ("data_parallel_rank", int | None, None)],
            array_like=True, omit_defaults=True, gc=False)

    for encoding in ("array", "map"):
        batch = msgspec.msgpack.decode(kv_events.encode_batch(12.5, EVENTS, 3, encoding == "map"),
                                       type=structs(encoding == "array"))
        assert batch.ts == 12.5 and batch.data_parallel_rank == 3
        stored, removed, cleared = batch.events
        assert type(stored).__name__ == "BlockStored" and stored.block_hashes == [11, 12]
        assert stored.parent_block_hash == 10 and stored.token_ids == list(range(32)) and stored.block_size == 16
        assert (stored.lora_id, stored.medium, stored.lora_name) == (None, "GPU", None)
        assert type(removed).__name__ == "BlockRemoved" and removed.block_hashes == [10] and removed.medium == "GPU"
        assert type(cleared).__name__ == "AllBlocksCleared"
    assert msgpack.unpackb(kv_events.encode_batch(1.0, EVENTS[1:2], 0, True))[1] == [
        {"type": "BlockRemoved", "block_hashes": [10], "medium": "GPU"}]


def test_full_queue_drops_instead_of_blocking(monkeypatch):
    """The publisher thread stuck on one batch (a subscriber can never slow it: PUB drops at the high-water mark,
    but encoding or a slow host can): the engine's steps go on and the overflow is dropped, counted, numbered."""
    entered, release = threading.Event(), threading.Event()
    real = kv_events.encode_batch

    def stuck(*a, **kw):
        entered.set()
        release.wait(5)
        return real(*a, **kw)

    monkeypatch.setattr(kv_events, "encode_batch", stuck)
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:9", max_queue_size=2, hwm=1)
    pub = kv_events.KVEventPublisher.create(cfg, 16)
    try:
        t = time.perf_counter()
        for i in range(200):
            pub.removed([i])
            pub.end_step()
            if i == 0:   # the thread took the first batch and sits on it
                assert entered.wait(5)
        assert time.perf_counter() - t < 1.0
        assert pub.num_batches == 200 and pub.num_dropped == 200 - 1 - 2
    finally:
        release.set()
        pub.shutdown()


def test_missing_dependency_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)   # as if pyzmq were not installed
    with pytest.raises(ImportError, match=r"pip install 'nanovllm\[kv-events\]' \(missing: zmq\)"):
        kv_events.KVEventPublisher.create(KVEventsConfig(enable_kv_cache_events=True), 16)


def test_endpoint_in_use_is_a_clear_error():
    first = kv_events.KVEventPublisher.create(KVEventsConfig(enable_kv_cache_events=True,
                                                             endpoint="tcp://127.0.0.1:*"), 16)
    try:
        with pytest.raises(OSError, match=r"cannot bind 'tcp://\*:\d+' \(Address already in use\)"):
            kv_events.KVEventPublisher.create(KVEventsConfig(enable_kv_cache_events=True,
                                                             endpoint=first.endpoint.replace("127.0.0.1", "*")), 16)
    finally:
        first.shutdown()


@pytest.mark.parametrize("bad, key", [
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
    ({"endpoint": "localhost:5557"}, "endpoint"),
    ({"replay_endpoint": "tcp://*:5557"}, "replay_endpoint"),     # the endpoint's own address
    ({"hwm": 0}, "hwm"),
    ({"buffer_steps": True}, "buffer_steps"),
    ({"topic": 5}, "topic"),
    ({"encoding": "json"}, "encoding"),
    ({"enable_kv_cache_event": True}, "enable_kv_cache_event"),  # a misspelled key is not ignored
])
def test_bad_config_is_a_value_error(bad, key):
    with pytest.raises(ValueError, match=key):
        EngineArgs(model=".", kv_events_config=bad)
    with pytest.raises(TypeError, match="kv_events_config"):
        EngineArgs(model=".", kv_events_config="tcp://*:5557")


def test_config_defaults_and_cli():
    from nanovllm.cli import build_parser
    from nanovllm.server.cli import server_engine_args
    assert not KVEventsConfig().publishes and not KVEventsConfig(publisher="zmq").publishes   # off by default
    assert KVEventsConfig(enable_kv_cache_events=True).publishes                              # vLLM: zmq when on
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    assert kv_events.KVEventPublisher.create(None, 16) is None
    assert kv_events.offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert kv_events.offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    ns = build_parser().parse_args(["serve", "m", "--kv-events-config",
                                    '{"enable_kv_cache_events": true, "topic": "kv-events"}'])
    args = server_engine_args(ns)
    assert KVEventsConfig.from_dict(args.kv_events_config) == KVEventsConfig(enable_kv_cache_events=True,
                                                                             topic="kv-events")
