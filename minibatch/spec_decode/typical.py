"""Medusa's *typical acceptance* (Cai et al. 2024, §2.3.1): LOSSY, and only as an explicit opt-in.

    speculative_config={"method": "medusa", "num_speculative_tokens": 4, "acceptance": "typical",
                        "posterior_threshold": 0.09, "posterior_alpha": 0.3}      # Medusa's defaults

The rejection sampler keeps the output distributed exactly as the target's; for a draft with a one-hot
q (Medusa's top-1) it accepts x with probability p(x), which at temperature 1 is often low. Typical
acceptance instead accepts x, deterministically, when the target finds it *typical enough*:

    p(x) > min(epsilon, delta * exp(-H(p)))          H(p) = the target's entropy at that position

(a high-entropy p lowers the bar), keeps the accepted prefix, and then samples the next token from the
target's p at the first position not accepted (no residual: there is no q to subtract). Greedy rows are
unaffected (they accept exactly the argmax either way).

The output is then **not** distributed as the target's: tokens the target finds plausible but would
have sampled less often get through every time. Every output of such an engine says so
(``CompletionOutput.spec["lossless"] = False``), and ``tests/test_spec_methods.py`` measures the
distance (the total variation of the first tokens' joint distribution from the target's exact one).
"""
from __future__ import annotations

import math

import torch

DEFAULTS = {"posterior_threshold": 0.09, "posterior_alpha": 0.3}      # Medusa's epsilon and delta
ACCEPTANCE = ("rejection", "typical")


def check_typical_config(spec_config: dict) -> None:
    acc = spec_config.get("acceptance", "rejection")
    if acc not in ACCEPTANCE:
        raise ValueError(f"unknown acceptance {acc!r}; choose one of {list(ACCEPTANCE)} ('typical' is lossy)")
    for key in DEFAULTS:
        if key in spec_config and acc != "typical":
            raise ValueError(f"{key} applies only with acceptance='typical'")
    eps = spec_config.get("posterior_threshold", DEFAULTS["posterior_threshold"])
    delta = spec_config.get("posterior_alpha", DEFAULTS["posterior_alpha"])
    if not (isinstance(eps, (int, float)) and 0 < eps <= 1 and isinstance(delta, (int, float)) and delta > 0):
        raise ValueError(f"need 0 < posterior_threshold <= 1 and posterior_alpha > 0, got {eps!r}, {delta!r}")


def typical_params(spec_config) -> tuple | None:
    """(epsilon, delta) when typical acceptance is asked for, else None (the lossless rejection sampler)."""
    if not spec_config or spec_config.get("acceptance", "rejection") != "typical":
        return None
    return (spec_config.get("posterior_threshold", DEFAULTS["posterior_threshold"]),
            spec_config.get("posterior_alpha", DEFAULTS["posterior_alpha"]))


def typical_accept(drafts: list, p: torch.Tensor, eps: float, delta: float, generator=None) -> tuple[list, int]:
    """One row: drafts [k], p [k + 1, V] (the target's distributions at the request's temperature) ->
    (the accepted drafts + one token sampled from p after them, the number accepted)."""
    n = 0
    for i, x in enumerate(drafts):
        h = -(p[i] * p[i].clamp_min(1e-30).log()).sum().item()                  # entropy of p_i, nats
        if not p[i, x].item() > min(eps, delta * math.exp(-h)):
            break
        n += 1
    extra = int(torch.multinomial(p[n].double(), 1, generator=generator))
    return list(drafts[:n]) + [extra], n
