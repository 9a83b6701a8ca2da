"""``logging:``, ``collect:`` and ``distributed:`` sections: where a run reports and writes,
and how its processes talk to each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tosca_mlmt.config.knobs import EXISTING_FILE_OR_EMPTY, ID_LIST, NON_EMPTY, knob
from tosca_mlmt.config.section import Section


@dataclass
class LoggingConfig(Section):
    wandb: bool = knob(True, "Log to Weights & Biases.")
    wandb_mode: str = knob("offline", "offline needs no account; sync later with `wandb sync`.",
                           choices=("offline", "online", "disabled"))
    project: str = knob("tosca-mlmt", "wandb project name.", rule=NON_EMPTY)
    progress: bool = knob(True, "Show progress bars.")


@dataclass
class CollectConfig(Section):
    out: str = knob("snapshots", "Snapshot root folder.", rule=NON_EMPTY)
    parents: list = knob(dataclasses.MISSING, "Parent snapshot ids recorded in provenance.", default_factory=list,
                         rule=ID_LIST)


@dataclass
class DistributedConfig(Section):
    deepspeed: str = knob("", "DeepSpeed JSON config (e.g. configs/deepspeed/zero2.json); empty = plain DDP when "
                              "launched with several processes. Its \"auto\" batch/clip fields are filled from "
                              "lower.*/upper.*.", rule=EXISTING_FILE_OR_EMPTY)
    backend: str = knob("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU.",
                        choices=("auto", "gloo", "nccl"))
    timeout_minutes: int = knob(30, "Collective timeout; a rank that waits longer fails instead of hanging.", min=1)
