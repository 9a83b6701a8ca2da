"""``joint:`` section: the alternation schedule of train-joint."""

from __future__ import annotations

from dataclasses import dataclass

from tosca_mlmt.config.knobs import knob
from tosca_mlmt.config.section import Section


@dataclass
class JointConfig(Section):
    rounds: int = knob(3, "Rounds of collect -> train-upper -> train-lower.", min=1)
    collect_problems: int = knob(8, "Problems collected per round for the writer (x episode.n_samples episodes).",
                                 min=1)
    lower_iterations: int = knob(3, "tL: solver PPO iterations per round (each collects its own on-policy batch).",
                                 min=1)
    upper_steps: int = knob(20, "tH: writer gradient steps per writer update.", min=1)
    upper_every: int = knob(1, "Update the writer every N rounds (tL:tH = lower_iterations * N : 1 writer update).",
                            min=1)
    replay_window: int = knob(0, "The writer learns from the snapshots of the rounds since its last window "
                                 "updates (upper_every 1: this round's and the previous window - 1 ones; "
                                 "upper_every N: window x N rounds, so no round is collected for nothing); "
                                 "0 = every round's snapshot so far (a few decisions per round are too few to fit).",
                              min=0)
    writer_warmup: str = knob("run", "Where upper.warmup_steps (Q-only steps before the text loss) count: run = "
                                     "over the writer's steps of the whole run, so only the first update starts "
                                     "Q-only; update = at the start of every writer update, so Q is fitted again "
                                     "to the round's new decisions before the text loss reads it (the schedule "
                                     "before 2026-11-29, when each update restarted the count; it then needs "
                                     "upper.warmup_steps < joint.upper_steps).", choices=("run", "update"))
    freeze_solver: bool = knob(False, "Never update the solver (e.g. writer-only ablations).")
    freeze_writer: bool = knob(False, "Never update the writer (e.g. SCoRe-style self-correction baselines).")
    eval_problems: int = knob(0, "Held-out (test split) problems evaluated after each round with mlmt eval's "
                                 "protocol (greedy, one sample, the same strategy selection), logged as eval/* "
                                 "on the run's timeline; 0 = no per-round eval.", min=0)
    max_seconds: float = knob(0.0, "Wall-clock budget: no new round starts after this many seconds (0 = none). "
                                   "Lets baselines be compared at equal compute.", min=0.0)
