"""Proposers for speculative decoding: who guesses the next k tokens.

Both proposers answer one question per step, for every running sequence in
decode: "what are the next up to k tokens?" The target model then checks all
of them in one forward (``LLMEngine._verify``), so a cheap good guess turns one
target forward into several tokens.

* ``NgramProposer`` (prompt lookup decoding, Saxena 2023): copy what followed
  the last occurrence of the current n-gram in the sequence's own context.
  No model, no probabilities (q is one-hot).
* ``DraftModelProposer`` (Leviathan et al. 2023; Chen et al. 2023): run the
  small distilled ``draft`` model autoregressively for k steps. It has its own
  paged KV cache and its own block allocator (the draft's K/V are of a
  different shape, so they cannot live in the target's blocks). After
  verification its cache is rolled back to the tokens the target accepted.
"""
from __future__ import annotations

import math

import torch

from .attention import AttentionMetadata, PagedAttention
from .block_allocator import BlockAllocator, NoFreeBlocksError
from .kv_cache import KVCache
from .sampler import make_generator, probabilities
from .speculative import check_ngram_sizes, ngram_propose

METHODS = ("draft", "ngram")
MAX_SPECULATIVE_TOKENS = 16


def _budget(seq, k: int) -> int:
    """Proposal length for this step: never past max_tokens (the +1 is the bonus token)."""
    return max(0, min(k, seq.params.max_tokens - len(seq.output_ids) - 1))


def _decode_ready(seq) -> bool:
    return seq.num_uncomputed == 1 and bool(seq.output_ids) and not seq.is_finished


class NgramProposer:
    def __init__(self, k: int, n_max: int = 3, n_min: int = 1):
        check_ngram_sizes(n_min, n_max)                    # now, not at the first step
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def propose_for(self, running) -> None:
        for seq in running:
            if _decode_ready(seq):
                seq.spec_token_ids = ngram_propose(seq.token_ids, _budget(seq, self.k), self.n_max, self.n_min)

    def draft_probs(self, seqs, k):
        return None                                        # one-hot drafts

    def on_verified(self, seq, num_valid: int) -> None:
        pass

    def free(self, seq) -> None:
        pass


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
        todo = {s.seq_id: (s, _budget(s, self.k)) for s in running if _decode_ready(s) and _budget(s, self.k) > 0}
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


def make_proposer(spec_config, target, draft, engine_config):
    """Validate ``speculative_config`` (vLLM's keys) and build the proposer, or None."""
    if spec_config is None:
        return None
    if not isinstance(spec_config, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(spec_config).__name__}")
    unknown = set(spec_config) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    if unknown:
        raise ValueError(f"unknown speculative_config keys {sorted(unknown)}")
    method = spec_config.get("method")
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of {list(METHODS)}")
    k = spec_config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    if method == "ngram":
        return NgramProposer(k, spec_config.get("prompt_lookup_max", 3), spec_config.get("prompt_lookup_min", 1))
    if draft is None:
        from .weights import load_model
        draft = load_model("draft", device=target.device, dtype=target.dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size}): its tokens would mean something else")
    if draft.config.n_ctx < target.config.n_ctx:
        raise ValueError(f"the draft's context ({draft.config.n_ctx}) is shorter than the target's "
                         f"({target.config.n_ctx})")
    return DraftModelProposer(draft, k, engine_config)
