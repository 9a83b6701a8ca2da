"""``task:`` section: which verifiable problems an episode draws."""

from __future__ import annotations

from dataclasses import dataclass

from tosca_mlmt.config.knobs import EXISTING_DIR_OR_EMPTY, knob
from tosca_mlmt.config.section import Section


@dataclass
class TaskConfig(Section):
    name: str = knob("arith", "Verifiable task.", choices=("arith", "gsm8k", "math500", "mbpp"))
    data_path: str = knob("", "Data root for gsm8k/math500/mbpp (default: $TOSCA_MLMT_DATA or ../shared/data).",
                          rule=EXISTING_DIR_OR_EMPTY)
    split: str = knob("train", "Which split to draw problems from.", choices=("train", "test"))
    limit: int = knob(16, "Number of problems (0 = the whole split).", min=0)
    level: int = knob(1, "arith difficulty level (README: levels and measured base rates).", min=1, max=6)
    skip_bad_rows: bool = knob(False, "Drop malformed data rows (counted in the manifest) instead of failing.")
