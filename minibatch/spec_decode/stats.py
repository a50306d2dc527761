"""What to expect from speculation, and what a run measured: alpha, tau, the expected-speed-up formulas."""
from __future__ import annotations

from dataclasses import dataclass, field


# -- what to expect: Leviathan et al., 2023, Sec. 3.1 and 3.3 -----------------------------------------------------

def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0 <= alpha <= 1:
        raise ValueError(f"acceptance rate alpha must lie in [0, 1], got {alpha}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens one verify step emits: (1 - alpha^(k+1)) / (1 - alpha), and k + 1 at alpha = 1.

    Derivation (Leviathan et al., Eq. 1), assuming each draft is accepted independently with probability
    alpha: the step emits at least 1 token (the replacement or bonus); it emits more than j tokens exactly
    when the first j drafts are all accepted, probability alpha^j. So
        E[tokens] = sum_{j=0..k} P(tokens > j) = sum_{j=0..k} alpha^j = (1 - alpha^(k+1)) / (1 - alpha).
    Computed as the sum, which needs no special case at alpha = 1 and loses no precision near it.
    """
    _check_alpha_k(alpha, k)
    return float(sum(alpha ** j for j in range(k + 1)))


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Expected wall-time speedup over plain decoding: (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)).

    Leviathan et al., Theorem 3.8. Measure time in target forwards: one step costs k draft forwards of
    c each (c = draft cost / target cost) plus one target forward, k c + 1 in all, and emits
    E[tokens] = (1 - alpha^(k+1)) / (1 - alpha) tokens; plain decoding emits 1 token per 1 forward. The
    ratio of tokens per unit time is the speedup. It assumes verifying k + 1 tokens costs the same as
    decoding 1 (true while decode is memory-bound), so it is an upper bound when the batch is large.
    """
    _check_alpha_k(alpha, k)
    if not c >= 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_tokens_per_step(alpha, k) / (k * c + 1)


# -- counters ----------------------------------------------------------------------------------------------------

@dataclass
class SpecStats:
    """Speculative-decoding counters for one request (or, merged, a run)."""
    proposed: int = 0        # draft tokens verified
    accepted: int = 0        # ... of which the target kept
    num_steps: int = 0       # target forwards that verified drafts
    emitted: int = 0         # tokens those steps appended (accepted + one replacement or bonus each)
    steps_by_k: dict = field(default_factory=dict)   # {k: verify steps that checked k drafts}; k shrinks near the end
    # by draft position i = 1, 2, ... (index i - 1): how often position i was *reached* (proposed, with positions
    # 1 .. i-1 all accepted: only then does the target judge it) and how often it was accepted
    reached_at: list = field(default_factory=list)
    accepted_at: list = field(default_factory=list)

    tree_steps: int = 0      # ... of which verified a token tree (position i is then depth i)

    def add(self, proposed: int, accepted: int, emitted: int, judged=None) -> "SpecStats":
        """Count one verify step. A token tree also gives ``judged``: the depths the target judged (its accepted
        path's length, + 1 when the path's last node has children the target rejected)."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got accepted={accepted}, proposed={proposed}")
        if emitted < 0:
            raise ValueError(f"emitted must be >= 0, got {emitted}")
        if judged is not None and not accepted <= judged <= accepted + 1:
            raise ValueError(f"a tree step judges its accepted depths and at most one more: got judged={judged}, "
                             f"accepted={accepted}")
        self.proposed += proposed
        self.accepted += accepted
        self.num_steps += 1
        self.emitted += emitted
        if judged is None:
            self.steps_by_k[proposed] = self.steps_by_k.get(proposed, 0) + 1
        else:
            self.tree_steps += 1
        # a chain with a of k accepted: positions 1..a accepted, a + 1 rejected (if a < k), a + 2.. never judged
        reached = min(proposed, accepted + 1) if judged is None else judged
        for lst, n in ((self.reached_at, reached), (self.accepted_at, accepted)):
            lst.extend([0] * (n - len(lst)))
            for i in range(n):
                lst[i] += 1
        return self

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Add another request's counters into these (in place; returns self)."""
        if not isinstance(other, SpecStats):
            raise TypeError(f"can only merge SpecStats, got {type(other).__name__}")
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.num_steps += other.num_steps
        self.tree_steps += other.tree_steps
        self.emitted += other.emitted
        for k, n in other.steps_by_k.items():
            self.steps_by_k[k] = self.steps_by_k.get(k, 0) + n
        for mine, theirs in ((self.reached_at, other.reached_at), (self.accepted_at, other.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
        return self

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / proposed (0.0 before anything was proposed). For a token tree this is per draft
        node, so it is low by design (most siblings must lose); read ``acceptance_by_position`` (by depth)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def acceptance_by_position(self) -> list:
        """alpha_i for draft positions i = 1, 2, ...: P(position i accepted | positions 1 .. i-1 accepted), the
        acceptance rate each position meets when the target actually judges it (EAGLE's "n-alpha", Li et al.
        2024 §5.3). Independent acceptances would make it flat; Medusa's heads make it fall with i."""
        return [a / r for a, r in zip(self.accepted_at + [0] * len(self.reached_at), self.reached_at)]

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens per verify step, the accepted drafts + the target's own token (EAGLE's tau)."""
        return self.mean_tokens_per_step

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens per verify step: compare with expected_tokens_per_step(alpha, k). 0.0 before any step."""
        return self.emitted / self.num_steps if self.num_steps else 0.0

    @property
    def expected_tokens_per_step(self) -> float:
        """The theory beside the measurement: expected_tokens_per_step(alpha, k) at the measured alpha, averaged
        over the steps' own k (drafts are cut short near max_tokens). It assumes acceptances independent of
        each other; measured above it means they come in runs (a predictable stretch accepts all its drafts).
        A chain's formula: with token trees in the run it is None (a tree's nodes are not k positions)."""
        if self.tree_steps:
            return None
        if not self.num_steps:
            return 0.0
        alpha = self.acceptance_rate
        return sum(n * expected_tokens_per_step(alpha, k) for k, n in self.steps_by_k.items()) / self.num_steps

    def to_dict(self) -> dict:
        counters = {name: getattr(self, name) for name in ("proposed", "accepted", "num_steps", "emitted")}
        return {**counters, "acceptance_rate": self.acceptance_rate,
                "acceptance_by_position": self.acceptance_by_position,
                "mean_tokens_per_step": self.mean_tokens_per_step,
                "expected_tokens_per_step": self.expected_tokens_per_step}
