"""``logging:``, ``collect:`` and ``distributed:`` sections: where a run reports and writes,
and how its processes talk to each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tosca_mlmt.config.knobs import EXISTING_FILE_OR_EMPTY, ID_LIST, NON_EMPTY, Rule, knob
from tosca_mlmt.config.section import Section

# The trackers a run's metrics sink can mirror its records to. They are named here, not in
# tosca_mlmt/trackers.py (which builds each through accelerate), because config/ may import only
# the ground floor; tests/unit/test_trackers.py fails when the two lists differ.
TRACKERS = ("wandb", "tensorboard")
# collect's per-turn temperatures: -1 keeps the role's own solver_/writer_sampling.temperature
COLLECT_TEMPERATURE = Rule("-1 (the role's own sampling temperature), 0 (greedy) or >= 0.001",
                           lambda v: v == -1 or v == 0 or v >= 1e-3)
TRACKER_LIST = Rule(f"a list of distinct names from: {', '.join(TRACKERS)}",
                    lambda v: all(isinstance(s, str) and s in TRACKERS for s in v) and len(set(v)) == len(v))


@dataclass
class LoggingConfig(Section):
    wandb: bool = knob(True, "Mirror metrics to the trackers in logging.trackers; false (--no-wandb) = to none "
                             "(metrics.jsonl is always written).")
    trackers: list = knob(dataclasses.MISSING, "Where metrics are mirrored besides metrics.jsonl: wandb (a wandb/ "
                                               "run folder, logging.wandb_mode) and/or tensorboard (event files in "
                                               "the run's tb/ folder).",
                          default_factory=lambda: ["wandb"], rule=TRACKER_LIST)
    wandb_mode: str = knob("offline", "offline needs no account; sync later with `wandb sync`; disabled = no wandb "
                                      "(other trackers still log).",
                           choices=("offline", "online", "disabled"))
    project: str = knob("tosca-mlmt", "wandb project name.", rule=NON_EMPTY)
    progress: bool = knob(True, "Show progress bars.")

    def active_trackers(self) -> tuple[str, ...]:
        """The trackers a sink opens: none with ``wandb: false`` (the switch every ``--no-wandb``
        flag sets, kept as "no trackers" so existing configs and flags mean what they did), and
        wandb left out under ``wandb_mode: disabled``."""
        if not self.wandb:
            return ()
        return tuple(t for t in self.trackers if not (t == "wandb" and self.wandb_mode == "disabled"))


@dataclass
class CollectConfig(Section):
    out: str = knob("snapshots", "Snapshot root folder.", rule=NON_EMPTY)
    parents: list = knob(dataclasses.MISSING, "Parent snapshot ids recorded in provenance.", default_factory=list,
                         rule=ID_LIST)
    solve_temperature: float = knob(-1.0, "Solver temperature of turn 1 in collect (and train-joint's writer "
                                          "collect); -1 = solver_sampling.temperature. 0 = greedy, as mlmt eval "
                                          "decodes it: the writer learns on the attempts it will be shown at eval "
                                          "(greedy attempts are right about twice as often as T = 0.7 ones), and a "
                                          "problem's n_samples episodes share one attempt and differ only by "
                                          "strategy and feedback text. train-lower's PPO batches always sample.",
                                    rule=COLLECT_TEMPERATURE)
    refine_temperature: float = knob(-1.0, "Solver temperature of the refine turns collect logs; -1 = "
                                           "solver_sampling.temperature. 0 = greedy, as mlmt eval decodes them: a "
                                           "decision's reward is then what its feedback does to the solver it is "
                                           "evaluated with, not sampling noise.", rule=COLLECT_TEMPERATURE)
    writer_temperature: float = knob(-1.0, "Writer temperature of the feedback text collect logs (and "
                                           "train-joint's writer collect); -1 = writer_sampling.temperature. 0 = "
                                           "greedy, as mlmt eval writes it: Q then scores the text the writer "
                                           "will write at eval. Fitted on text sampled at T = 0.7, Q ranked "
                                           "check_arithmetic first for right attempts (it broke 3 of 34 in "
                                           "collect), and its greedy text at eval broke 16 of 66. The strategy "
                                           "is still drawn by episode.strategy_selection.",
                                     rule=COLLECT_TEMPERATURE)


@dataclass
class DistributedConfig(Section):
    deepspeed: str = knob("", "DeepSpeed JSON config (e.g. configs/deepspeed/zero2.json); empty = plain DDP when "
                              "launched with several processes. Its \"auto\" batch/clip fields are filled from "
                              "lower.*/upper.*.", rule=EXISTING_FILE_OR_EMPTY)
    backend: str = knob("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU.",
                        choices=("auto", "gloo", "nccl"))
    timeout_minutes: int = knob(30, "Collective timeout; a rank that waits longer fails instead of hanging.", min=1)
