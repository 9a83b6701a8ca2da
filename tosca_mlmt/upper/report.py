"""Evaluation of the learned strategy values on the logged data, and the preference report.

* Q by strategy: mean Q(s, a) over all logged states, per strategy.
* Off-policy value: the policy collect would run with this Q (episode.strategy_selection)
  and the greedy policy, each estimated by self-normalised importance sampling from the
  logged behaviour probabilities, next to the behaviour policy's own mean return.
* Report: per task type (task name + level), which strategies the writer prefers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from tosca_mlmt.algos.qlearning import importance_weighted_value
from tosca_mlmt.upper.dataset import Transition
from tosca_mlmt.upper.objective import PolicySpec


@dataclass(frozen=True)
class QEvaluation:
    """One evaluation of Q (``UpperLearner.evaluate``): what the metrics row and the report read."""

    q: torch.Tensor  # Q(s, .) [M, A] of the evaluated states (upper.eval_states)
    metrics: dict[str, float]  # evaluate_q's: mean Q per strategy, off-policy values, agreement


def off_policy_values(transitions: list[Transition], pi: torch.Tensor) -> dict[str, float]:
    """Weighted-IS value of the strategy policy pi [N, A] (one row per transition) vs behaviour."""
    episodes: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, t in enumerate(transitions):
        episodes[(t.snapshot_id, t.episode_id)].append(i)
    keys = list(episodes)
    K = max(len(v) for v in episodes.values())
    target = torch.ones(len(keys), K, dtype=torch.float64)
    behaviour = torch.ones_like(target)
    mask = torch.zeros_like(target)
    returns = torch.zeros(len(keys), dtype=torch.float64)
    for e, key in enumerate(keys):
        for k, i in enumerate(episodes[key]):
            t = transitions[i]
            target[e, k] = float(pi[i, t.action])
            behaviour[e, k] = t.behaviour_prob
            mask[e, k] = 1.0
        returns[e] = transitions[episodes[key][0]].episode_return
    est = importance_weighted_value(returns, target, behaviour, mask)
    return {k: float(v) for k, v in est.items()}


def evaluate_q(q: torch.Tensor, transitions: list[Transition], strategies: list[dict],
               policy: PolicySpec) -> dict[str, float]:
    """Metrics from Q of every logged state (q [N, A])."""
    names = [s["name"] for s in strategies]
    out: dict[str, float] = {}
    for a, name in enumerate(names):
        out[f"q/{name}"] = float(q[:, a].mean())
    pi = policy.probs(q)
    greedy = PolicySpec("greedy").probs(q)
    for k, v in off_policy_values(transitions, pi).items():
        out[f"ope/{k}"] = v
    for k, v in off_policy_values(transitions, greedy).items():
        if k != "behaviour_value":
            out[f"ope/greedy_{k}"] = v
    out["v_mean"] = float((pi * q).sum(-1).mean())
    logged = torch.tensor([t.action for t in transitions])
    out["greedy_agrees_with_data"] = float((q.argmax(1) == logged).float().mean())
    return out


def preference_table(q: torch.Tensor, transitions: list[Transition], strategies: list[dict],
                     policy: PolicySpec) -> dict[str, list[dict]]:
    """{task type: [one row per strategy]} with logged counts and returns, mean Q, mean pi, argmax share."""
    pi = policy.probs(q).numpy()
    qn = q.numpy()
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(transitions):
        groups[t.task_type].append(i)
    table = {}
    for tt in sorted(groups):
        idx = np.array(groups[tt])
        top = qn[idx].argmax(1)
        rows = []
        for a, s in enumerate(strategies):
            logged = [transitions[i].ret for i in idx if transitions[i].action == a]
            rows.append({"strategy": s["name"], "logged": len(logged),
                         "logged_return": float(np.mean(logged)) if logged else None,
                         "q": float(qn[idx, a].mean()), "pi": float(pi[idx, a].mean()),
                         "argmax_share": float((top == a).mean())})
        table[tt] = rows
    return table


def render_markdown(table: dict[str, list[dict]], ope: dict[str, float], run_info: dict) -> str:
    lines = ["# Feedback-writer strategy preferences", ""]
    lines += [f"- snapshots: {', '.join(run_info['snapshots'])}",
              f"- decisions: {run_info['transitions']} ({run_info['episodes']} episodes), steps: {run_info['steps']}"
              + (f"; Q evaluated on a sample of {run_info['evaluated']} (upper.eval_states)"
                 if run_info.get("evaluated", run_info["transitions"]) < run_info["transitions"] else ""),
              f"- Q source: {run_info['q_source']}, conservatism: {run_info['conservatism']}, "
              f"strategy selection at collect: {run_info['selection']}",
              f"- estimated value of the {run_info.get('q_policy', run_info['selection'])} policy on this Q "
              f"(weighted IS): {ope.get('ope/value', float('nan')):.3f} "
              f"vs behaviour {ope.get('ope/behaviour_value', float('nan')):.3f} "
              f"(ESS {ope.get('ope/ess', float('nan')):.1f} of {run_info['episodes']} episodes; "
              f"greedy {ope.get('ope/greedy_value', float('nan')):.3f}, "
              f"ESS {ope.get('ope/greedy_ess', float('nan')):.1f})", ""]
    for tt, rows in table.items():
        best = max(rows, key=lambda r: r["pi"])
        lines += [f"## {tt}: prefers `{best['strategy']}` (pi {best['pi']:.2f})", "",
                  "| strategy | logged | logged return | mean Q | mean pi | argmax share |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in sorted(rows, key=lambda r: -r["pi"]):
            lr = "-" if r["logged_return"] is None else f"{r['logged_return']:.3f}"
            lines.append(f"| {r['strategy']} | {r['logged']} | {lr} | {r['q']:.3f} | {r['pi']:.3f} | "
                         f"{r['argmax_share']:.2f} |")
        lines.append("")
    lines += ["Logged return is the mean discounted return-to-go of the decisions that used the strategy; "
              "strategies with few logged decisions have unreliable Q (CQL holds unlogged ones down).", ""]
    return "\n".join(lines)
