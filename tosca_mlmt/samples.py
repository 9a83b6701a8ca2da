"""Episodes as readable records: their outcome class, filters, and sample rows.

``mlmt snapshots show --episodes N`` prints these records, and collect / train-joint log
``sample_rows`` as a wandb table: reading the actual problem, attempt z, strategy, feedback g
and refine ŷ side by side is how a writer that gives the answer away, or a solver that ignores
the feedback, is noticed at all. Only the attributes of Episode/Turn are read (no import of
them), so this module does not depend on where those records live.
"""

from __future__ import annotations

from tosca_mlmt.leak import episode_leaks

# Turn-1 correctness -> final correctness (metrics.summarize's 2x2 table).
OUTCOMES = ("right_to_wrong", "wrong_to_right", "right_to_right", "wrong_to_wrong")
FILTERS = (*OUTCOMES, "leak")
# Refine info keys worth showing when a run logged them (episode.counterfactual, episode.gold_prob).
LOGGED_EXTRAS = ("counterfactual_reward", "gold_prob")
# The solver's context bonus of a refine, stored by train-lower with its batch snapshots
# (lower/stats.with_refine_bonus): the value added to the refine's advantages (summed over its
# tokens) and the raw, unclipped log-ratio term. Every record has both keys: None where no PPO
# update saw the episode (collect and eval snapshots, lower.bonus.coef 0), shown as "n/a".
BONUS_KEYS = ("bonus", "bonus_raw")


def outcome(ep) -> str:
    """One of OUTCOMES, from the first and last solver attempts."""
    s = ep.solver_turns
    first, last = bool(s[0].correct), bool(s[-1].correct)
    return f"{'right' if first else 'wrong'}_to_{'right' if last else 'wrong'}"


def matches(ep, which: str | None) -> bool:
    """Whether ``ep`` passes the filter ``which`` (None = every episode; ``leak`` = some
    feedback gave the gold answer away)."""
    if which is None:
        return True
    if which == "leak":
        return any(episode_leaks(ep))
    if which not in OUTCOMES:
        raise ValueError(f"unknown episode filter {which!r}; allowed: {', '.join(FILTERS)}")
    return outcome(ep) == which


def select(episodes, n: int, which: str | None = None) -> list:
    """The first ``n`` episodes (in snapshot order) that pass ``which``."""
    return [ep for ep in episodes if matches(ep, which)][:max(n, 0)]


def spread(episodes, n: int) -> list:
    """``n`` episodes taken in turn from each outcome class (snapshot order within a class), so a
    small table shows the rare right->wrong and wrong->right cases, not only the common ones."""
    groups = {o: [ep for ep in episodes if outcome(ep) == o] for o in OUTCOMES}
    out: list = []
    i = 0
    while len(out) < n and any(len(g) > i for g in groups.values()):
        out += [g[i] for g in groups.values() if len(g) > i][: n - len(out)]
        i += 1
    return out


def episode_record(ep) -> dict:
    """An episode decoded for reading: the problem, z, then one entry per feedback round."""
    solver = ep.solver_turns
    feedback = [t for t in ep.turns if t.kind == "feedback"]
    leaks = episode_leaks(ep)
    z = solver[0]
    rounds = []
    for k, (g, y) in enumerate(zip(feedback, solver[1:])):
        info = y.info or {}
        extras = {key: info[key] for key in LOGGED_EXTRAS if key in info}
        rounds.append({"round": k + 1, "strategy": g.strategy_name, "g": g.text, "leaked": leaks[k],
                       "y": y.text, "reward": y.reward, "correct": y.correct, "extracted": y.extracted,
                       **{key: info.get(key) for key in BONUS_KEYS}, **extras})
    return {"episode_id": ep.episode_id, "task": ep.problem.task, "problem": ep.problem.question,
            "gold": ep.problem.answer, "outcome": outcome(ep), "z": z.text, "r1": z.reward, "correct1": z.correct,
            "extracted1": z.extracted, "rounds": rounds}


SAMPLE_COLUMNS = ("episode_id", "outcome", "problem", "gold", "z", "r1", "strategy", "g", "y_hat", "r_final",
                  "rewards", "bonus", "leaked")


def bonus_text(value, raw) -> str:
    """A refine's bonus for reading: "0.0123 (raw 0.456)", or "n/a" when none was stored."""
    if value is None:
        return "n/a"
    return f"{value:.4g}" + ("" if raw is None else f" (raw {raw:.4g})")


def sample_rows(episodes, n: int = 16) -> list[dict]:
    """Up to ``n`` flat rows (SAMPLE_COLUMNS, plain str/float values) for a wandb table, spread
    over the outcome classes. With several rounds, strategy, g and bonus list every round's, in
    order."""
    rows = []
    for ep in spread(episodes, n):
        r = episode_record(ep)
        many = len(r["rounds"]) > 1
        rows.append({
            "episode_id": r["episode_id"], "outcome": r["outcome"], "problem": r["problem"], "gold": r["gold"],
            "z": r["z"], "r1": _num(r["r1"]),
            "strategy": " | ".join(str(x["strategy"]) for x in r["rounds"]),
            "g": "\n\n".join(f"[round {x['round']}] {x['g']}" if many else x["g"] for x in r["rounds"]),
            "y_hat": r["rounds"][-1]["y"] if r["rounds"] else "",
            "r_final": _num(r["rounds"][-1]["reward"] if r["rounds"] else r["r1"]),
            "rewards": " ".join(f"{_num(x):g}" for x in [r["r1"], *(x["reward"] for x in r["rounds"])]),
            "bonus": " | ".join(bonus_text(x["bonus"], x["bonus_raw"]) for x in r["rounds"]),
            "leaked": ",".join("-" if x["leaked"] is None else str(bool(x["leaked"])).lower() for x in r["rounds"]),
        })
    return rows


def _num(v) -> float:
    return float(v) if v is not None else float("nan")
