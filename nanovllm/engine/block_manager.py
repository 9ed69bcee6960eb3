"""Paged KV-cache bookkeeping: ref-counted blocks, and a prefix cache keyed by chained block hashes.

A block holds `block_size` consecutive tokens of one or more sequences (shared prefixes share blocks).
Once all of a block's tokens have K/V computed, the block is registered under the hash of (parent
block's hash, its tokens); a later request whose prompt starts with the same tokens reuses it. A hit is
accepted only if the stored tokens and parent hash match too, so a hash collision can never serve
wrong K/V.

Blocks whose ref count drops to zero go to the back of the free queue but keep their contents and hash
until they are handed out again (LRU eviction), so a finished request's prefix stays reusable.

An optional `BlockEvents` listener hears every change to the prefix cache, in order: blocks entered under their
hashes (stored), hashes dropped when their blocks are handed out again (removed), and a reset (cleared).
`engine/kv_events.py` publishes them for prefix-aware routers; without a listener nothing is recorded.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Protocol

import xxhash

from nanovllm.engine.sequence import Sequence


def hash_block(parent: int | None, token_ids) -> int:
    h = xxhash.xxh64()
    h.update((parent if parent is not None else 0).to_bytes(8, "little", signed=False))
    h.update(array("i", token_ids).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def forget(self) -> None:
        self.hash = self.parent_hash = self.token_ids = None


class BlockEvents(Protocol):
    """Hears the prefix cache change (engine/kv_events.py). Called on the engine's thread; must not block."""

    def stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[tuple[int, ...]]) -> None:
        """Blocks entered under `block_hashes`, a chain: each block's parent is the one before it, the first's is
        `parent_hash` (None: it starts a sequence). `token_ids`: each block's tokens."""

    def removed(self, block_hashes: list[int]) -> None:
        """These hashes left the cache (their blocks were handed out for new tokens)."""

    def cleared(self) -> None:
        """Every hash left the cache (reset_prefix_cache)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: BlockEvents | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evict first
        self.hash_to_block: dict[int, int] = {}
        self.events = events
        # counters for metrics
        self.prefix_queries = 0
        self.prefix_hits = 0

    # --- queries ------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Blocks already holding a prefix of `seq.token_ids`, and their hashes.

        At least one token is always left to compute (a full hit still recomputes its last token, whose
        logits are needed to sample the next one). A sequence that wants its prompt's log-probabilities gets no
        hit.
        """
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return [], []  # (prompt log-probabilities need every prompt row computed)
        bs = self.block_size
        hits: list[int] = []
        hashes: list[int] = []
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, toks)
            bid = self.hash_to_block.get(h)
            if bid is None:
                break
            blk = self.blocks[bid]
            if blk.token_ids != toks or blk.parent_hash != parent:
                break
            hits.append(bid)
            hashes.append(h)
            parent = h
        return hits, hashes

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Can a new sequence reusing `hits` get blocks for its first `num_tokens` tokens?"""
        need = self.blocks_for(num_tokens) - len(hits)
        hits_in_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return len(self.free) - hits_in_free >= need

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Can `seq`'s block table be extended to cover `num_tokens` tokens?"""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self.free)

    # --- mutations ----------------------------------------------------------------------------------
    def admit(self, seq: Sequence, hits: list[int], hashes: list[int]) -> None:
        """Attach cached blocks to a sequence with no blocks; its computed tokens start after them."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already holds blocks")
        self.prefix_queries += 1
        self.prefix_hits += bool(hits)
        for bid in hits:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self.free[bid]
            blk.ref_count += 1
        seq.block_table = list(hits)
        seq.block_hashes = list(hashes)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table with fresh blocks so it covers `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:  # (a decode step, mostly)
            return
        if need > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {need}, have {len(self.free)}")
        events = self.events
        evicted: list[int] = []
        for _ in range(need):
            bid, _ = self.free.popitem(last=False)
            blk = self.blocks[bid]
            if blk.hash is not None and self.hash_to_block.get(blk.hash) == bid:
                del self.hash_to_block[blk.hash]
                if events is not None:
                    evicted.append(blk.hash)
            blk.forget()
            blk.ref_count = 1
            seq.block_table.append(bid)
        if evicted:
            events.removed(evicted)

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks (finish, abort or preemption)."""
        # tail blocks first: they are the least likely to be shared, so they are evicted first
        for bid in reversed(seq.block_table):
            blk = self.blocks[bid]
            if blk.ref_count <= 0:
                raise RuntimeError(f"block {bid} freed twice")
            blk.ref_count -= 1
            if blk.ref_count == 0:
                if blk.hash is None:
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)  # holds nothing reusable: hand out first
                else:
                    self.free[bid] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter `seq`'s newly completed blocks (all tokens computed) into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if n_full <= seq.num_hashed_blocks:  # no block completed since the last call (most steps)
            return
        events = self.events
        chain: list[int] = []   # (with a listener) the blocks entered since the last one that was not
        chain_toks: list[tuple[int, ...]] = []
        chain_parent = None
        for i in range(seq.num_hashed_blocks, n_full):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = seq.block_hashes[i - 1] if i > 0 else None
            h = hash_block(parent, toks)
            seq.block_hashes.append(h)
            blk = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and blk.hash is None:
                self.hash_to_block[h] = blk.block_id
                blk.hash, blk.parent_hash, blk.token_ids = h, parent, toks
                if events is not None:
                    if not chain:
                        chain_parent = parent
                    chain.append(h)
                    chain_toks.append(toks)
            elif chain:   # (another block holds this hash already) the chain of new blocks breaks here
                events.stored(chain, chain_parent, chain_toks)
                chain, chain_toks = [], []
        if chain:
            events.stored(chain, chain_parent, chain_toks)
        seq.num_hashed_blocks = n_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`). Only while no sequence holds a block: returns
        False, changing nothing, otherwise."""
        if len(self.free) != self.num_blocks:
            return False
        for blk in self.blocks:
            blk.forget()
        self.hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def check_invariants(self, live: list[Sequence]) -> None:
        """For tests: ref counts equal the number of live tables holding each block; free list consistent."""
        counts = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        for blk in self.blocks:
            if blk.ref_count != counts[blk.block_id]:
                raise AssertionError(f"block {blk.block_id}: ref_count {blk.ref_count} != "
                                     f"holders {counts[blk.block_id]}")
            if (blk.ref_count == 0) != (blk.block_id in self.free):
                raise AssertionError(f"block {blk.block_id}: ref_count {blk.ref_count} but "
                                     f"in_free={blk.block_id in self.free}")
        for h, b in self.hash_to_block.items():
            if self.blocks[b].hash != h:
                raise AssertionError(f"hash table points {h} at block {b} holding {self.blocks[b].hash}")
