"""Which rank holds which heads' K/V under tensor parallelism (``minibatch/distributed/tp_model.py``).

A grid, layers down and attention heads across, each cell coloured by the rank that computes that head and
keeps its K/V: rank r holds heads r·H/W .. (r+1)·H/W - 1 in *every* layer, so its KV cache is
[layers, 2, blocks, block_size, H/W, head_dim] and every rank shares the same block ids. Beside each layer,
the two all-reduces of its block (attention's c_proj, the MLP's c_proj). Plain numbers in, a figure out.
"""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minibatch.viz.common import styled

RANK_COLORS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#000000")


def head_owner(head: int, n_head: int, world: int) -> int:
    """The rank that holds ``head``: heads are cut into ``world`` contiguous runs of n_head / world."""
    if n_head % world:
        raise ValueError(f"{world} ranks do not divide {n_head} heads")
    if not 0 <= head < n_head:
        raise ValueError(f"head {head} is not in 0..{n_head - 1}")
    return head // (n_head // world)


@styled
def draw_tp_heads(n_layer: int, n_head: int, world: int, ax=None) -> dict:
    """The layers x heads grid coloured by rank; returns {"ax", "owners": [[rank per head] per layer]}."""
    if world > len(RANK_COLORS):
        raise ValueError(f"at most {len(RANK_COLORS)} ranks can be told apart by colour, got {world}")
    if ax is None:
        ax = Figure(figsize=(2 + 1.2 * n_head, 1 + 0.8 * n_layer), layout="constrained").subplots()
    owners = [[head_owner(h, n_head, world) for h in range(n_head)] for _ in range(n_layer)]
    for layer, row in enumerate(owners):
        for h, r in enumerate(row):
            ax.add_patch(Rectangle((h + 0.05, layer + 0.05), 0.9, 0.9, facecolor=RANK_COLORS[r], edgecolor="white"))
            ax.text(h + 0.5, layer + 0.5, f"rank {r}", ha="center", va="center", color="white", fontsize=9)
        ax.text(n_head + 0.1, layer + 0.5, "2 all-reduces", va="center", fontsize=9)
    ax.set_xlim(0, n_head + 1.6)
    ax.set_ylim(n_layer, 0)
    ax.set_xticks([h + 0.5 for h in range(n_head)], [f"head {h}" for h in range(n_head)])
    ax.set_yticks([layer + 0.5 for layer in range(n_layer)], [f"layer {layer}" for layer in range(n_layer)])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"tensor_parallel_size = {world}: each rank computes, and caches the K/V of, "
                 f"{n_head // world} of {n_head} heads", loc="left")
    return {"ax": ax, "owners": owners}
