"""Asynchronous scheduling: step N+1 is scheduled before step N's tokens exist (vLLM V1's ``AsyncScheduler``).

With a synchronous scheduler the CPU and the model take turns: schedule, forward, sample, update, schedule... So
on a GPU, where a tiny model's forward takes a few hundred microseconds, the device waits for the Python around
it. vLLM V1 (``--async-scheduling``, ``v1/core/sched/async_scheduler.py``; SGLang's overlap scheduler likewise)
schedules the next step while the current one runs, and ``engine.py``'s batch queue runs the forward of step N+1
while the CPU updates the requests with step N's tokens:

    CPU:    schedule N+1 | sample N, resolve N | update N, outputs N | schedule N+2 | ...
    model:  ...forward N ...........................| forward N+1 ..................| ...

What makes that possible is the **placeholder**. When step N is scheduled, each sequence it will sample gets a
placeholder token at the end of ``token_ids`` (``num_output_placeholders``, vLLM's ``num_output_placeholders``),
and ``num_computed_tokens`` advances at schedule time (vLLM V1: the K/V of a scheduled chunk counts as computed,
being written by the step in flight). So when step N+1 is scheduled the sequence looks as it would after step N:
a decode of one token, that token being the placeholder, which step N's sampler *resolves* (writes in) before step
N+1's forward reads it. The rest follows from that:

* a sequence whose tokens with placeholders reach ``max_tokens`` is not scheduled again (it will finish);
* a stop string or EOS found in step N's token is found one step late: step N+1 is in flight for it, and its extra
  token is dropped when it comes, never emitted; its blocks are freed when it finishes;
* the prefix cache registers only tokens that are computed and not placeholders (``mark_computed`` is given the
  count of step N's chunk, never the count ahead);
* a sequence preempted (or aborted) while its step is in flight keeps (drops) its token; a preempted sequence with
  a placeholder is not readmitted until the token is known (``Scheduler._admit``);
* n > 1: the children fork off when the prompt's first tokens are known, from the prompt's blocks alone;
* seeded sampling draws the same numbers as without overlap: a sequence's generator is used once per step it is
  sampled, and only a finished sequence's extra row draws more (its output no longer changes).

Structured outputs wait for the previous step's grammar state: the engine runs a step that holds a grammar after
the step in flight is updated (no overlap for that step). Speculative decoding is not supported here yet.
"""
from __future__ import annotations

from minibatch.engine.scheduler import Scheduler, SchedulerOutput
from minibatch.engine.sequence import Sequence, SequenceStatus
from minibatch.sampling.sampler import find_stop
from minibatch.sampling.structured.matcher import advance

PLACEHOLDER = -1                 # a token id no model has: reading one before it is resolved fails loudly


class AsyncScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        # A sequence that will finish by length once its step in flight returns is not scheduled again.
        parked = [s for s in self.running if s.num_output_placeholders and s.num_output_tokens >= s.params.max_tokens]
        for s in parked:
            self.running.remove(s)
        try:
            out = super().schedule()
        finally:
            self.running += parked
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.num_computed_before + s.num_new_tokens     # in flight counts as computed
            if s.samples:
                s.placeholder_index = len(seq.token_ids)
                seq.token_ids.append(PLACEHOLDER)
                seq.num_output_placeholders += 1
        return out

    def resolve(self, out: SchedulerOutput, runner_output) -> None:
        """Step N's sampled tokens into its placeholders, before step N+1's forward reads them (cheap: one write
        a sequence). The rest of ``update_from_output`` then runs while step N+1's forward does."""
        for i, s in enumerate(out.scheduled):
            toks = runner_output.sampled_token_ids[i]
            if s.placeholder_index is None or not toks or s.seq.is_finished:
                continue
            s.seq.token_ids[s.placeholder_index] = toks[0]
            s.seq.num_output_placeholders -= 1

    def update_from_output(self, out: SchedulerOutput, runner_output) -> tuple[list, list]:
        """Step N's results, step N+1 (maybe) in flight: forks, computed blocks, stop conditions."""
        changed, finished = {}, []
        for i, s in enumerate(out.scheduled):
            seq, toks = s.seq, runner_output.sampled_token_ids[i]
            if seq.is_finished:                  # stopped a step ago, or aborted: its extra token is dropped
                runner_output.sampled_token_ids[i] = []          # (and the trace shows none appended)
                continue
            known = s.num_computed_before + s.num_new_tokens     # computed, and no placeholder among them
            if self.allocator.has_seq(seq.seq_id):               # (a sequence preempted since holds no blocks)
                self.allocator.mark_computed(seq.seq_id, min(known, self.allocator.num_slots(seq.seq_id)),
                                             seq.token_ids)
                if self.hierarchy is not None:
                    self.hierarchy.offload(self.allocator, seq)
            if not toks:                                          # mid-prefill: nothing sampled yet
                continue
            ended = None
            if seq.grammar is not None:       # (no step was in flight for it: the engine drained first)
                kept, ended = advance(seq.grammar, toks[:1])
                if not kept:                  # the grammar had ended before this token: it is not kept
                    del seq.token_ids[s.placeholder_index]
            if seq.num_forks_pending:
                finished += self._fork_known(seq, runner_output.forked_token_ids[i])
            finished += self._check_stop(seq, ended)
            changed[seq.request_id] = seq.request
        return self._stamped(changed), finished

    def _check_stop(self, seq: Sequence, ended=None) -> list:
        """Stop strings, EOS, the grammar's end and max_tokens over the tokens known (in the synchronous
        scheduler's order); a finished sequence drops its placeholders."""
        out = seq.output_token_ids
        cut = find_stop(out, seq.params.stop, seq.params.stop_token_ids)
        if cut is not None:
            reason, keep = "stop", cut
        elif ended is not None:
            reason, keep = ended, len(out)
        elif len(out) >= seq.params.max_tokens:
            reason, keep = "length", seq.params.max_tokens
        else:
            return []
        del seq.token_ids[seq.num_prompt_tokens + keep:]          # the late step's token(s) never emitted
        seq.num_output_placeholders = 0
        self.finish(seq, reason)
        return [seq]

    def _fork_known(self, parent: Sequence, first_tokens: list) -> list:
        """n > 1: the children share the prompt's blocks only (the parent's next slot is already its own)."""
        req, finished, n_prompt = parent.request, [], parent.num_prompt_tokens
        held = self.allocator.has_seq(parent.seq_id)    # not when preempted or swapped out since it was scheduled
        for i, tok in enumerate(first_tokens, start=1):
            child = Sequence(f"{req.request_id}.{i}", req, i, parent.token_ids[:n_prompt] + [tok],
                             status=SequenceStatus.RUNNING, num_computed_tokens=n_prompt if held else 0,
                             num_cached_tokens=parent.num_cached_tokens if held else 0)
            req.seqs.append(child)
            if held:
                self.allocator.fork(parent.seq_id, child.seq_id)
                self.allocator.truncate(child.seq_id, n_prompt)  # the slot after the prompt is the parent's
                self._on_fork(child)
            else:
                self.add(child)                                  # prefilled again, as a preempted sequence is
            finished += self._check_stop(child)
        parent.num_forks_pending = 0
        return finished
