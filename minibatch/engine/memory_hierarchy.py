"""The KV cache as a memory hierarchy: who is swapped out and in, what goes to the host tier and comes back.

The scheduler (``scheduler.py``) asks this module at four moments of a step; the host pool (``kv/host_pool.py``)
keeps the host block ids, the block allocator the device ones, and the model runner does the copies that the
``SchedulerOutput`` lists, all before the forward, in this order (so no copy reads a block another one writes):

    1. device -> host   blocks_to_swap_out, blocks_to_offload     (swap_out: one index copy a layer)
    2. host -> device   blocks_to_swap_in, blocks_to_load         (swap_in)
    3. device -> device cow_copies                                (copy-on-write)
    4. the forward

**Preemption by swapping** (PagedAttention, Kwon et al. SOSP'23, §4.5; vLLM V0's ``PreemptionMode.SWAP``).
Before the batch is chosen, while the running sequences' next tokens need more device blocks than are free, the
least important *request* is swapped out whole: all its sequences together, a block they share copied once.
When the swap space cannot hold it, it is preempted by recompute instead (``recomputed_instead`` in the trace);
the engine never aborts for it (vLLM V0 did: its issue #588). A step that swaps nothing out swaps requests back
in, in queue order, while their blocks fit beside the running set's next ones (V0's rule: never both ways in one
step). The paper's admission rule holds: while any request is swapped out, no new one is admitted, so the swap
space never needs more blocks than the device pool.

**The host tier of the prefix cache** (vLLM V1's ``OffloadingConnector``; SGLang's HiCache). Full computed
blocks are copied to the host tier under their chained hash, either once they are full ("write_through", vLLM's
connector: each newly full block is stored eagerly) or when the device pool evicts them ("write_back", SGLang's
default: a copy only for what is about to be lost). At admission, a prompt whose prefix misses the device pool
past its device hits looks the next blocks up in the tier and loads the run it finds back into the blocks the
allocator just gave it, instead of prefilling it. The chained hash stays the one key; the tier verifies a hit's
tokens, so only a 64-bit hash collision of a parent could pass a wrong block (the device cache's serials
rule even that out; the tier's entries outlive the serials).
"""
from __future__ import annotations

import functools

from minibatch.engine.sequence import SequenceStatus
from minibatch.kv.block_pool import hash_block_tokens
from minibatch.kv.host_pool import HostBlockPool

PREEMPTION_MODES = ("recompute", "swap")
WRITE_POLICIES = ("write_through", "write_back")


class MemoryHierarchy:
    def __init__(self, host: HostBlockPool, preemption_mode: str = "recompute",
                 write_policy: str = "write_through"):
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {preemption_mode!r}; choose one of {list(PREEMPTION_MODES)}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown kv_offload_write_policy {write_policy!r}; choose one of {list(WRITE_POLICIES)}")
        self.host, self.preemption_mode, self.write_policy = host, preemption_mode, write_policy
        self.swapped: list = []           # [Request] swapped out, in the order they left
        self._offloaded: dict = {}        # seq id -> its leading cached blocks already offered to the tier
        self._pending: list = []          # (device block, host block) tier copies for the next step's out
        self._hashes: dict = {}           # seq id -> the chained hashes of its leading full pages, as computed
        self.num_swapped_out = self.num_swapped_in = self.num_recomputed_instead = 0   # cumulative, sequences

    @property
    def offloading(self) -> bool:
        return self.host.num_offload_blocks > 0

    def bind(self, allocator) -> None:
        if self.offloading and self.write_policy == "write_back":
            if getattr(allocator, "prefix_cache", "hash") != "hash":
                raise ValueError("kv_offload_write_policy='write_back' needs prefix_cache='hash' (the radix tree's "
                                 "evictions do not report their pages yet); use 'write_through' with the radix cache")
            allocator.on_evict = self._on_evict

    def _page_hashes(self, seq, n: int) -> list:
        """The chained hashes (the prefix cache's key, ``hash_block_tokens``) of the first ``n`` full pages of
        ``seq``'s tokens: the host tier's keys, the same whichever index (hash chain or radix tree) the device uses."""
        bs, hs = self.host.block_size, self._hashes.setdefault(seq.seq_id, [])
        for i in range(len(hs), n):
            hs.append(hash_block_tokens(hs[-1] if hs else None, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return hs[:n]

    # -- moment 1: before the batch is chosen -----------------------------------------------------------------
    def before_fill(self, sched, out) -> None:
        self.host.begin_step()
        out.blocks_to_offload, self._pending = self._pending, []     # stored when last step's blocks filled
        if self.preemption_mode != "swap":
            return
        self._make_room(sched, out)
        if not out.swapped_out and not out.preempted:
            self._swap_in(sched, out)

    def after_fill(self, sched, out) -> None:
        out.blocks_to_offload += self._pending                      # write-back: blocks evicted while filling
        self._pending = []

    @staticmethod
    def _next_blocks(a, seqs) -> int:
        """Device blocks these sequences' next decode takes (its token and drafts; +1 to copy a shared last block).
        A prefill chunk takes none: its blocks were allocated at admission."""
        need = 0
        for s in seqs:
            if s.num_uncomputed_tokens != 1:
                continue
            slots, table = a.num_slots(s.seq_id), a.block_table(s.seq_id)
            need += a.blocks_needed(slots + 1 + len(s.spec_token_ids)) - len(table)
            need += bool(slots % a.block_size and a.ref_count(table[-1]) > 1)
        return need

    def _make_room(self, sched, out) -> None:
        a = sched.allocator
        while sched.running and self._next_blocks(a, sched.running) > a.num_free_blocks:
            req = max(sched.running, key=sched.waiting.key).request     # the least important request
            seqs = [s for s in sched.running if s.request is req]
            if len(seqs) == len(sched.running) and len(seqs) > 1:
                # one request alone (n > 1) outgrows the pool: swapping it whole frees nothing it could use, so
                # its least important sequence is recomputed, today's per-sequence move
                seqs = seqs[-1:]
            tables = {s.seq_id: a.block_table(s.seq_id) for s in seqs}
            if len(seqs) == len(sched.running) or not self.host.can_swap_out(tables):
                for s in seqs:                                          # the swap space is full: recompute
                    sched._preempt(s, out)
                    out.recomputed_instead.append(s)
                self.num_recomputed_instead += len(seqs)
                continue
            out.blocks_to_swap_out += a.swap_out(list(tables), self.host)
            for s in seqs:
                sched.running.remove(s)
                self._offloaded.pop(s.seq_id, None)
                self._hashes.pop(s.seq_id, None)
                s.status, s.num_swaps = SequenceStatus.SWAPPED, s.num_swaps + 1
                s.clear_spec()
                out.swapped_out.append(s)
            self.num_swapped_out += len(seqs)
            self.swapped.append(req)

    def _swap_in(self, sched, out) -> None:
        a = sched.allocator
        free = a.num_free_blocks - self._next_blocks(a, sched.running)
        for req in sorted(self.swapped, key=lambda r: sched.waiting.key(r.seqs[0])):
            seqs = [s for s in req.seqs if self.host.is_swapped(s.seq_id)]
            need = a.blocks_to_swap_in([s.seq_id for s in seqs], self.host) + len(seqs)   # + each one's next block
            if need > free or sched._seats(sched.running) + sched._seats(seqs) > sched.max_num_seqs:
                break                                                    # in order: the head waits
            out.blocks_to_swap_in += a.swap_in([s.seq_id for s in seqs], self.host)
            for s in seqs:
                s.status = SequenceStatus.RUNNING
                sched.running.append(s)
                out.swapped_in.append(s)
            self.swapped.remove(req)
            self.num_swapped_in += len(seqs)
            free -= need

    def admission_paused(self) -> bool:
        """The paper's rule: nothing new is admitted while a request is swapped out."""
        return bool(self.swapped)

    # -- moment 2: admission (load-back) -----------------------------------------------------------------------
    def load_back(self, a, seq, cached: int, out) -> int:
        """After ``allocate`` found ``cached`` tokens on the device: the run of the next full blocks that the host
        tier holds is copied back into the blocks just allocated for them, and registered as computed. Returns the
        tokens loaded (whole blocks; the last token is always computed, as on the device)."""
        if not self.offloading:
            return 0
        bs, table = a.block_size, a.block_table(seq.seq_id)
        hashes = self._page_hashes(seq, cached // bs)
        parent, pairs = (hashes[-1] if hashes else None), []
        for i in range(cached // bs, (len(seq) - 1) // bs):
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block_tokens(parent, chunk)
            self.host.offload_queries += 1
            hb = self.host.lookup(h, chunk)
            if hb is None:
                break
            pairs.append((hb, table[i]))
            parent = h
        if pairs:
            self.host.offload_hits += len(pairs)
            out.blocks_to_load += pairs
            a.mark_computed(seq.seq_id, cached + len(pairs) * bs, seq.token_ids)
        return len(pairs) * bs

    # -- moment 3: blocks became full and computed (write-through) -------------------------------------------------
    def offload(self, a, seq) -> None:
        if not self.offloading or self.write_policy != "write_through" or not a.has_seq(seq.seq_id):
            return
        n = a.num_cached_blocks(seq.seq_id)
        del self._hashes.setdefault(seq.seq_id, [])[n:]                  # a rollback may have shortened the chain
        hashes = self._page_hashes(seq, n)
        done = min(self._offloaded.get(seq.seq_id, 0), len(hashes))
        if done == len(hashes):
            self._offloaded[seq.seq_id] = done
            return
        bs, table = a.block_size, a.block_table(seq.seq_id)
        for i in range(done, len(hashes)):
            hb = self.host.store(hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if hb is not None:
                self._pending.append((table[i], hb))
        self._offloaded[seq.seq_id] = len(hashes)

    def _on_evict(self, block: int, entry) -> None:
        """Write-back: a cached device block is about to be reused; keep a copy in the tier (read before the
        step's forward overwrites it)."""
        hb = self.host.store(entry.block_hash, entry.tokens)
        if hb is not None:
            self._pending.append((block, hb))

    # -- moment 4: a sequence leaves ---------------------------------------------------------------------------
    def forget(self, seq) -> None:
        """Finished, aborted or preempted: its tier watermark goes, and a swapped-out sequence's host blocks."""
        self._offloaded.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        if self.host.is_swapped(seq.seq_id):
            self.host.drop(seq.seq_id)
            if not any(self.host.is_swapped(s.seq_id) for s in seq.request.seqs):
                self.swapped = [r for r in self.swapped if r is not seq.request]


# -- the command lines' flags (generate and serve), vLLM's names ---------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute",
                   help="a full KV cache preempts by recompute (free, prefill again) or swap (to host memory and back)")
    p.add_argument("--swap-space", type=float, default=None,
                   help="GiB of host memory for swapped-out blocks (default: as many blocks as the device pool)")
    p.add_argument("--kv-offload-space", type=float, default=0.0,
                   help="GiB of host memory for the prefix cache's host tier (0: none)")
    p.add_argument("--kv-offload-write-policy", choices=WRITE_POLICIES, default="write_through",
                   help="copy full blocks to the host tier as they fill, or when the device pool evicts them")


def config_kwargs(args) -> dict:
    get = functools.partial(getattr, args)
    return dict(preemption_mode=get("preemption_mode", "recompute"), swap_space=get("swap_space", None),
                kv_offload_space=get("kv_offload_space", 0.0),
                kv_offload_write_policy=get("kv_offload_write_policy", "write_through"))


def summary(engine) -> str:
    """One line of what the hierarchy did in a run (the command line prints it), or '' without one."""
    h = engine.scheduler.hierarchy
    if h is None:
        return ""
    p = engine.host_pool
    return (f"# memory hierarchy: {h.num_swapped_out} sequences swapped out, {h.num_swapped_in} swapped in, "
            f"{h.num_recomputed_instead} recomputed instead (swap space full); host tier: {p.offload_hits} of "
            f"{p.offload_queries} blocks looked up loaded back, {p.offload_stores} stored")
