"""The local engine's prefix cache: keys and values of prompt prefixes kept across requests,
so that a prompt whose leading tokens an earlier request computed prefills only the rest (the
samples of a GRPO group share their prompt; a resumed sample re-sends prompt + partial).

Keys. A prompt is cut into blocks of ``BLOCK_TOKENS`` tokens; a block is keyed by (its parent
block's slot, its tokens), so a key names a whole prefix and a lookup walks the prompt block
by block. The dict compares the tokens themselves, so two prefixes never alias (a hash of the
prefix, as vLLM keys blocks, would need a collision-free hash to say the same). Blocks rather
than a radix tree (SGLang) because a hit is copied into the row's contiguous cache: whole
blocks copy as one indexed op per hit, and a block-granular store is a fixed pool that
needs no allocator; a hit loses at most ``BLOCK_TOKENS - 1`` tokens to the block boundary.

Store. A pool of ``prefix_cache_tokens // BLOCK_TOKENS`` blocks laid out as the rows' cache
(:class:`KVCache` with ``BLOCK_TOKENS`` positions per slot). After each prefill pass the full
blocks of the admitted prompts go in (copied out of their rows), and so do those of rows an
interrupt stops (prompt + partial tokens, what a resumed request re-sends) and of rows of an
episode (``GenerateRequest.episode_id``) that finish (prompt + output: its next turn re-sends
them, the environment's tokens after); an admitted prompt's hit is copied into its row before
its pass, which then prefills only the remaining tokens, attending over the copied prefix
(``model.forward``'s ``cached`` positions).

Eviction and references. Least recently used first, among blocks no other block extends
(leaves) and no admission holds: a block's count of references is the admitted sequences
whose hit it is part of, from their admission until the step's inserts are done, so that
inserting one prompt's blocks never evicts a block another prompt of the same step is copying
from. A hit touches its blocks deepest first, so a parent is always more recent than its
children and leaves go first.

Episodes. A block an episode's row stored is tagged with the episode until the episode ends
(:meth:`end_episode`: nothing will re-send it): its blocks then move to the least recent end,
so that they are evicted before any other (only leaves are evicted, so a parent moved there
still waits for its children). Blocks the episode shares with others (its group's prompt,
stored by the prefill pass) are not tagged and keep their place.

Validity. An entry holds keys and values of the weights that computed it: the engine drops
the cache on a weight load unless ``engine.local.kv_on_load: keep`` keeps running rows' cache
too (one rule for both, in ``engine.py``).

Mirrors. A reader in another process (an engine actor's proxy, ``runtime/ray``) keeps a
:class:`PrefixIndex` of what this cache holds: with ``changes`` set, every block inserted,
evicted or dropped is logged in order, and the actor sends the log with its polls; the
mirror answers :meth:`held` as the cache did when the log was read.

Deliberately simplified: copies, not a paged cache (a row owns its positions); an ended
episode's blocks are demoted, not freed (one move each; a later prompt may still hit them).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollstream.config.engine import PREFIX_BLOCK_TOKENS
from rollstream.engine.local.jit import scripted
from rollstream.engine.local.model import KVCache
from rollstream.engine.local.routing import routing_table
from rollstream.engine.local.weights import ModelSpec

BLOCK_TOKENS = PREFIX_BLOCK_TOKENS  # tokens per cached block
COUNT_KEYS = ("prefix_query_tokens", "prefix_hit_tokens", "prefix_inserted_tokens",
              "prefix_evicted_tokens", "prefix_dropped_tokens", "prefix_copy_s")

Key = tuple[int, tuple[int, ...]]  # (parent slot or -1, the block's tokens)
Change = tuple[int, Key | None] | None  # (slot, key): inserted; (slot, None): evicted; None: all


def walk(index: dict[Key, int], tokens: Sequence[int]) -> list[int]:
    """Slots of the longest chain of whole blocks in ``index`` that starts ``tokens`` and
    leaves at least one token to compute (its logits sample the first new token)."""
    slots: list[int] = []
    parent = -1
    for i in range((len(tokens) - 1) // BLOCK_TOKENS):
        slot = index.get((parent, tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])))
        if slot is None:
            break
        slots.append(parent := slot)
    return slots


class PrefixIndex:
    """A mirror of a :class:`PrefixCache`'s keys kept from its ``changes`` (module
    docstring, "Mirrors"): what a request would find there, as of the last change applied."""

    def __init__(self) -> None:
        self.index: dict[Key, int] = {}
        self.keys: dict[int, Key] = {}

    def apply(self, changes: Sequence[Change]) -> None:
        for change in changes:
            if change is None:
                self.clear()
                continue
            slot, key = change
            old = self.keys.pop(slot, None)  # evicted, or the slot holds another block now
            if old is not None and self.index.get(old) == slot:
                del self.index[old]
            if key is not None:
                self.index[key], self.keys[slot] = slot, key

    def clear(self) -> None:
        self.index.clear()
        self.keys.clear()

    def held(self, tokens: Sequence[int]) -> int:
        return len(walk(self.index, tokens)) * BLOCK_TOKENS


@dataclass(slots=True, kw_only=True)
class Block:
    key: Key
    num_children: int = 0  # cached blocks that extend this one
    refs: int = 0  # admitted sequences holding it until the step's inserts are done
    episode: str | None = None  # the episode whose row stored it, until the episode ends


class PrefixCache:
    def __init__(self, spec: ModelSpec, budget_tokens: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        """``budget_tokens``: ``engine.local.prefix_cache_tokens`` (0: off, every lookup
        misses)."""
        self.block_tokens = BLOCK_TOKENS
        self.num_blocks = budget_tokens // BLOCK_TOKENS
        self.pool = (KVCache.allocate(spec, self.num_blocks, BLOCK_TOKENS, device, dtype)
                     if self.num_blocks else None)
        # mixture-of-experts models: each cached token's experts (a hit restores them with its
        # keys and values, so a request's routing covers the tokens it did not compute)
        self.experts = (routing_table(spec, (self.num_blocks, BLOCK_TOKENS), device)
                        if self.num_blocks and spec.moe is not None else None)
        self.index: dict[Key, int] = {}  # key -> slot
        self.blocks: dict[int, Block] = {}  # slot -> block
        self.lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.episodes: dict[str, set[int]] = {}  # episode id -> slots of its tagged blocks
        self.counts = dict.fromkeys(COUNT_KEYS, 0.0)
        self.changes: deque[Change] | None = None  # set by a mirror's owner: the log

    @property
    def on(self) -> bool:
        return self.num_blocks > 0

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Slots of the longest cached chain of whole blocks that starts ``tokens`` and
        leaves at least one token to compute (its logits sample the first new token)."""
        return walk(self.index, tokens) if self.on else []

    def held(self, tokens: Sequence[int]) -> int:
        """The tokens at the start of ``tokens`` cached now: what a request with this prompt
        would find and not prefill (:meth:`match`'s blocks; ``prefix_hit_tokens`` counts the
        same at admission). Only reads, each lookup one dict access, so another thread may
        ask (``LocalEngine.cached_tokens``: an answer as of some step)."""
        return len(self.match(tokens)) * BLOCK_TOKENS

    def next_key(self, tokens: Sequence[int], hit: list[int]) -> Key | None:
        """The key of the first whole block of ``tokens`` after ``hit`` (None: there is no
        whole block left): two prompts of one step with the same next key would compute the
        same block twice."""
        i = len(hit)
        if not self.on or (i + 1) * BLOCK_TOKENS > len(tokens):
            return None
        return (hit[-1] if hit else -1, tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]))

    def acquire(self, slots: list[int], num_query_tokens: int) -> None:
        """Hold the blocks of an admitted prompt's hit (until :meth:`release`) and count the
        lookup."""
        for slot in slots:
            self.blocks[slot].refs += 1
        self._touch(slots)
        self.counts["prefix_query_tokens"] += num_query_tokens
        self.counts["prefix_hit_tokens"] += len(slots) * BLOCK_TOKENS

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self.blocks[slot].refs -= 1

    def insert(self, tokens: Sequence[int], num_tokens: int,
               episode: str | None = None) -> list[tuple[int, int]]:
        """Add the whole blocks of ``tokens[:num_tokens]`` (positions whose keys and values a
        row holds) that are not cached yet, as far as room allows, the new ones tagged with
        ``episode``; returns (block index in the row, slot) for each block to copy in. The
        chain is held while it grows, so that making room never evicts its own parent."""
        if not self.on:
            return []
        parent, chain, new = -1, [], []
        try:
            for i in range(num_tokens // BLOCK_TOKENS):
                key = (parent, tuple(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]))
                slot = self.index.get(key)
                if slot is None:
                    slot = self._allocate()
                    if slot is None:
                        break
                    self.index[key] = slot
                    self._log((slot, key))
                    self.blocks[slot] = Block(key=key, episode=episode)
                    if episode is not None:
                        self.episodes.setdefault(episode, set()).add(slot)
                    if parent >= 0:
                        self.blocks[parent].num_children += 1
                    new.append((i, slot))
                self.blocks[slot].refs += 1
                chain.append(parent := slot)
        finally:
            self.release(chain)
        self._touch(chain)
        self.counts["prefix_inserted_tokens"] += len(new) * BLOCK_TOKENS
        return new

    def end_episode(self, episode: str) -> None:
        """The episode sends no more requests: its tagged blocks become the first evicted."""
        for slot in self.episodes.pop(episode, ()):
            self.blocks[slot].episode = None
            self.lru.move_to_end(slot, last=False)

    def clear(self) -> None:
        """Drop every entry (their keys and values are of weights no longer loaded)."""
        self.counts["prefix_dropped_tokens"] += len(self.blocks) * BLOCK_TOKENS
        self.index.clear()
        self.blocks.clear()
        self.lru.clear()
        self.episodes.clear()
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self._log(None)

    def _log(self, change: Change) -> None:
        if self.changes is not None:
            self.changes.append(change)

    def _touch(self, chain: list[int]) -> None:
        for slot in reversed(chain):  # deepest first: a parent stays more recent
            self.lru[slot] = None
            self.lru.move_to_end(slot)

    def _allocate(self) -> int | None:
        """A free slot, or the least recently used unheld leaf's, evicted; None when every
        block is held or extended."""
        if self.free:
            return self.free.pop()
        for slot in self.lru:
            block = self.blocks[slot]
            if block.refs == 0 and block.num_children == 0:
                del self.lru[slot], self.index[block.key], self.blocks[slot]
                self._log((slot, None))
                if block.episode is not None:
                    self._untag(block.episode, slot)
                if block.key[0] >= 0:
                    self.blocks[block.key[0]].num_children -= 1
                self.counts["prefix_evicted_tokens"] += BLOCK_TOKENS
                return slot
        return None

    def _untag(self, episode: str, slot: int) -> None:
        slots = self.episodes[episode]
        slots.discard(slot)
        if not slots:  # the map holds only episodes with blocks: bounded by the pool
            del self.episodes[episode]


def copy_blocks(src: KVCache, src_slot: torch.Tensor, src_pos: torch.Tensor, dst: KVCache,
                dst_slot: torch.Tensor, dst_pos: torch.Tensor) -> None:
    """Copy ``BLOCK_TOKENS`` positions from (``src_slot[i]``, ``src_pos[i]`` on) of ``src``
    to (``dst_slot[i]``, ``dst_pos[i]`` on) of ``dst``, every layer, keys and values: between
    the rows' cache and the pool, either way."""
    scripted(_copy_blocks)(src.kv, src.base, src_slot, src_pos, dst.kv, dst.base, dst_slot,
                           dst_pos, BLOCK_TOKENS)


def _copy_blocks(src_kv: torch.Tensor, src_base: torch.Tensor, src_slot: torch.Tensor,
                 src_pos: torch.Tensor, dst_kv: torch.Tensor, dst_base: torch.Tensor,
                 dst_slot: torch.Tensor, dst_pos: torch.Tensor, width: int) -> None:
    if src_slot.numel() == 0:
        return
    offsets = torch.arange(width, device=src_slot.device)
    heads = src_base.shape[1] * src_base.shape[2]  # k|v x kv heads
    src_at = ((src_base[src_slot] + src_pos[:, None, None]).view(-1, heads, 1) + offsets)
    dst_at = ((dst_base[dst_slot] + dst_pos[:, None, None]).view(-1, heads, 1) + offsets)
    src_flat = src_kv.view(src_kv.shape[0], -1, src_kv.shape[-1])  # [layers, N, d]
    dst_flat = dst_kv.view(dst_kv.shape[0], -1, dst_kv.shape[-1])
    dst_flat.index_copy_(1, dst_at.reshape(-1), src_flat.index_select(1, src_at.reshape(-1)))
