"""The EAGLE-3 proposer (Li et al. 2025): EAGLE's drafting, from the target's low, middle and high states.

Everything about *when* and *where* is EAGLE's (``eagle.py``): a catch-up pass over the positions the target
just computed, then k drafting passes (or EAGLE-2's dynamic tree, ``eagle_tree.py``), the head's K/V one more
layer of the target's paged cache, drafts in scratch blocks. Two things differ, both the head's
(``minibatch/model/eagle3_head.py``):

* the feature of a computed position is g = fc(cat(l, m, h)), three of the target's hidden states at every
  token of the step (``hidden_states`` = the head's layers, e.g. the states after blocks 1, 2 and 4), fused
  here once per step, [T, 3C] -> [T, C]; a drafted entry reads the layer's own previous output instead,
  exactly as it was trained (the training-time test);
* a guess is scored through the head's own RMSNorm before the target's tied head (``head.logits``), since
  its output was never trained to be a feature of the target's.

Lossless at any temperature, as EAGLE: drafts sampled from q go to the rejection sampler with q.
"""
from __future__ import annotations

import torch

from minibatch.spec_decode.eagle import EagleProposer


class Eagle3Proposer(EagleProposer):
    method = "eagle3"

    def __init__(self, target, head, k: int, engine_config, tree=None):
        super().__init__(target, head, k, engine_config, tree)
        self.hidden_states = tuple(head.hidden_states)       # the runner returns these at every token (all_hidden)

    def features(self, hidden_states: dict) -> torch.Tensor:
        return self.head.fuse([hidden_states[i] for i in self.hidden_states])           # [T, C]
