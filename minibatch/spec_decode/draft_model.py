"""The draft-model proposer (Leviathan et al. 2023; Chen et al. 2023): a small model guesses k tokens.

It runs the small distilled ``draft`` model autoregressively for k steps. It has its own paged KV cache
and its own block allocator (the draft's K/V are of a different shape, so they cannot live in the
target's blocks). After verification its cache is rolled back to the tokens the target accepted.
"""
from __future__ import annotations

import math

import torch

from minibatch.engine.sampler import make_generator, probabilities
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from minibatch.kv.kv_cache import KVCache
from minibatch.spec_decode.proposer import decode_ready, proposal_budget


class DraftModelProposer:
    def __init__(self, draft, k: int, engine_config):
        c = engine_config
        self.model, self.k, self.backend = draft, k, c.attention_backend
        # Room for every sequence at full context: the draft cache can then never run out (it is ~1/5 the size
        # of the target's per token, so this costs little).
        num_blocks = c.max_num_seqs * (math.ceil(draft.config.n_ctx / c.block_size) + 1)
        self.allocator = BlockAllocator(num_blocks, c.block_size, enable_prefix_caching=False)
        mc = draft.config
        self.kv_cache = KVCache(mc.n_layer, num_blocks, c.block_size, mc.num_kv_heads, mc.head_dim,
                                dtype=draft.dtype, device=draft.device)
        self.num_fed: dict[str, int] = {}                 # seq id -> leading tokens whose draft K/V is valid
        self.q: dict[str, list] = {}                      # seq id -> [q_1, ..., q_k], each [V]
        self.generators: dict[str, torch.Generator] = {}

    def _gen(self, seq):
        if seq.params.seed is not None and seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = make_generator(seq.params.seed + 7919 * (seq.index + 1))
        return self.generators.get(seq.seq_id)

    @torch.no_grad()
    def propose_for(self, running) -> None:
        todo = {s.seq_id: (s, proposal_budget(s, self.k)) for s in running if decode_ready(s) and proposal_budget(s, self.k) > 0}
        feeds = {}                                        # seq id -> tokens to feed in the first draft step
        for sid, (seq, k) in list(todo.items()):
            # Valid draft K/V covers at most the tokens before the last one: drafts fed for a step that was
            # not scheduled are not part of the sequence, and the last token is re-fed for fresh logits.
            fed = min(self.num_fed.get(sid, 0), len(seq) - 1)
            if self.num_fed.get(sid, 0) > fed:
                self.num_fed[sid] = fed
                self.allocator.truncate(sid, fed)
            feeds[sid] = seq.token_ids[fed:]              # catch up: usually 1-2 tokens, the prompt the first time
            seq.spec_token_ids, self.q[sid] = [], []
        for j in range(self.k):
            batch = [(todo[sid][0], toks) for sid, toks in feeds.items() if toks]
            if not batch:
                break
            batch = [(s, t) for s, t in batch if self._reserve(s, t)]
            logits = self._forward(batch)                 # [B, V]: the next-token logits of each
            feeds = {}
            for (seq, _), row in zip(batch, logits):
                q = probabilities(row, seq.params)
                tok = int(q.argmax()) if seq.params.greedy else int(torch.multinomial(q, 1, generator=self._gen(seq)))
                seq.spec_token_ids.append(tok)
                self.q[seq.seq_id].append(q)
                if len(seq.spec_token_ids) < todo[seq.seq_id][1]:
                    feeds[seq.seq_id] = [tok]

    def _reserve(self, seq, toks) -> bool:
        try:
            if self.allocator.has_seq(seq.seq_id):
                self.allocator.append_slots(seq.seq_id, toks)
            else:
                self.allocator.allocate(seq.seq_id, toks)
            return True
        except NoFreeBlocksError:                         # cannot happen with the sizing above; propose nothing
            return False

    def _forward(self, batch) -> torch.Tensor:
        ids, pos, starts, counts, last = [], [], [], [], []
        for seq, toks in batch:
            start = self.num_fed.get(seq.seq_id, 0)
            ids += toks
            pos += range(start, start + len(toks))
            starts.append(start)
            counts.append(len(toks))
            last.append(len(ids) - 1)
            self.num_fed[seq.seq_id] = start + len(toks)
        dev = self.model.device
        meta = AttentionMetadata.build([self.allocator.block_table(s.seq_id) for s, _ in batch], starts, counts,
                                       self.allocator.block_size, dev)
        attn = PagedAttention(self.kv_cache, meta, self.backend)
        return self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), attn,
                          logits_indices=torch.tensor(last, device=dev)).float().cpu()

    def draft_probs(self, seqs, k: int):
        V = self.model.config.vocab_size
        q = torch.zeros(len(seqs), k, V)
        for b, seq in enumerate(seqs):
            for j, row in enumerate(self.q.get(seq.seq_id, [])[:k]):
                q[b, j] = row
        return q

    def on_verified(self, seq, num_valid: int) -> None:
        """Roll the draft cache back to the tokens the target kept (rejected drafts' K/V are dropped)."""
        sid = seq.seq_id
        if sid in self.num_fed and self.num_fed[sid] > num_valid:
            self.num_fed[sid] = num_valid
            self.allocator.truncate(sid, num_valid)

    def free(self, seq) -> None:
        sid = seq.seq_id
        if self.allocator.has_seq(sid):
            self.allocator.free(sid)
        for d in (self.num_fed, self.q, self.generators):
            d.pop(sid, None)
