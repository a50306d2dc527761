"""The model runner: one flat batch in, one forward, sampled (or verified) tokens out.

``execute(scheduler_output)`` does, in order (vLLM V1's ``GPUModelRunner.execute_model``):

1. copy-on-write copies the scheduler asked for (a shared block about to be written); a pure-decode
   step (one token per sequence, nothing else) then goes to the graph runner when there is one
   (``cuda_graphs.py``: fixed buffers, a captured graph replayed), and on to step 4;
2. **prepare inputs**: concatenate every scheduled sequence's new tokens into
   ``input_ids[T]``; ``AttentionMetadata.build`` makes the slot mapping, block
   tables, ``seq_lens``, ``query_start_loc`` and the ``positions[T]``; and
   ``logits_indices[N]`` picks the rows that need logits: the last row of a
   sequence whose chunk reaches its end, or its last 1 + k rows when k drafts are
   verified;
3. **run the model** once (asking for hidden states when the proposer reads them); when the proposer
   says some verified rows have been through the first E blocks already (early exit's KV reuse,
   ``Proposer.verify_start``), the forward runs in two parts: blocks 0 .. E-1 over the other rows, then
   blocks E .. L-1 over every row (``_forward``);
4. **sample**: one token per plain row (``Sampler``: one batched filter and one draw), or the rejection
   sampler over 1 + k rows (Leviathan et al. 2023 §2.3), which keeps a prefix of the drafts and adds one
   token of the target's own: every chain of the step in one batched call on the device
   (``rejection_sample_batched``), or through the rejection sampler the runner was built with (exercise 4's);
   a request's sampling controls, its grammar's mask and its logprobs are reached only when it asks for them;
5. a **token tree** (``kv/tree.py``) is verified the same way, over its 1 + N
   nodes, and keeps one root-to-leaf path; that path's K/V (and hidden states) then
   move to consecutive slots, so the cache holds a plain chain again (``_keep_paths``).

It returns a ``ModelRunnerOutput`` and changes no sequence: the scheduler's
``update_from_output`` owns that.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from minibatch.kv import tree
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.sampling import logprobs as lp
from minibatch.sampling.logits_processors import apply_logits_processors
from minibatch.sampling.sampler import Sampler, batched_probabilities, probabilities
from minibatch.sampling.structured.matcher import apply_grammar_bitmask
from minibatch.spec_decode.rejection_sampler import rejection_sample_batched, tree_rejection_sample
from minibatch.spec_decode.typical import typical_accept


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: list                  # [B] lists, batch order: tokens to append ([] mid-prefill)
    num_accepted: list                       # [B] drafts the target accepted (0 without drafts)
    forked_token_ids: list                   # [B] lists: n > 1, each child's first token (else [])
    hidden_states: dict = field(default_factory=dict)   # {layer: [N, C]} a proposer asked for, at logits rows
    logits_rows: list = field(default_factory=list)     # [B] lists: sequence b's rows of the N logits rows
    query_start_loc: list = field(default_factory=list) # [B+1]: sequence b's tokens are rows qsl[b]:qsl[b+1] of T
                                                        # (hidden_states has all T rows when the proposer asks)
    accepted_paths: list = field(default_factory=list)  # [B] lists: a tree's accepted nodes [0, c1, ..., ca]
                                                        # ([] for a chain or no drafts)
    logprobs: list = field(default_factory=list)        # [B]: [{token: Logprob}] per sampled token, or None
    forked_logprobs: list = field(default_factory=list) # [B]: the same for the children's first tokens, or None
    prompt_logprobs: list = field(default_factory=list) # [B]: a prompt's [None, {token: Logprob}, ...], or None


class ModelRunner:
    def __init__(self, model, kv_cache, block_size: int, attention_backend: str, seed: int = 0,
                 scratch_block: Optional[int] = None, hidden_states: tuple = (), all_hidden: bool = False,
                 typical: Optional[tuple] = None, proposer=None, graphs=None, sampler: Optional[Sampler] = None,
                 rejection_sampler=None):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.proposer = proposer             # asked, before a verify, where its rows may start (verify_start)
        self.attention_backend = attention_backend
        # The sampling parts, chosen once, when the engine is built (vLLM's runner builds its Sampler and
        # RejectionSampler the same way): the sampler (with its top-k/top-p filter), and the rejection sampler:
        # None, the reference, batched on the device, greedy rows verified by argmax alone; or a function with
        # ``rejection_sample``'s signature (a student's, exercise 4), which then verifies every chain row.
        self.sampler = sampler if sampler is not None else Sampler(seed)
        self.rejection_sampler = rejection_sampler
        self.scratch_block = scratch_block   # static batching: padding rows may write here, outside the pool
        self.hidden_states, self.all_hidden = tuple(hidden_states), all_hidden
        self.typical = typical               # (epsilon, delta): Medusa's typical acceptance, LOSSY (typical.py)
        self.graphs = graphs                 # a CUDAGraphRunner for pure-decode steps, or None: every step eager

    @torch.inference_mode()
    def execute(self, out) -> ModelRunnerOutput:
        self._copies(out)
        if self._replayable(out):
            return self._execute_decode(out.scheduled)
        input_ids, attn, logits_idx, rows, batch = self._prepare_inputs(out.scheduled, out.padding)
        qsl = [0]
        for n in attn.metadata.query_lens_list:                                   # host-side: no device sync
            qsl.append(qsl[-1] + n)
        start = None
        if self.proposer is not None and attn.metadata.tree_bits is None and any(s.spec_token_ids for s in out.scheduled):
            start = self.proposer.verify_start(out.scheduled, attn.metadata.slot_mapping, qsl)
        result = self._forward(input_ids, attn, logits_idx, start, batch, qsl)
        return self._finish(out, attn, rows, qsl, result)

    # -- the same step in three parts, for asynchronous scheduling (engine.py's batch queue) ---------------------
    def prepare(self, out):
        """The CPU's part before the forward: the flat batch's metadata. (The input tokens are read at ``launch``:
        a decode's may be a placeholder until the step before is sampled.)"""
        _, attn, logits_idx, rows, batch = self._prepare_inputs(out.scheduled, out.padding)
        return attn, logits_idx, rows, batch

    @torch.inference_mode()
    def launch(self, out, prepared, input_ids: list):
        """The model's part (a worker thread runs it while the CPU updates the step before): the step's copies,
        then the forward. Tensors only: it reads no sequence."""
        attn, logits_idx, _, batch = prepared
        self._copies(out)
        return self._forward(input_ids, attn, logits_idx, None, batch, None)

    def greedy_on_worker(self, out) -> bool:
        """Can step ``out``'s tokens be taken on the model's thread, right after its forward, where vLLM's worker
        samples (and keeps them on the device for the next step's inputs)? Only where taking them reads no
        sequence: every row greedy, with no sampling control, grammar, logprobs, drafts or forks pending, and
        the reference sampler (a student's sampler is always the one called, on the CPU thread)."""
        return type(self.sampler) is Sampler and self.rejection_sampler is None and all(
            s.seq.params.greedy and not s.seq.params.has_controls and s.seq.grammar is None
            and s.seq.params.logprobs is None and s.seq.params.prompt_logprobs is None
            and not s.spec_token_ids and not s.seq.num_forks_pending for s in out.scheduled)

    @staticmethod
    def greedy_tokens(prepared, result) -> list:
        """The step's greedy tokens, one per scheduled sequence (None where it samples nothing: mid-prefill), as
        the CPU thread's ``Sampler`` takes them: argmax of the float logits of each sequence's one row."""
        rows = prepared[2]
        idx = [r[0] for r in rows if r]
        best = iter(result.float()[idx].argmax(-1).tolist() if idx else [])
        return [next(best) if r else None for r in rows]

    @torch.inference_mode()
    def finish(self, out, prepared, result, greedy: Optional[list] = None) -> ModelRunnerOutput:
        """The CPU's part after the forward: the sampler (on the CPU thread: it reads the sequences), or, where
        the model's thread took the greedy tokens (``greedy_tokens``), those."""
        attn, _, rows, _ = prepared
        qsl = [0]
        for n in attn.metadata.query_lens_list:
            qsl.append(qsl[-1] + n)
        if greedy is not None:
            B = len(out.scheduled)
            return ModelRunnerOutput([[] if t is None else [t] for t in greedy[:B]], [0] * B, [[] for _ in range(B)],
                                     {}, rows, qsl[: B + 1], [[] for _ in range(B)])
        return self._finish(out, attn, rows, qsl, result)

    def _finish(self, out, attn, rows, qsl, result) -> ModelRunnerOutput:
        logits, hidden = result if self.hidden_states else (result, {})
        logits = self._process(logits, out.scheduled, rows)
        sampled, accepted, forked, paths = self._sample(out.scheduled, logits, rows)
        qsl = qsl[: len(out.scheduled) + 1]                                      # without the padding rows
        if any(paths):
            self._keep_paths(paths, attn.metadata.slot_mapping, qsl, rows, hidden)
        result = ModelRunnerOutput(sampled, accepted, forked, hidden, rows, qsl, paths)
        self._logprobs(result, out.scheduled, logits)
        return result

    def _copies(self, out) -> None:
        """The memory hierarchy's copies, then copy-on-write, all before the forward and in this order: out to the
        host, back from it, within the device (engine/memory_hierarchy.py says why no copy then reads a block
        another one writes)."""
        kv = self.kv_cache
        if out.blocks_to_swap_out or out.blocks_to_offload:
            kv.swap_out(out.blocks_to_swap_out + out.blocks_to_offload)
        if out.blocks_to_swap_in or out.blocks_to_load:
            kv.swap_in(out.blocks_to_swap_in + out.blocks_to_load)
        if out.blocks_to_swap_out or out.blocks_to_offload or out.blocks_to_swap_in or out.blocks_to_load:
            kv.wait_copies()                  # GPU: the forward's stream waits for the side stream's copies
        if out.cow_copies:
            kv.copy_blocks(out.cow_copies)

    @staticmethod
    def _process(logits, scheduled, rows):
        """What every sampled row goes through before the sampler, the greedy argmax and the rejection sampler,
        eager or replayed: the requests' sampling controls, then the grammar's mask (-inf off-grammar). One hook
        each, entered only when a request of the step asks for it: a plain step goes straight to the sampler."""
        logits = logits.float()
        if any(s.seq.params.has_controls for s in scheduled):
            logits = apply_logits_processors(logits, scheduled, rows)
        if any(s.seq.grammar is not None for s in scheduled):
            logits = apply_grammar_bitmask(logits, scheduled, rows)
        return logits

    def _logprobs(self, result, scheduled, logits) -> None:
        """The logprobs requests ask for (sampling/logprobs.py): their sampled tokens' from the processed
        target rows, and a prompt's once it is complete. Entered only when a request asks."""
        if any(s.seq.params.logprobs is not None for s in scheduled):
            result.logprobs, result.forked_logprobs = lp.sample_logprobs(
                scheduled, logits, result.logits_rows, result.sampled_token_ids, result.accepted_paths,
                result.forked_token_ids)
        if any(s.seq.params.prompt_logprobs is not None for s in scheduled):
            result.prompt_logprobs = lp.prompt_rows(self.model, scheduled)

    def _replayable(self, out) -> bool:
        """A pure-decode step the graph runner can take: one new token per sequence, no drafts or tree, no
        static-batching padding, no hidden states for a proposer, at most the largest captured batch."""
        return (self.graphs is not None and not out.padding and not self.hidden_states
                and self.graphs.padded_size(len(out.scheduled)) is not None
                and all(s.num_new_tokens == 1 and not s.spec_token_ids for s in out.scheduled))

    def _execute_decode(self, scheduled) -> ModelRunnerOutput:
        """The pure-decode step through the graph runner's fixed buffers: logits [B, V], row b = sequence b."""
        computed = [s.num_computed_before for s in scheduled]
        self._check_context(computed, [1] * len(scheduled))
        logits = self.graphs.run([s.input_token_ids[0] for s in scheduled], [s.block_table for s in scheduled],
                                 computed, [s.seq.seq_id for s in scheduled])
        rows = [[b] if s.samples else [] for b, s in enumerate(scheduled)]
        logits = self._process(logits, scheduled, rows)
        sampled, accepted, forked, paths = self._sample(scheduled, logits, rows)
        result = ModelRunnerOutput(sampled, accepted, forked, {}, rows, list(range(len(scheduled) + 1)), paths)
        self._logprobs(result, scheduled, logits)
        return result

    def _check_context(self, computed, new) -> None:
        """The boundary check of positions (host values, before any tensor): a position past the context
        would index the position embedding out of range, a device-side assert on CUDA rather than an error."""
        n_ctx = self.model.config.n_ctx
        last = max((c + n for c, n in zip(computed, new)), default=0)
        if last > n_ctx:
            raise ValueError(f"position {last - 1} is past the context length {n_ctx}")

    def _prepare_inputs(self, scheduled, padding=()):
        """The flat batch: input_ids[T], the attention (metadata built once), logits_indices[N], and
        each sequence's rows among the N."""
        input_ids, logits_idx, rows = [], [], []
        for s in scheduled:
            input_ids += s.input_token_ids
            n_rows = 1 + len(s.spec_token_ids) if s.samples else 0     # verify 1 + k positions, or none
            rows.append(list(range(len(logits_idx), len(logits_idx) + n_rows)))
            logits_idx += range(len(input_ids) - n_rows, len(input_ids))
        tables = [s.block_table for s in scheduled]
        computed = [s.num_computed_before for s in scheduled]
        new = [s.num_new_tokens for s in scheduled]
        trees = [s.spec_parents for s in scheduled] + [None] * len(padding)
        bs = self.block_size
        for i, (table, context) in enumerate(padding):
            # static batching's idle slots: a finished member still computes a token at position `context`,
            # attending over its whole context, as a rectangular batch does. Its K/V goes to the unused slot
            # after its last token, or, when that starts a new block, to scratch block i past the pool.
            input_ids.append(0)
            tables.append(table + [self.scratch_block + i] if context % bs == 0 else table)
            computed.append(context)
            new.append(1)
        self._check_context(computed, new)
        tree_kw = {"tree_parents": trees} if any(t is not None for t in trees) else {}
        meta = AttentionMetadata.build(tables, computed, new, bs, self.model.device, **tree_kw)
        attn = PagedAttention(self.kv_cache, meta, self.attention_backend)
        return input_ids, attn, logits_idx, rows, (tables, computed, new)

    def _forward(self, input_ids, attn, logits_idx, start, batch, qsl):
        """The model over the flat batch -> logits [N, V] (and the hidden states the proposer reads).

        With ``start`` (a ``MidStackStart``: LayerSkip's KV reuse, Elhoushi et al. 2024 §4.2), the first
        start.num_rows[b] rows of sequence b have been through blocks 0 .. E-1 already, their K/V there are in
        their slots, and start.hidden [R, C] is their residual stream. Then, in two calls:
          1. blocks 0 .. E-1 over the other rows only (each sequence's rows after its reused ones: its own
             attention metadata, whose context now includes the reused rows' K/V), exiting at E -> [T - R, C];
          2. blocks E .. L-1 over all T rows, from those states and start.hidden, with the step's metadata.
        The same arithmetic as one call of every row through every block, less E blocks on R rows."""
        dev = self.model.device
        ids = torch.tensor(input_ids, device=dev)
        kw = dict(logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
                  hidden_states=self.hidden_states, all_hidden=self.all_hidden)
        if start is None or not any(start.num_rows):
            return self.model(ids, attn.metadata.positions, attn, **kw)
        E, (tables, computed, new) = start.layer, batch
        reused = list(start.num_rows) + [0] * (len(new) - len(start.num_rows))    # padding rows reuse nothing
        x = torch.empty(len(input_ids), self.model.config.n_embd, dtype=self.model.dtype, device=dev)   # [T, C]
        fresh = [t for b in range(len(new)) for t in range(qsl[b] + reused[b], qsl[b + 1])]
        if fresh:
            keep = [b for b in range(len(new)) if new[b] > reused[b]]
            meta = AttentionMetadata.build([tables[b] for b in keep], [computed[b] + reused[b] for b in keep],
                                           [new[b] - reused[b] for b in keep], self.block_size, dev)
            fresh = torch.tensor(fresh, device=dev)
            _, hs = self.model(ids[fresh], meta.positions, PagedAttention(self.kv_cache, meta, self.attention_backend),
                               logits_indices=fresh[:0], hidden_states=(E,), exit_layer=E, all_hidden=True)
            x[fresh] = hs[E]                                                       # [T - R, C]
        x[[t for b in range(len(new)) for t in range(qsl[b], qsl[b] + reused[b])]] = start.hidden    # [R, C]
        return self.model(ids, attn.metadata.positions, attn, start_layer=E, start_hidden=x, **kw)

    def _sample(self, scheduled, logits: torch.Tensor, rows: list):
        """Per sequence: the tokens to append, the drafts accepted, and (n > 1) the children's first tokens."""
        B = len(scheduled)
        sampled, accepted, forked, paths = [[] for _ in range(B)], [0] * B, [[] for _ in range(B)], [[] for _ in range(B)]
        plain = [b for b in range(B) if rows[b] and not scheduled[b].spec_token_ids]
        verify = [b for b in range(B) if rows[b] and scheduled[b].spec_token_ids]
        for b in [b for b in verify if scheduled[b].spec_parents is not None]:
            sampled[b], accepted[b], paths[b] = self._verify_tree(scheduled[b], logits[rows[b]])
        verify = [b for b in verify if scheduled[b].spec_parents is None]
        if plain:
            toks = self.sampler(logits[[rows[b][0] for b in plain]], [scheduled[b].seq.params for b in plain],
                                [scheduled[b].seq.generator for b in plain])
            for b, t in zip(plain, toks):
                sampled[b] = [t]
        # Greedy rows verify by argmax alone: accept drafts while each is the target's argmax, then the argmax
        # after them. That is exactly what the reference rejection sampler does for them (through one-hot p and
        # q, at ~0.3 ms a step); a runner built with another rejection sampler (a student's, a test's mutant)
        # sends every row through it instead.
        fast = [b for b in verify if scheduled[b].seq.params.greedy] if self.rejection_sampler is None else []
        if fast:
            best = logits[[r for b in fast for r in rows[b]]].argmax(-1).tolist()
            for b in fast:
                drafts, top = scheduled[b].spec_token_ids, best[:len(rows[b])]
                del best[:len(rows[b])]
                n = next((i for i, (d, t) in enumerate(zip(drafts, top)) if d != t), len(drafts))
                sampled[b], accepted[b] = drafts[:n] + [top[n]], n
            verify = [b for b in verify if b not in fast]
        if verify:
            for b, toks, n in zip(verify, *self._verify([scheduled[b] for b in verify], logits,
                                                        [rows[b] for b in verify])):
                sampled[b], accepted[b] = toks, n
        for b in plain:                       # n > 1: every child draws its first token from the same logits
            seq = scheduled[b].seq
            for i in range(1, seq.num_forks_pending + 1):
                forked[b] += self.sampler(logits[rows[b][0]][None], [seq.params], [seq.request.generators[i]])
        return sampled, accepted, forked, paths

    def _verify_tree(self, s, logits):
        """A token tree: logits [N+1, V] at its nodes (row i: the target's next token after node i).
        Greedy keeps the longest path of argmax matches (``tree.greedy_path``); otherwise the lossless tree
        rule (``tree_rejection_sample``: children tried in order, the residual after each rejection).
        Returns (tokens to append, drafts accepted, the accepted path's nodes)."""
        parents, tokens = s.spec_parents, s.input_token_ids        # node i's token: the root's, then the drafts
        if s.seq.params.greedy:
            top = logits.argmax(-1).tolist()
            path = tree.greedy_path(parents, tokens, top)
            toks = [tokens[i] for i in path[1:]] + [top[path[-1]]]
        else:
            path, toks = tree_rejection_sample(parents, tokens, probabilities(logits.cpu(), s.seq.params),
                                               generator=s.seq.generator)
        return toks, len(path) - 1, path

    def _keep_paths(self, paths, slot_mapping, qsl, rows, hidden) -> None:
        """Move each accepted path to consecutive slots: node path[j], stored at cache index c0 + path[j], goes
        to c0 + j, in each of the target's layers (the verify wrote no other: a drafter's own cache layer, EAGLE's,
        is rewritten by its catch-up pass), and so do its hidden states. A copy, not a remap: a block table maps whole
        blocks, and a path's nodes share blocks with rejected siblings. It copies at most depth tokens per
        sequence (cheap beside the forward), and afterwards the cache, the scheduler's count
        (num_computed_tokens = c0 + 1 + accepted) and the proposers all see a plain chain."""
        src = [(b, node, j) for b, path in enumerate(paths) for j, node in enumerate(path) if node != j]
        if not src:
            return
        dev = slot_mapping.device
        frm = torch.tensor([qsl[b] + node for b, node, _ in src], device=dev)      # flat rows of the batch
        to = torch.tensor([qsl[b] + j for b, _, j in src], device=dev)
        self.kv_cache.copy_slots(slot_mapping[frm], slot_mapping[to], num_layers=self.model.config.n_layer)
        for name, h in hidden.items():          # [T, C] (all rows) or [N, C] (the logits rows)
            if self.all_hidden:
                h[to.to(h.device)] = h[frm.to(h.device)]
            else:
                h[[rows[b][j] for b, _, j in src]] = h[[rows[b][node] for b, node, _ in src]]

    def _verify(self, batch, logits, rows):
        """Speculative decoding: accept a prefix of the drafts, plus one target token (Leviathan et al. §2.3).

        drafts [B, k] (-1 past a row's own k_b), q [B, k, V] from the proposer (None: one-hot drafts), the
        target's p [B, k + 1, V] at the verified rows; returns (tokens per row, drafts accepted per row)."""
        if self.typical is not None:          # opt-in, lossy: accept what the target finds typical enough
            res = [typical_accept(s.spec_token_ids, probabilities(logits[r].cpu(), s.seq.params), *self.typical,
                                  generator=s.seq.generator) for s, r in zip(batch, rows)]
            return [t for t, _ in res], [n for _, n in res]
        if self.rejection_sampler is None:
            return self._verify_batched(batch, logits, rows)
        k, V, B = max(len(s.spec_token_ids) for s in batch), logits.shape[-1], len(batch)
        drafts = torch.full((B, k), -1, dtype=torch.long)
        target = torch.zeros(B, k + 1, V)
        q = None if all(s.seq.spec_probs is None for s in batch) else torch.zeros(B, k, V)
        for b, (s, r) in enumerate(zip(batch, rows)):
            n = len(s.spec_token_ids)
            drafts[b, :n] = torch.tensor(s.spec_token_ids, dtype=torch.long)
            target[b, :n + 1] = probabilities(logits[r].cpu(), s.seq.params)
            if q is not None:                 # a row without q (one-hot drafts: greedy, n-gram) beside rows with q
                q[b, :n] = (s.seq.spec_probs[:n] if s.seq.spec_probs is not None
                            else torch.nn.functional.one_hot(drafts[b, :n], V).to(q.dtype))
        toks, n_acc = self.rejection_sampler(drafts, q, target, [s.seq.generator for s in batch],
                                       num_draft_tokens=[len(s.spec_token_ids) for s in batch],
                                       greedy=[s.seq.params.greedy for s in batch])
        n_acc = n_acc.tolist()
        return [row[:a + 1] for row, a in zip(toks.tolist(), n_acc)], n_acc

    def _verify_batched(self, batch, logits, rows):
        """The same verification in one batched call on the logits' device (``rejection_sample_batched``):
        p [B, k + 1, V] from one ``batched_probabilities`` over every verified row, q [B, k, V] from the
        proposer's rows (one-hot where a row has none; None when none has any)."""
        k, V, B, dev = max(len(s.spec_token_ids) for s in batch), logits.shape[-1], len(batch), logits.device
        ks = [len(s.spec_token_ids) for s in batch]
        idx = [r + [r[0]] * (k + 1 - len(r)) for r in rows]                        # [B, k+1]; padding: never read
        params = [s.seq.params for s in batch for _ in range(k + 1)]
        target = batched_probabilities(logits[torch.tensor(idx, device=dev).view(-1)], params,
                                       self.sampler.top_k_top_p).view(B, k + 1, V)
        drafts = torch.tensor([s.spec_token_ids + [-1] * (k - n) for s, n in zip(batch, ks)], dtype=torch.long)
        q = None
        if any(s.seq.spec_probs is not None for s in batch):
            q = torch.nn.functional.one_hot(drafts.clamp(min=0), V).to(device=dev, dtype=target.dtype)
            for b, s in enumerate(batch):
                if s.seq.spec_probs is not None:
                    q[b, :ks[b]] = s.seq.spec_probs[:ks[b]].to(device=dev, dtype=target.dtype)
        toks, n_acc = rejection_sample_batched(drafts, q, target, [s.seq.generator for s in batch], ks,
                                               [s.seq.params.greedy for s in batch])
        n_acc = n_acc.tolist()
        return [row[:a + 1] for row, a in zip(toks.tolist(), n_acc)], n_acc
