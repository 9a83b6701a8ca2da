"""Episode summaries (pure) and a metrics sink (jsonl file + optional wandb / tensorboard)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tosca_mlmt import trackers as tracking
from tosca_mlmt.records import Episode
from tosca_mlmt.leak import leak_rate


def environment(episodes: list[Episode]) -> str:
    """"privileged:<what>" when the writer saw the verifier's verdict, the feedback was the verdict itself,
    or the writer read the verifier's ``feedback_context`` (mbpp: the first failing grading test's error):
    such numbers answer a sanity question and must never sit beside honest ones. Else "honest:tool" when
    a task's own check of the attempt (episode.writer_sees or feedback: tool) informed the feedback, else
    "honest"."""
    fbs = [t for ep in episodes for t in ep.turns if t.kind == "feedback"]
    if any(t.info.get("writer_sees") == "verdict" for t in fbs):
        return "privileged:writer_sees_verdict"
    if any(t.info.get("feedback") == "verdict" for t in fbs):
        return "privileged:verdict_feedback"
    if any(_writer_read_verifier_context(ep) for ep in episodes):
        return "privileged:grading_tests"
    if any("tool" in (t.info.get("writer_sees"), t.info.get("feedback")) for t in fbs):
        return "honest:tool"
    return "honest"


def _writer_read_verifier_context(ep: Episode) -> bool:
    """Whether a writer state of ``ep`` held a solver turn's ``feedback_context``: every solver turn
    before the last feedback turn is in that turn's state (rollout/turns.py: plan_feedback)."""
    last = max((i for i, t in enumerate(ep.turns) if t.kind == "feedback"), default=-1)
    if last >= 0 and "tool" in (ep.turns[last].info.get("writer_sees"), ep.turns[last].info.get("feedback")):
        return False  # under a tool the writer's state holds the task's public check in its place
    return any(t.info.get("feedback_context") for t in ep.turns[:last] if t.role == "solver")


def summarize(episodes: list[Episode]) -> dict[str, float]:
    """Acc@t1, Acc@final, their difference and the 2x2 correction rates; the rewards behind them
    (``reward_stats``: partial credit shows there, not in Acc).

    ``wrong_to_right`` and ``right_to_wrong`` are fractions of *all* episodes (as in
    SCoRe's Delta_i->c / Delta_c->i), so Acc@final - Acc@t1 = wrong_to_right - right_to_wrong.
    """
    if not episodes:
        return {"episodes": 0}
    c1 = np.array([ep.solver_turns[0].correct for ep in episodes], dtype=bool)
    cf = np.array([ep.solver_turns[-1].correct for ep in episodes], dtype=bool)
    out = {
        "environment": environment(episodes),
        "episodes": len(episodes),
        "acc_t1": float(c1.mean()),
        "acc_final": float(cf.mean()),
        "delta": float(cf.mean() - c1.mean()),
        "wrong_to_right": float((~c1 & cf).mean()),
        "right_to_wrong": float((c1 & ~cf).mean()),
    }
    # why a solver turn is wrong: no answer line the verifier could read (lost format) or a wrong number
    for name, idx in (("t1", 0), ("final", -1)):
        turns = [ep.solver_turns[idx] for ep in episodes]
        out[f"format_lost_{name}"] = float(np.mean([t.extracted is None for t in turns]))
        out[f"wrong_number_{name}"] = float(np.mean([t.extracted is not None and not t.correct for t in turns]))
    out.update(reward_stats(episodes))
    finish = Counter((t.kind, t.finish_reason) for ep in episodes for t in ep.turns)
    n_kind = Counter(t.kind for ep in episodes for t in ep.turns)
    for (kind, reason), n in sorted(finish.items()):
        out[f"finish_{reason}/{kind}"] = n / n_kind[kind]
    by_kind: dict[str, list[int]] = {}
    for ep in episodes:
        for t in ep.turns:
            by_kind.setdefault(t.kind, []).append(len(t.response_ids))
    for kind, lens in sorted(by_kind.items()):
        out[f"len_{kind}"] = float(np.mean(lens))
    leaks = leak_rate(episodes)  # feedback that gives the gold answer away; absent when unmeasured (code tasks)
    if leaks is not None:
        out["leak_rate"] = leaks
    strat = Counter(t.strategy_name for ep in episodes for t in ep.turns if t.kind == "feedback")
    for name, n in sorted(strat.items()):
        out[f"strategy_count/{name}"] = n
    out.update(strategy_shares(episodes))
    return out


def reward_stats(episodes: list[Episode]) -> dict[str, float]:
    """The verifier's reward of the first (t1) and the final solver turn, which Acc (reward >= 1 read
    as right) hides when the task gives partial credit: ``reward_mean_<turn>`` over episodes,
    ``reward_std_<turn>`` its spread over episodes (population std), and, where some problem has
    several samples, ``frac_reward_zero_std_<turn>``: the share of those problems whose samples all got
    the same reward (a GRPO group with no spread teaches nothing). Turns without a reward are left out;
    a key is absent where nothing was measured (no rewards; one sample per problem). Extra numbers a
    task.reward function logged (``context.log_metric``) follow: ``reward/<name>``, their mean over the
    solver turns that logged them (reward_extras)."""
    out: dict[str, float] = {}
    for name, idx in (("t1", 0), ("final", -1)):
        scored = [(ep.problem.id, float(ep.solver_turns[idx].reward)) for ep in episodes
                  if ep.solver_turns and ep.solver_turns[idx].reward is not None]
        if not scored:
            continue
        r = np.array([x for _, x in scored])
        out[f"reward_mean_{name}"] = float(r.mean())
        out[f"reward_std_{name}"] = float(r.std())
        by: dict[str, list[float]] = {}
        for pid, x in scored:
            by.setdefault(pid, []).append(x)
        groups = [v for v in by.values() if len(v) > 1]
        if groups:
            out[f"frac_reward_zero_std_{name}"] = float(np.mean([np.ptp(v) <= 1e-12 for v in groups]))
    out.update(reward_extras(episodes))
    return out


def reward_extras(episodes: list[Episode]) -> dict[str, float]:
    """``reward/<name>``: the mean of each extra metric a task.reward function logged
    (``info["reward_metrics"]``, tosca_mlmt/tasks/reward.py) over the solver turns that logged it; a turn
    whose reward call failed logged nothing. Sorted by name, so every record lists them alike."""
    values: dict[str, list[float]] = {}
    for ep in episodes:
        for t in ep.solver_turns:
            for k, v in (t.info.get("reward_metrics") or {}).items():
                values.setdefault(k, []).append(float(v))
    return {f"reward/{k}": float(np.mean(values[k])) for k in sorted(values)}


def strategy_shares(episodes: list[Episode]) -> dict[str, float]:
    """Whether the writer's choice depends on the attempt it answered: each strategy's share of the feedback
    that followed a right attempt and of the feedback that followed a wrong one (nan where there was none).
    Equal shares say the choice ignores correctness; in the verdict env the verdict sentences' shares say
    how often the feedback told the truth, the thing the solver's training under it depends on."""
    after: dict[bool, Counter] = {True: Counter(), False: Counter()}
    for ep in episodes:
        feedback = [t for t in ep.turns if t.kind == "feedback"]
        for attempt, fb in zip(ep.solver_turns, feedback):  # feedback k answers solver turn k
            after[bool(attempt.correct)][fb.strategy_name] += 1
    names = sorted(set(after[True]) | set(after[False]))
    return {f"strategy_share/{name}/after_{'right' if ok else 'wrong'}":
            (after[ok][name] / sum(after[ok].values()) if after[ok] else float("nan"))
            for name in names for ok in (True, False)}


class MetricsSink:
    """Appends one JSON object per ``log`` call to ``metrics.jsonl`` and mirrors it to the
    ``trackers`` (names from ``logging.trackers``: accelerate's wandb / tensorboard trackers,
    see tosca_mlmt/trackers.py); the file is the record, the trackers are for watching it."""

    def __init__(self, folder: str | Path, config: dict, trackers: Sequence[str] = (), wandb_mode: str = "offline",
                 project: str = "tosca-mlmt", name: str | None = None, enabled: bool | None = None):
        """``enabled`` defaults to "this is rank 0": other ranks log nothing and open no tracker.
        wandb's run folder goes under ``folder`` (``wandb/``), tensorboard's events to ``folder/tb``."""
        from tosca_mlmt import parallel

        self.folder = Path(folder)
        self.enabled = parallel.is_main() if enabled is None else enabled
        self.path = self.folder / "metrics.jsonl"
        self.trackers: list = []
        self.tee = None  # (metrics, step) -> None: a copy of each record for another timeline (train-joint's)
        if self.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.trackers = tracking.open_trackers(trackers, self.folder, config, project, name, wandb_mode)

    def tracker(self, name: str):
        """The open accelerate tracker called ``name`` (``.tracker`` is its wandb run or
        SummaryWriter), or None."""
        return next((t for t in self.trackers if t.name == name), None)

    def log(self, metrics: dict, step: int | None = None) -> None:
        if not self.enabled:
            return
        rec = {"time": time.time(), **({"step": step} if step is not None else {}), **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=float) + "\n")
        if self.trackers:
            values = {k: tracking.plain(v) for k, v in metrics.items()}
            for t in self.trackers:
                tracking.log(t, values, step=step)
        if self.tee is not None:
            self.tee(metrics, step)

    def log_table(self, key: str, rows: list[dict], step: int | None = None) -> None:
        """Log ``rows`` (dicts with the same keys) as a table under ``key`` to the trackers only
        (a wandb.Table; markdown text in TensorBoard), as metrics.jsonl holds numbers: sample
        episodes are for reading beside the curves."""
        if not self.trackers or not rows:
            return
        for t in self.trackers:
            tracking.log_table(t, key, rows, step=step)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            t.finish()


class StageTimer:
    """Named, timed stages: ``with timer("generate"): ...``; totals per name in seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Stage:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t0
                return False

        return _Stage()

    def as_metrics(self, prefix: str = "time/") -> dict[str, float]:
        return {prefix + k: round(v, 4) for k, v in self.seconds.items()}
