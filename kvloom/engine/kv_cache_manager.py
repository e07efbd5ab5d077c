"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, no tensors.

Blocks are numbered 1..num_blocks-1; block 0 is the null block, never handed out, that pads
block tables (its KV stays zero, so padded attention reads finite values).

Prefix caching: a full block is named by a chained hash of (previous block's hash, its token ids).
A freed block keeps its hash and stays findable until it is handed out again; free blocks are
reused in LRU order (the least recently freed first), so hot prefixes survive longest. A request
frees its blocks tail first, so its unshared tail is reused before its shared head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvloom.engine.request import Request

NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int | tuple[str, int]]) -> int:
    return hash((parent_hash, tuple(token_ids)))


def _chain_start(request: Request) -> int | None:
    """The parent of a request's first block: None for the base model; with a LoRA adapter, a key of the
    adapter, so the same tokens under two adapters (whose KV differs) never share a block and every block of
    an adapter's chain is its own."""
    lora = request.lora_request
    return None if lora is None else hash(("lora", lora.lora_int_id, lora.lora_name))


class KVCacheBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        # The tokens of a hashed block, checked on a hit so a hash collision cannot alias blocks.
        self.token_ids: tuple[int | tuple[str, int], ...] | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 name_with_next_token: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # EAGLE: a block's last position holds the head's KV of (that position, the token after it), so a block
        # is named by its tokens and the one after them: a hit is a block computed before the same next token
        # (named once that token is known), and another request that diverges right after it misses it.
        self.name_with_next_token = name_with_next_token
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, KVCacheBlock] = {}
        # Prefix-cache counters (in tokens), read by the metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its known tokens (and, with
        ``name_with_next_token``, whose next token is known)."""
        tokens = request.all_token_ids
        size = self.block_size
        extra = 1 if self.name_with_next_token else 0
        while (len(request.block_hashes) + 1) * size + extra <= len(tokens):
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else _chain_start(request)
            request.block_hashes.append(hash_block_tokens(parent, self._named_tokens(request, i)))

    def _named_tokens(self, request: Request, i: int) -> tuple[int | tuple[str, int], ...]:
        """What names block i of the request: its tokens (and the one after them), and for each image whose
        rows reach into the block, its content hash and where it starts relative to the block: every image's
        tokens are the same ids, so without them two prompts with different images would share blocks."""
        size = self.block_size
        end = (i + 1) * size + (1 if self.name_with_next_token else 0)
        named = tuple(request.all_token_ids[i * size:end])
        if request.mm_features:
            named += tuple((f.content_hash, f.offset - i * size) for f in request.mm_features
                           if f.offset < end and f.end > i * size)
        return named

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes the request, and its token count.

        The last token is never served from the cache: it must be computed to give logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.cached.get(block_hash)
            if block is None or block.token_ids != self._named_tokens(request, i):
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup whose request was admitted (a request that waits for blocks is counted once)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None, num_lookahead_tokens: int = 0) -> bool:
        """Make request.block_ids cover num_computed_tokens + num_new_tokens. False if out of blocks.

        computed_blocks are prefix-cache hits (from get_computed_blocks) for a request with no
        blocks yet; they are shared, not copied. ``num_lookahead_tokens`` more slots are covered too
        (not computed, never named in the prefix cache): a draft model writes its guesses there.
        """
        num_tokens = request.num_computed_tokens + num_new_tokens
        if not computed_blocks and num_tokens + num_lookahead_tokens <= len(request.block_ids) * self.block_size:
            # The common decode step: the held blocks have room. Name a block that just filled up.
            if self.enable_prefix_caching and num_tokens // self.block_size > request.num_cached_blocks:
                self._cache_full_blocks(request, num_tokens)
            return True
        computed_blocks = computed_blocks or []
        if computed_blocks:
            num_tokens += len(computed_blocks) * self.block_size
        num_new_blocks = (self.blocks_needed(num_tokens + num_lookahead_tokens) - len(request.block_ids)
                          - len(computed_blocks))
        # Hits that sit in the free queue must come out of it too.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_new_blocks > self.num_free_blocks - num_evictable_hits:
            return False
        for block in computed_blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
            request.block_ids.append(block.block_id)
        for _ in range(max(num_new_blocks, 0)):
            block = self._pop_free_block()
            block.ref_count = 1
            request.block_ids.append(block.block_id)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, num_tokens)
        return True

    def _pop_free_block(self) -> KVCacheBlock:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            # Evict: the block's contents are about to be overwritten.
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        return block

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name the blocks that are full once num_tokens are computed, so others can share them."""
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        # Blocks before num_cached_blocks were named at an earlier step: only the new ones are visited.
        for i in range(request.num_cached_blocks, num_full):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                continue
            block_hash = request.block_hashes[i]
            block.block_hash = block_hash
            block.token_ids = self._named_tokens(request, i)
            self.cached.setdefault(block_hash, block)
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so shared heads stay cached longest."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None or not self.enable_prefix_caching:
                    # Unnamed blocks hold nothing reusable: hand them out first.
                    self.free_queue[block_id] = block
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self.free_queue[block_id] = block
        request.block_ids = []
        request.num_cached_blocks = 0

    def check_integrity(self) -> None:
        """Raise if the bookkeeping is inconsistent (used by tests)."""
        for block in self.blocks[1:]:
            in_free = block.block_id in self.free_queue
            if (block.ref_count == 0) != in_free:
                raise RuntimeError(f"block {block.block_id}: ref_count {block.ref_count}, free={in_free}")
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id}: negative ref_count")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"cached map names block {block.block_id} under a stale hash")
