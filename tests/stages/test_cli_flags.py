"""Every config-driven command takes the same common options, spelt, documented and mapped alike."""

import pytest
import typer

from tosca_mlmt.cli.common import common_overrides
from tosca_mlmt.cli.main import app

COMMANDS = ("collect", "train-lower", "train-upper", "train-joint", "eval", "chat")
COMMON = {"--config": COMMANDS, "--set": COMMANDS, "--seed": COMMANDS, "--data": COMMANDS,
          "--no-wandb": COMMANDS[:-1], "--no-progress": COMMANDS[:-1]}  # chat logs nothing and shows no bars


def _options(name: str) -> dict[str, str]:
    cmd = typer.main.get_command(app).commands[name]
    return {opt: p.help for p in cmd.params for opt in getattr(p, "opts", [])}


@pytest.mark.parametrize("flag", sorted(COMMON))
def test_a_common_flag_has_one_spelling_and_one_help_text_on_every_command(flag):
    helps = {name: _options(name).get(flag) for name in COMMON[flag]}
    missing = [n for n, h in helps.items() if h is None]
    assert not missing, f"{flag} missing on {missing}"
    assert len(set(helps.values())) == 1, helps


def test_common_options_map_to_their_config_fields():
    assert common_overrides() == {}
    assert common_overrides(seed=0, data="d", no_wandb=True, no_progress=True) == {
        "seed": 0, "task.data_path": "d", "logging.wandb": False, "logging.progress": False}
