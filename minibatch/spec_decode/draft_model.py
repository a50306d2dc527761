"""The draft-model proposer (Leviathan et al. 2023; Chen et al. 2023): a small model guesses k tokens.

It runs the small distilled ``draft`` model autoregressively for k steps. It has its own paged KV cache
and its own block allocator (the draft's K/V are of a different shape, so they cannot live in the
target's blocks). After verification its cache is rolled back to the tokens the target accepted.
"""
from __future__ import annotations

import math

import torch

from minibatch.sampling.sampler import probabilities
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.kv.block_allocator import BlockAllocator
from minibatch.kv.kv_cache import KVCache
from minibatch.spec_decode.proposer import Proposer, proposal_budget


class DraftModelProposer(Proposer):
    method = "draft"

    def __init__(self, draft, k: int, engine_config):
        super().__init__(k)
        c = engine_config
        self.model, self.backend = draft, c.attention_backend
        # Room for every sequence at full context: the draft cache can then never run out (it is ~1/5 the size
        # of the target's per token, so this costs little).
        num_blocks = c.max_num_seqs * (math.ceil(draft.config.n_ctx / c.block_size) + 1)
        # The draft allocator's slots of a sequence are the tokens whose draft K/V is written: its "fed" count.
        self.allocator = BlockAllocator(num_blocks, c.block_size, enable_prefix_caching=False)
        mc = draft.config
        self.kv_cache = KVCache(mc.n_layer, num_blocks, c.block_size, mc.num_kv_heads, mc.head_dim,
                                dtype=draft.dtype, device=draft.device)

    @torch.inference_mode()
    def propose(self, seqs, runner_output=None, scheduler_output=None) -> None:
        todo = {s.seq_id: (s, proposal_budget(s, self.k)) for s in seqs}
        todo = {sid: v for sid, v in todo.items() if v[1] > 0}
        feeds, probs = {}, {}                             # seq id -> tokens to feed next; its draft q rows
        for sid, (seq, k) in todo.items():
            # Draft K/V is valid for the tokens the target has computed: rejected drafts and the last token
            # (re-fed for fresh logits) are rolled back. (Every accepted draft equals the token it became.)
            fed = self.allocator.num_slots(sid) if self.allocator.has_seq(sid) else 0
            if fed > seq.num_computed_tokens:
                fed = seq.num_computed_tokens
                self.allocator.truncate(sid, fed)
            feeds[sid] = seq.token_ids[fed:]              # catch up: usually 1-2 tokens, the prompt the first time
            seq.spec_token_ids, probs[sid] = [], []
        for _ in range(self.k):
            batch = [(todo[sid][0], toks) for sid, toks in feeds.items() if toks]
            if not batch:
                break
            logits = self._forward(batch)                 # [B, V]: the next-token logits of each
            feeds = {}
            for (seq, _), row in zip(batch, logits):
                q = probabilities(row, seq.params)
                tok = int(q.argmax()) if seq.params.greedy else int(torch.multinomial(q, 1, generator=self._generator(seq)))
                seq.spec_token_ids.append(tok)
                probs[seq.seq_id].append(q)
                if len(seq.spec_token_ids) < todo[seq.seq_id][1]:
                    feeds[seq.seq_id] = [tok]
        for sid, (seq, _) in todo.items():
            seq.spec_probs = torch.stack(probs[sid]) if probs[sid] else None

    def _forward(self, batch) -> torch.Tensor:
        """One draft forward over the flat batch of every sequence's feed; the logits of each one's last."""
        ids, last, tables, starts, counts = [], [], [], [], []
        for seq, toks in batch:
            sid = seq.seq_id
            if self.allocator.has_seq(sid):
                start = self.allocator.num_slots(sid)
                self.allocator.append_slots(sid, len(toks))
            else:
                start = 0
                self.allocator.allocate(sid, toks)
            ids += toks
            last.append(len(ids) - 1)
            tables.append(self.allocator.block_table(sid))
            starts.append(start)
            counts.append(len(toks))
        dev = self.model.device
        meta = AttentionMetadata.build(tables, starts, counts, self.allocator.block_size, dev)
        attn = PagedAttention(self.kv_cache, meta, self.backend)
        return self.model(torch.tensor(ids, device=dev), meta.positions, attn,
                          logits_indices=torch.tensor(last, device=dev)).float().cpu()

    def free(self, seq) -> None:
        if self.allocator.has_seq(seq.seq_id):
            self.allocator.free(seq.seq_id)
        super().free(seq)
