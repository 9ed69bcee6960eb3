"""KV-cache events in vLLM's wire format: what the prefix cache stored and dropped, for prefix-aware routers.

The block manager calls the publisher's `BlockEvents` hooks (engine/block_manager.py) as blocks enter the prefix
cache (BlockStored), leave it (BlockRemoved) or it is reset (AllBlocksCleared). The engine calls `end_step` once per
step: the step's events become one batch with the next sequence number, handed to a background thread through a
bounded queue (full: the batch is dropped and counted; the step never waits). The thread encodes each batch with
msgpack, as vLLM's msgspec structs encode it:

    batch:  [ts, [event, ...], data_parallel_rank]
    events ("array" encoding):  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                                 medium, lora_name]
                                ["BlockRemoved", block_hashes, medium]
                                ["AllBlocksCleared"]
            ("map" encoding):   {"type": "BlockStored", "block_hashes": ..., ...}, the same fields by name

and sends it on a ZMQ PUB socket as three frames (topic, 8-byte big-endian sequence number, payload). PUB never
blocks: a slow subscriber loses messages past the high-water mark and sees a gap in the sequence numbers. With a
`replay_endpoint`, a ROUTER socket answers a request (a start sequence number, 8 bytes big-endian) with each kept
batch from there as (sequence number, payload), then (-1, b"").

pyzmq and msgpack are imported only when events are enabled (the `kv-events` extra).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from nanovllm.config import KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache (the only tier here, whatever the device)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
INSTALL_HINT = "kv_events_config needs pyzmq and msgpack: pip install 'nanovllm[kv-events]'"


@dataclass(frozen=True)
class BlockStored:
    """A chain of blocks entered into the cache: block i's parent is block i - 1, the first's `parent_block_hash`
    (None: the first block of a sequence). `token_blocks`: each block's token ids (flattened on the wire)."""
    block_hashes: list[int]
    parent_block_hash: int | None
    token_blocks: list[tuple[int, ...]]
    block_size: int

    @property
    def token_ids(self) -> list[int]:
        return list(itertools.chain.from_iterable(self.token_blocks))

    def wire(self, as_map: bool):
        if as_map:
            return {"type": "BlockStored", "block_hashes": self.block_hashes,
                    "parent_block_hash": self.parent_block_hash, "token_ids": self.token_ids,
                    "block_size": self.block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None}
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size, None,
                MEDIUM, None]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]

    def wire(self, as_map: bool):
        if as_map:
            return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": MEDIUM}
        return ["BlockRemoved", self.block_hashes, MEDIUM]


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self, as_map: bool):
        return {"type": "AllBlocksCleared"} if as_map else ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int, as_map: bool = False) -> bytes:
    """One batch's payload: msgpack of [ts, events, data_parallel_rank], as vLLM's KVEventBatch encodes."""
    import msgpack
    return msgpack.packb([ts, [e.wire(as_map) for e in events], data_parallel_rank], use_bin_type=True)


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule for data-parallel replicas on one host: rank r publishes on the endpoint's port + r (tcp), or
    on the address with `_dp{r}` appended (ipc, inproc)."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_config endpoint {endpoint!r} needs a port to offset by the data-parallel "
                             f"rank")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's convention: bind a wildcard or local address, connect to a named host."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The block manager's `BlockEvents` listener and the publisher of its events (see the module docstring).

    Events are collected on the engine's thread; `end_step` queues them as one batch; the thread `nanovllm-kv-events`
    owns the sockets from then on. `shutdown` sends what is queued (for up to a second) and closes the sockets."""

    SHUTDOWN_TIMEOUT = 1.0

    def __init__(self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0):
        try:
            import msgpack  # noqa: F401
            import zmq
        except ImportError as e:
            raise ImportError(f"{INSTALL_HINT} (missing: {e.name})") from e
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._as_map = config.encoding == "map"
        self._pending: list[KVEvent] = []
        self._seq = 0                 # the next batch's sequence number
        self.num_dropped = 0          # batches dropped because the queue was full
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._open(zmq.PUB, self.endpoint, config.hwm)
            if self.replay_endpoint is not None:
                self._replay = self._open(zmq.ROUTER, self.replay_endpoint, None, bind=True)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            if _binds(self.endpoint):   # the address bound ("tcp://127.0.0.1:*" picks a free port)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        except OSError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="nanovllm-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s%s", self.endpoint,
                    f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    @classmethod
    def create(cls, config: KVEventsConfig | None, block_size: int, data_parallel_rank: int = 0
               ) -> KVEventPublisher | None:
        """The publisher `config` asks for; None without one (not enabled, or publisher "null")."""
        if config is None or not config.publishes:
            return None
        return cls(config, block_size, data_parallel_rank)

    def _open(self, kind, endpoint: str, hwm: int | None, bind: bool | None = None):
        import zmq
        sock = self._ctx.socket(kind)
        if hwm is not None:
            sock.setsockopt(zmq.SNDHWM, hwm)
        bind = bind or (bind is None and _binds(endpoint))
        try:
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise OSError(e.errno, f"kv_events_config: cannot {'bind' if bind else 'connect'} {endpoint!r} "
                                   f"({e.strerror.split(' (addr=')[0]}); choose another address") from e
        return sock

    # --- BlockEvents (the engine's thread) ---------------------------------------------------------
    def stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[tuple[int, ...]]) -> None:
        self._pending.append(BlockStored(block_hashes, parent_hash, token_ids, self.block_size))

    def removed(self, block_hashes: list[int]) -> None:
        self._pending.append(BlockRemoved(block_hashes))

    def cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    @property
    def num_batches(self) -> int:
        """Batches numbered so far (sent, queued or dropped): the next batch's sequence number."""
        return self._seq

    def end_step(self) -> None:
        """Queue the step's events as one batch (nothing if there were none); never blocks."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV-cache event queue full: %d batch(es) dropped so far", self.num_dropped)

    # --- the publisher thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    logger.exception("KV-cache event replay failed")
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
            else:
                item = self._queue.get()
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = encode_batch(ts, events, self.data_parallel_rank, self._as_map)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                if self._replay is not None:
                    self._replay_buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - never take the engine down over an event
                logger.exception("publishing KV-cache event batch %d failed", seq)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV-cache event replay request (%d frames)", len(frames))
            return
        client, empty, start = frames
        start = int.from_bytes(start, "big")
        for seq, payload in self._replay_buffer:
            if seq >= start:
                self._replay.send_multipart((client, empty, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, empty, END_OF_REPLAY, b""))

    def shutdown(self) -> None:
        """Send the last step's events and what is queued (up to SHUTDOWN_TIMEOUT), then close the sockets."""
        if self._thread is None:
            return
        self.end_step()
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():   # still sending: its sockets stay open until the process exits
            logger.warning("KV-cache event publisher did not finish within %.1fs", self.SHUTDOWN_TIMEOUT)
        else:
            self._close_sockets()
        self._thread = None

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=100)   # ms: what is sent reaches connected subscribers; a gone one cannot hold us
        self._ctx.term()
