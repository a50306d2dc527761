"""The baseline: static batching, behind the same ``schedule()`` contract as continuous batching.

What a server did before Orca (and what HF ``generate`` on a padded batch still
does): form a batch of up to ``max_num_seqs`` requests in queue order (arrival
order under FCFS; with ``policy="priority"``, priority first), run it until
*every* member is done, and admit nobody meanwhile. Blocks for each member's
full length (prompt + ``max_tokens``) are reserved when the batch forms, so it
never preempts. A finished member keeps its slot and its blocks until the whole
batch is done: the batch is a rectangle, so it still computes a token every step,
attending over its whole context, which is thrown away (``SchedulerOutput.padding``;
the model runner feeds those rows). Everything after
``schedule()`` (the model runner, ``update_from_output``) is shared, so the
comparison with continuous batching measures the scheduling and nothing else.
"""
from __future__ import annotations

from minibatch.engine.scheduler import Scheduler, SchedulerOutput
from minibatch.engine.sequence import Sequence


class StaticBatching:
    """What static batching changes in a scheduler: how the batch is formed (``_fill``) and who joins it.
    A mixin over a scheduler class that has ``_schedule_running`` (``Scheduler``), so the same rules also run
    over a student's scheduler (exercise 7)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.batch: list[Sequence] = []        # the batch being run, finished members included (with their blocks)

    def reservation(self, seq: Sequence) -> int:
        """Blocks set aside for ``seq`` at its full length: its own prompt + max_tokens (+ the slots a token tree's
        verify writes past its last token, ``num_lookahead_slots``), and for each of its n - 1 forks everything but
        the full prompt blocks they share."""
        a = self.allocator
        whole = a.blocks_needed(len(seq) + seq.params.max_tokens + self.num_lookahead_slots)
        return whole + seq.num_forks_pending * (whole - len(seq) // a.block_size)

    def check_request(self, seq: Sequence) -> None:
        super().check_request(seq)
        need = self.reservation(seq)
        if need > self.allocator.num_blocks:
            raise ValueError(f"request {seq.request_id!r}: static batching reserves {need} blocks for its "
                             f"n={seq.params.n} sequences at full length, but the cache has only "
                             f"{self.allocator.num_blocks}: it could never run")

    def _fill(self, out: SchedulerOutput) -> None:
        if all(s.is_finished for s in self.batch):     # the whole batch is done: form the next one
            self.batch, reserved = [], 0
            for seq in self.waiting:                     # queue order
                need, seats = self.reservation(seq), 1 + seq.num_forks_pending
                if reserved + need > self.allocator.num_free_blocks or \
                        self._seats(self.batch) + seats > self.max_num_seqs:
                    break
                reserved += need
                self._start(seq, out)
                self.batch.append(seq)
        out.padding = [(self.allocator.block_table(s.seq_id), s.num_computed_tokens)
                       for s in self.batch if s.is_finished and self.allocator.has_seq(s.seq_id)]
        self._schedule_running(out, self.max_num_batched_tokens, skip=set(), preempt=False)

    def _release(self, seq: Sequence) -> None:
        """A member's blocks stay with the batch until every member is done; then all of them go."""
        if seq not in self.batch:
            return super()._release(seq)
        if all(s.is_finished for s in self.batch):
            for s in self.batch:
                super()._release(s)

    def live_seq_ids(self) -> list:
        held = [s.seq_id for s in self.batch if s.is_finished and self.allocator.has_seq(s.seq_id)]
        return super().live_seq_ids() + held

    def _on_fork(self, child: Sequence) -> None:
        super()._on_fork(child)
        self.batch.append(child)


class StaticScheduler(StaticBatching, Scheduler):
    """Static batching over the continuous scheduler's ``_schedule_running`` (with preemption off)."""
