"""train-joint's one timeline: every record any of its stages logs (``upper/*`` per update and
eval, ``lower/*`` per PPO iteration, ``joint/*`` per finished round step) goes to the joint
run's ``metrics.jsonl`` and wandb run at the next step of one global counter, so a wandb chart
of a joint run reads left to right across rounds. The stages still write their own per-round
``metrics.jsonl`` (their resume cuts those back to their checkpoints).

Resume: the joint file is cut back to the manifest's ``metrics_bytes`` and the counter to its
``global_step`` (both saved after every finished round step). A stage that then resumes from a
mid-step checkpoint does not log again what it logged before that checkpoint, so its sink
replays those records (its own file, already cut back) into the timeline first: the joint file
ends up equal to an uninterrupted run's, step for step.
"""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tosca_mlmt import parallel as dist
from tosca_mlmt.metrics import MetricsSink


class Timeline:
    """The global step of a joint run over its sink; ``tee(stage)`` is what a stage's own sink
    forwards each record to."""

    def __init__(self, sink: MetricsSink, step: int = 0):
        self.sink = sink
        self.step = step
        self.round = 0
        self.on_record = None  # (stage, stage step) -> None: moves the progress bar

    def log(self, metrics: dict) -> int:
        """One record at the next global step (every record its own step: wandb wants them rising)."""
        self.step += 1
        self.sink.log(metrics, step=self.step)
        return self.step

    def tee(self, stage: str):
        """The forwarder for ``stage``'s sink: its record, with the round and the stage's own step."""
        def forward(metrics: dict, step: int | None) -> None:
            self.log({**metrics, "joint/round": self.round, **({f"{stage}/step": step} if step is not None else {})})
            if self.on_record is not None and step is not None:
                self.on_record(stage, step)
        return forward


def round_line(r: int, rounds: int, rec: dict, seconds: float) -> str:
    """The round's headline numbers, from the manifest's record of it (what a step did not
    measure is left out: a frozen writer has no collect and no Q)."""
    parts = []
    c = rec.get("collect_metrics") or {}
    if "acc_t1" in c:
        parts.append(f"acc_t1 {c['acc_t1']:.2f} -> final {c.get('acc_final', float('nan')):.2f} (collect)")
    lo = rec.get("lower_metrics") or {}
    if "reward_mean" in lo:
        parts.append(f"PPO reward {lo['reward_mean']:.2f} ±{lo.get('reward_std', 0.0):.2f}")
    if "frac_reward_zero_std" in lo:
        parts.append(f"zero-std groups {lo['frac_reward_zero_std']:.0%}")
    q = [v for k, v in (rec.get("upper_metrics") or {}).items() if k.startswith("q/")]
    if q:
        parts.append(f"Q spread {max(q) - min(q):.2f}")
    e = rec.get("eval_metrics") or {}
    if "acc_t1" in e:
        parts.append(f"held-out acc_t1 {e['acc_t1']:.2f} -> final {e.get('acc_final', float('nan')):.2f} (eval)")
    parts.append(f"{seconds / 60:.1f} min")
    return f"round {r + 1}/{rounds}: " + ", ".join(parts)


def summary_rows(manifest: dict) -> list[dict]:
    """One row per round of a joint run's manifest, for the table printed once at the end: the
    same headline numbers as the per-round lines, for every round (a resumed run printed lines
    only for the rounds it ran itself). What a round did not measure is None."""
    def get(rec, part, key):
        v = (rec.get(part) or {}).get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    rows = []
    for rec in manifest.get("rounds", []):
        rows.append({"round": rec["round"] + 1, "snapshot": rec.get("snapshot"),
                     "acc_t1": get(rec, "collect_metrics", "acc_t1"),
                     "acc_final": get(rec, "collect_metrics", "acc_final"),
                     "ppo_reward": get(rec, "lower_metrics", "reward_mean"),
                     "eval_acc_final": get(rec, "eval_metrics", "acc_final"),
                     "minutes": sum((rec.get("seconds") or {}).values()) / 60})
    return rows


class RoundsBar:
    """One bar over rounds x (collect + upper steps + PPO iterations), with an ETA. The stages'
    own bars are off under train-joint (rich shows one live display at a time); this one moves
    with every record a stage logs."""

    def __init__(self, cfg, console, done_rounds: int):
        jc = cfg.joint
        self.size = {"collect": 1, "upper": jc.upper_steps, "lower": jc.lower_iterations, "eval": 1}
        self.offset = {"collect": 0, "upper": 1, "lower": 1 + jc.upper_steps, "eval": 1 + jc.upper_steps + jc.lower_iterations}
        if not jc.eval_problems:
            del self.size["eval"]
        self.per_round = sum(self.size.values())
        self.rounds = jc.rounds
        self.progress = Progress(TextColumn("[bold]train-joint[/] {task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 disable=not (cfg.logging.progress and dist.is_main()), console=console)
        self.bar = self.progress.add_task("", total=jc.rounds * self.per_round, completed=done_rounds * self.per_round)

    def at(self, r: int, step: str, inner: int = 0) -> None:
        """Round ``r``'s ``step`` has done ``inner`` of its units (upper steps, PPO iterations)."""
        self.progress.update(self.bar, completed=r * self.per_round + self.offset[step] + min(inner, self.size[step]),
                             description=f"round {r + 1}/{self.rounds} {step}")

    def done(self, r: int, step: str) -> None:
        self.at(r, step, self.size[step])  # also a skipped step (upper_every, a frozen role)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)
