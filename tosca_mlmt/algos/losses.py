"""Policy losses, value loss and KL estimators: pure functions, policy losses in a registry.

Every policy loss takes the same arguments, ``(logp, old_logp, adv, mask, agg=, clip_low=,
clip_high=)``, ignoring the knobs it has no use for, so a trainer calls any of them alike.

Shapes: B = sequences, T = tokens. ``mask`` [B, T] is 1 on tokens the policy generated.
"""

from __future__ import annotations

from typing import Callable

import torch

from tosca_mlmt.algos import registrar

from tosca_mlmt.tensors import masked_mean

POLICY_LOSSES: dict[str, Callable] = {}


register = registrar(POLICY_LOSSES)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """token-mean: every token weighs the same (long answers are not down-weighted);
    seq-mean-token-mean: every sequence weighs the same."""
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "seq-mean-token-mean":
        return masked_mean(loss, mask, dim=1).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")


@register("ppo_clip")
def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token-mean", **_) -> tuple[torch.Tensor, dict]:
    """L = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A),  rho = pi / pi_old."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.min(unclipped, clipped)
    with torch.no_grad():
        clipfrac = masked_mean((clipped < unclipped).float(), mask)  # the clip was active
        approx_kl = masked_mean((ratio - 1) - (logp - old_logp), mask)  # k3 estimate of KL(old || new)
    return aggregate(loss, mask, agg), {"clipfrac": clipfrac.item(), "approx_kl": approx_kl.item(),
                                        "ratio_mean": masked_mean(ratio.detach(), mask).item()}


@register("reinforce")
def reinforce_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                   agg: str = "token-mean", **_) -> tuple[torch.Tensor, dict]:
    """L = -A * log pi (on-policy policy gradient; old_logp unused except for diagnostics)."""
    loss = -adv * logp
    with torch.no_grad():
        approx_kl = masked_mean(torch.exp(logp - old_logp) - 1 - (logp - old_logp), mask)
    return aggregate(loss, mask, agg), {"clipfrac": 0.0, "approx_kl": approx_kl.item(), "ratio_mean": 1.0}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2) -> tuple[torch.Tensor, dict]:
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), token-mean."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2)
    with torch.no_grad():
        vclipfrac = masked_mean(((v_clipped - returns) ** 2 > (values - returns) ** 2).float(), mask)
    return masked_mean(loss, mask), {"vf_clipfrac": vclipfrac.item()}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    k1 = log pi - log pi_ref (unbiased, can be negative); k3 = exp(-k1) - 1 + k1 (unbiased, >= 0).
    """
    k1 = logp - ref_logp
    if kind == "k1":
        return k1
    if kind == "k3":
        return torch.exp(-k1) - 1 + k1
    raise ValueError(f"unknown KL estimator {kind!r}; allowed: k1, k3")


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over action tokens (1 = perfect critic, <= 0 = useless)."""
    m = mask > 0
    r, v = returns[m], values[m]
    var_r = r.var(unbiased=False)
    return float("nan") if var_r == 0 else float(1 - (r - v).var(unbiased=False) / var_r)
