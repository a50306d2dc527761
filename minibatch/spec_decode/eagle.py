"""The EAGLE proposer (Li et al. 2024): one transformer block drafts in the target's feature space.

The head (``minibatch/model/heads.py`` ``EagleHead``) turns (token p, the target's feature f_{p-1}) into a
guess f^_p of the feature at p; the target's own LM head turns that into a guess of token p + 1. Drafting
is autoregressive *in feature space*: the next entry reads the drafted token and f^ (not a true feature,
which only the target can give), k passes of one block per step.

Its K/V are **one more layer of the target's paged cache** (vLLM V1's layout): the engine makes the cache
n_layer + 1 layers deep, and the head's entry p sits in the target's slot p, in the same blocks, through
the same block tables. Entry p depends on tokens 0 .. p only, exactly like the target's K/V at p, so it
is shared by the prefix cache and by forks as theirs are, freed with them, and needs no allocator of
its own. Per step, for every sequence the target ran:

1. **catch up** on the positions the target just computed (a prefill chunk, or the accepted part of a
   verify): their entries are (token p, the *true* f_{p-1}), the features the model runner returns for
   every token of the step (``all_hidden``). They go into the target's slots. An entry drafted last
   step at a position now verified is rewritten from the true feature (EAGLE re-runs those too);
2. **draft**: entry m (the last sampled token, not yet computed by the target) gives d_1; entries m + j
   (d_j, f^_{m+j-1}) give d_{j+1}. These positions have no slots yet and may be rejected, so their K/V go
   to scratch blocks (``scratch.py``); rejected drafts leave nothing in the target's blocks.

Steps 1 and 2's first pass are one forward. A sequence whose prefix came from the prefix cache, or that
was preempted, starts its first entry with a zero feature (the target's feature before the cached
tokens was never computed for it): that costs a little acceptance, never correctness.

With ``"tree": "dynamic"`` the passes after the first grow EAGLE-2's dynamic tree instead of a chain
(``eagle_tree.py``): the same number of sequential passes, several candidates per depth.

Lossless at any temperature: drafts are sampled from q = the head's distribution at the request's
temperature, top-k and top-p, and q goes to the rejection sampler.
"""
from __future__ import annotations

import torch

from minibatch.sampling.sampler import probabilities
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.spec_decode.eagle_tree import draft_trees, entries_per_seq
from minibatch.spec_decode.proposer import Proposer, proposal_budget
from minibatch.spec_decode.scratch import ScratchTables, scratch_blocks_per_seq


class EagleProposer(Proposer):
    method = "eagle"
    hidden_states = ("final",)
    all_hidden = True
    extra_kv_layers = 1

    def __init__(self, target, head, k: int, engine_config, tree=None):
        super().__init__(k)
        # tree: None (a chain of k), or EAGLE-2's dynamic tree {"num_draft_tokens", "depth" (= k), "topk"}
        self.tree = tree
        if tree is not None:
            self.tree_nodes = self.num_lookahead_slots = tree["num_draft_tokens"]
        self.target, self.head, self.layer = target, head, target.config.n_layer   # its cache layer: after the target's
        self.backend, self.block_size = engine_config.attention_backend, engine_config.block_size
        self.state: dict = {}            # seq id -> (entries written for positions < n, f_{n-1} [C])
        self.finished: set = set()       # finished this step: their state goes once their entries are written
        self.target_allocator = self.scratch = None

    def _entries(self, k: int) -> int:
        """Head entries a sequence drafting k deep writes past its computed tokens."""
        return k if self.tree is None else entries_per_seq(k, self.tree["topk"])

    def num_scratch_blocks(self, max_num_seqs: int, block_size: int) -> int:
        return max_num_seqs * scratch_blocks_per_seq(block_size, self._entries(self.k))

    def bind(self, allocator, kv_cache, first_scratch_block: int, num_scratch_blocks: int) -> None:
        self.target_allocator = allocator
        self.scratch = ScratchTables(kv_cache, first_scratch_block, num_scratch_blocks, self.block_size,
                                     [self.layer])

    @torch.inference_mode()
    def propose(self, seqs, runner_output, scheduler_output) -> None:
        feats, qsl = self.features(runner_output.hidden_states), runner_output.query_start_loc    # [T, C], [B+1]
        zero = feats.new_zeros(feats.shape[-1])
        catch = {}                      # seq id -> (seq, block table, c0, tokens, features) of entries to write
        for b, s in enumerate(scheduler_output.scheduled):
            seq = s.seq
            c0, m = s.num_computed_before, min(seq.num_computed_tokens, len(seq.token_ids))
            if m <= c0:
                continue
            done, f_prev = self.state.get(seq.seq_id, (None, None))
            f_in = torch.cat([(f_prev if done == c0 else zero)[None], feats[qsl[b]: qsl[b] + m - c0 - 1]])
            catch[seq.seq_id] = (seq, s.block_table, c0, seq.token_ids[c0:m], f_in)
            if not seq.is_finished:
                self.state[seq.seq_id] = (m, feats[qsl[b] + m - c0 - 1])
        drafting = []                   # (seq, k): those the target ran this step, and fresh forks
        for seq in seqs:
            fresh_fork = seq.seq_id not in catch and seq.index > 0 and seq.num_output_tokens == 1
            if fresh_fork:              # a child of n > 1 starts from its parent's state (their prompt is shared)
                parent = self.state.get(seq.request.seqs[0].seq_id)
                if parent is not None and parent[0] == seq.num_computed_tokens:
                    self.state[seq.seq_id] = parent
            k = proposal_budget(seq, self.k)
            if (seq.seq_id in catch or fresh_fork) and k > 0 and seq.seq_id in self.state:
                seq.clear_spec()
                drafting.append((seq, k))
        self._run(catch, drafting)
        for sid in self.finished:       # their last entries are written: now forget them
            self.state.pop(sid, None)
        self.finished.clear()

    def _run(self, catch, drafting) -> None:
        """Pass 1: every catch-up entry and each drafter's entry m; passes 2 .. k: one drafted entry each."""
        tables = self.scratch.tables([(self.target_allocator.block_table(s.seq_id), s.num_computed_tokens,
                                       self._entries(k)) for s, k in drafting])
        draft_table = {s.seq_id: t for (s, _), t in zip(drafting, tables)}
        batch = []                      # (seq id, block table, c0, token ids, input features [n, C])
        for sid, (seq, table, c0, toks, f_in) in catch.items():
            if sid not in draft_table:
                batch.append((sid, table, c0, toks, f_in))
        for seq, _ in drafting:
            sid, m = seq.seq_id, seq.num_computed_tokens
            if sid in catch:
                _, _, c0, toks, f_in = catch[sid]
            else:
                c0, toks, f_in = m, [], self.state[sid][1].new_zeros(0, self.state[sid][1].shape[-1])
            batch.append((sid, draft_table[sid], c0, toks + [seq.token_ids[m]],
                          torch.cat([f_in, self.state[sid][1][None]])))
        if not batch:
            return
        f_hat = self._forward(batch)                                       # [T, C]
        self.scratch.copy_back()
        ends = torch.tensor([len(x[3]) for x in batch]).cumsum(0) - 1
        last = dict(zip([x[0] for x in batch], f_hat[ends]))               # seq id -> f^ of its last entry
        if self.tree is not None:            # EAGLE-2: grow a tree from each root instead (eagle_tree.py)
            draft_trees(self, drafting, last, draft_table, self.tree["topk"], self.tree["num_draft_tokens"])
            return
        probs = {s.seq_id: [] for s, _ in drafting}
        live = list(drafting)
        for j in range(self.k if live else 0):
            logits = self.head.logits(self.target, torch.stack([last[s.seq_id] for s, _ in live])).float().cpu()
            for (seq, _), row, top in zip(live, logits, logits.argmax(-1).tolist()):
                if seq.params.greedy:                             # greedy verify reads no q: skip building it
                    tok = top
                else:
                    q = probabilities(row, seq.params)
                    tok = int(torch.multinomial(q, 1, generator=self._generator(seq)))
                    probs[seq.seq_id].append(q)
                seq.spec_token_ids.append(tok)
            live = [(s, k) for s, k in live if len(s.spec_token_ids) < k]
            if not live:
                break
            f_hat = self._forward([(s.seq_id, draft_table[s.seq_id], s.num_computed_tokens + j + 1,
                                    [s.spec_token_ids[-1]], last[s.seq_id][None]) for s, _ in live])
            last = dict(zip([s.seq_id for s, _ in live], f_hat))
        for seq, _ in drafting:
            seq.spec_probs = torch.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None   # greedy: one-hot

    def features(self, hidden_states: dict) -> torch.Tensor:
        """The feature an entry reads at a position the target computed, [T, C]: EAGLE's is the final norm's
        output (EAGLE-3's fuses three states, ``eagle3.py``)."""
        return hidden_states["final"]

    def _forward(self, batch) -> torch.Tensor:
        """The head over a flat batch of entries: [(seq id, block table, first position, token ids, f_{p-1}s
        [, tree parents])]; a tree's entries see only their ancestors (EAGLE-2's passes, eagle_tree.py)."""
        dev = self.target.device
        trees = [x[5] if len(x) > 5 else None for x in batch]
        tree_kw = {"tree_parents": trees} if any(t is not None for t in trees) else {}
        meta = AttentionMetadata.build([x[1] for x in batch], [x[2] for x in batch], [len(x[3]) for x in batch],
                                       self.block_size, dev, **tree_kw)
        attn = PagedAttention(self.scratch.kv_cache, meta, self.backend)
        ids = torch.tensor([t for x in batch for t in x[3]], device=dev)
        feats = torch.cat([x[4] for x in batch]).to(self.target.dtype)
        return self.head(self.target, ids, feats, meta.positions, attn, self.layer)

    def free(self, seq) -> None:
        """A preempted sequence is forgotten now; a finished one after this step's catch-up, which still writes
        its last entries (from f_{c0-1}, kept in its state) into blocks the prefix cache may hand out again."""
        super().free(seq)
        if seq.is_finished:
            self.finished.add(seq.seq_id)
        else:
            self.state.pop(seq.seq_id, None)

