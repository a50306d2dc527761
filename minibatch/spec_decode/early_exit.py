"""Early exit, self-speculative (LayerSkip, Elhoushi et al. 2024 §4; Kangaroo, Liu et al. 2024): the target's
own first E layers draft.

The draft is the target cut short: its first E blocks, a light adapter trained to stand in for the
rest (``minibatch/model/heads.py`` ``ExitAdapter``), then the target's ln_f and tied LM head. So it adds
only the adapter's parameters, and shares everything else with the target, *including the KV cache*:
for every token the target has computed, what the draft's first E layers would compute is exactly what
the target's first E layers did compute, and it lies in the target's blocks already. The drafter reads
them in place through the target's block table: no prefill of its own, no cache of its own to keep in
step, nothing to free.

Each step it runs k passes of E blocks, one token per sequence each: the last sampled token, then its
own drafts. Their K/V go to scratch blocks (``scratch.py``), never into the target's blocks.

Which of LayerSkip's two variants this is (§4.2): **reuse** (its single KV cache and exit query cache), by
default. For the verify's rows m .. m+k (the last sampled token at m, then the k drafts), the drafter
already ran the first k through blocks 0 .. E-1, feeding the very same tokens at the very same positions
over the very same context: what it computed there *is* what the target's first E layers compute for
them, K/V and residual stream alike. So it keeps, per sequence (``_Drafted``), the tokens it fed, their
residual streams after block E-1 ([k, C] each, in ``self.hidden``) and the scratch slots of their K/V,
and before the verify (``verify_start``, which the model runner calls on every proposer) it

1. copies their K/V at layers 0 .. E-1 from scratch into the sequence's own slots for those positions,
   the ones the step's slot mapping gives them (the scheduler handed them out, copy-on-write done, so a
   block shared by the prefix cache or a fork is never written);
2. hands the runner a ``MidStackStart``: rows 0 .. r-1 of this sequence start at block E from those
   residual streams. The runner runs blocks 0 .. E-1 over the other rows only (the last draft, at m+k,
   which the drafter sampled but never fed; any plain decode or prefill chunk beside it), then
   blocks E .. L-1 over all of them (``ModelRunner._forward``, ``GPT.forward(start_layer=E)``).

What it saves: E/L of the verify's layer work on k of its k + 1 rows (here 2/4 on 3 of 4 rows at k = 3),
for the price of a copy of k slots at E layers and one more, small, model call; the verify's blocks
0 .. E-1 see one row per sequence instead of 1 + k. It is exact, not an approximation: the same
arithmetic on the same inputs (float rounding aside: a row computed alone or in a batch of 4), and
the tests hold the output to plain greedy decoding token for token and the cache to a plain prefill's.
Only what was computed for these tokens at these positions is reused: m and the tokens are compared
(up to the first that differs), so a proposal the token budget cut (the scheduler may verify fewer
drafts than proposed: then every verified row was fed, and none needs blocks 0 .. E-1), a sequence
preempted or finished in between (its state is dropped), or a row beside them (plain decode, prefill,
another method's) runs every block. Each propose call hands out the scratch blocks afresh, so it
forgets the previous call's state first.

``speculative_config={"kv_reuse": False}`` keeps the **recompute** variant, the slow and obvious
reference: the verify runs all 1 + k rows through all L layers again, and the drafter's K/V stay in
scratch. Either way the context is reused: the drafter never recomputes or stores a single K/V of a
computed token.

Why reuse is the default: it is exact and does strictly less arithmetic. How much less time that is
depends on what a row costs. On a CPU at batch 1 this small model is half bound by reading its weights,
so 2 blocks on 4 rows cost about 1.8x what they cost on 1 row, and the second model call costs
~0.25 ms of its own (the attention metadata and plan, the embedding). Measured end to end on a quiet
2-core CPU (``bench speculative --kv-reuse both``, best of 7 alternating rounds): at batch 1 the extra call
costs more than it saves (k = 2: 1.14x with reuse, 1.18x recomputing; k = 4: 1.09x, 1.11x), at batch 8 the
saving wins (k = 2: 1.11x against 1.07x; k = 4: 1.14x against 1.09x). Where a row costs nothing (a GPU at
small batch, bound by kernel launches), the extra call could cost more than it saves; that has not been measured.

Lossless at any temperature: the draft samples from its own q (the adapter's distribution at the
request's temperature, top-k, top-p), which the rejection sampler gets with every draft.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minibatch.sampling.sampler import probabilities
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.kv.kv_cache import slot_mapping as _slot_mapping
from minibatch.spec_decode.proposer import MidStackStart, Proposer, proposal_budget
from minibatch.spec_decode.scratch import ScratchTables, scratch_blocks_per_seq


@dataclass
class _Drafted:
    """What one propose call computed for one sequence, that its verify can reuse."""
    m: int            # where it started: the last sampled token's position (num_computed_tokens then)
    fed: list         # [n] the tokens it fed at positions m .. m+n-1: the last sampled token, then its drafts
    row: int          # its row of EarlyExitProposer.hidden
    at: int           # its first entry of EarlyExitProposer.slots: the scratch slots of their K/V (layers 0 .. E-1)


class EarlyExitProposer(Proposer):
    method = "early_exit"

    def __init__(self, target, adapter, k: int, engine_config, kv_reuse: bool = True):
        super().__init__(k)
        self.target, self.adapter, self.E = target, adapter, adapter.exit_layer
        self.backend, self.block_size = engine_config.attention_backend, engine_config.block_size
        self.kv_reuse = kv_reuse
        self.target_allocator = self.scratch = None
        self.state: dict = {}             # seq id -> _Drafted, for the sequences of the last propose call only
        self.hidden = None                # [B, k, C]: their residual streams after E blocks, pass by pass
        self.slots = None                 # [sum n]: where their K/V lie in scratch, sequence after sequence
        self._none = torch.zeros(0, dtype=torch.long, device=target.device)

    def num_scratch_blocks(self, max_num_seqs: int, block_size: int) -> int:
        return max_num_seqs * scratch_blocks_per_seq(block_size, self.k)

    def bind(self, allocator, kv_cache, first_scratch_block: int, num_scratch_blocks: int) -> None:
        # `allocator` is read only (block tables); the draft's K/V are the target's layers 0 .. E-1
        self.target_allocator = allocator
        self.scratch = ScratchTables(kv_cache, first_scratch_block, num_scratch_blocks, self.block_size,
                                     range(self.E))

    @torch.inference_mode()
    def propose(self, seqs, runner_output=None, scheduler_output=None) -> None:
        self.state.clear()                # the scratch blocks are handed out afresh: the last call's K/V go
        todo = [(s, proposal_budget(s, self.k)) for s in seqs]
        for seq, _ in todo:
            seq.spec_token_ids, seq.spec_probs = [], None
        todo = [(s, k) for s, k in todo if k > 0]
        if not todo:
            return
        starts = [s.num_computed_tokens for s, _ in todo]           # m: the last sampled token sits at m
        tables = self.scratch.tables([(self.target_allocator.block_table(s.seq_id), m, k)
                                      for (s, k), m in zip(todo, starts)])
        if self.kv_reuse:
            t = self.target
            self.hidden = torch.empty(len(todo), self.k, t.config.n_embd, dtype=t.dtype, device=t.device)
        probs = [[] for _ in todo]
        feed = [s.token_ids[m] for (s, _), m in zip(todo, starts)]
        fed = [[] for _ in todo]
        live = list(range(len(todo)))                                # who still drafts in this pass
        for j in range(self.k):
            for i in live:
                fed[i].append(feed[i])
            logits, h = self._forward([feed[i] for i in live], [tables[i] for i in live],
                                      [starts[i] + j for i in live])   # [B_live, V], [B_live, C]
            if self.kv_reuse:
                self.hidden[live, j] = h
            best = logits.argmax(-1).tolist()
            nxt = []
            for i, row, top in zip(live, logits, best):
                seq, k = todo[i]
                if seq.params.greedy:                                # greedy verify reads no q: skip building it
                    tok = top
                else:
                    q = probabilities(row, seq.params)
                    tok = int(torch.multinomial(q, 1, generator=self._generator(seq)))
                    probs[i].append(q)
                seq.spec_token_ids.append(tok)
                feed[i] = tok
                if len(seq.spec_token_ids) < k:
                    nxt.append(i)
            live = nxt
            if not live:
                break
        for (seq, _), q in zip(todo, probs):
            seq.spec_probs = torch.stack(q) if q else None           # greedy: one-hot, never read
        if self.kv_reuse:
            at = 0
            for i, (seq, _) in enumerate(todo):
                self.state[seq.seq_id] = _Drafted(starts[i], fed[i], i, at)
                at += len(fed[i])
            self.slots = _slot_mapping(tables, starts, [len(f) for f in fed], self.block_size, self.target.device)

    def _forward(self, ids, tables, positions):
        """One token per sequence at ``positions`` through the target's first E blocks (attending to the
        target's K/V before it, the drafts' in scratch), the adapter, ln_f and the head -> (logits[B, V],
        the residual stream after E blocks [B, C])."""
        dev, t = self.target.device, self.target
        meta = AttentionMetadata.build(tables, positions, [1] * len(ids), self.block_size, dev)
        attn = PagedAttention(self.scratch.kv_cache, meta, self.backend)
        # logits at no row (the exit's own head is the adapter's): just the residual stream after E blocks
        _, hs = t(torch.tensor(ids, device=dev), meta.positions, attn, logits_indices=self._none,
                  hidden_states=(self.E,), exit_layer=self.E, all_hidden=True)
        return self.adapter.logits(t, hs[self.E]).float().cpu(), hs[self.E]

    def verify_start(self, scheduled, slot_mapping, query_start_loc) -> Optional[MidStackStart]:
        """LayerSkip's KV reuse: the rows of a verify the drafter fed (positions m .. m+n-1, the same tokens)
        went through blocks 0 .. E-1 exactly as the target's verify would take them. Copy their K/V at those
        layers from scratch into the sequence's own slots for them and hand back their residual streams, so
        the verify starts at block E for them. Only what the drafter computed for *these* tokens at *these*
        positions is reused (m and the tokens are compared, up to the first that differs); any other row, or a
        sequence drafted in no such way, runs every block."""
        if not self.kv_reuse or not self.state:
            return None
        num_rows, src, dst, rows = [], [], [], []
        for b, s in enumerate(scheduled):
            d, r = self.state.get(s.seq.seq_id), 0
            if d is not None and s.spec_token_ids and s.num_computed_before == d.m:
                ids = s.input_token_ids                            # [1 + k']: the last sampled token, the drafts kept
                n = min(len(ids), len(d.fed))                      # k' = k: the last draft was never fed
                while r < n and ids[r] == d.fed[r]:                # the same tokens (only a row whose whole prefix
                    r += 1                                         # is the same has the same K/V and state)
            num_rows.append(r)
            if r:
                src += range(d.at, d.at + r)
                dst += range(query_start_loc[b], query_start_loc[b] + r)
                rows += range(d.row * self.k, d.row * self.k + r)
        if not src:
            return None
        dev = slot_mapping.device
        # into the slots the step's slot mapping gives these rows: the sequence's own (copy-on-write is done)
        self.scratch.kv_cache.copy_slots(self.slots[torch.tensor(src, device=self.slots.device)].to(dev),
                                         slot_mapping[torch.tensor(dst, device=dev)], self.E)
        hidden = self.hidden.view(-1, self.hidden.shape[-1])[torch.tensor(rows, device=self.hidden.device)]
        return MidStackStart(self.E, num_rows, hidden)                 # hidden [R, C]

    def free(self, seq) -> None:
        super().free(seq)
        self.state.pop(seq.seq_id, None)
