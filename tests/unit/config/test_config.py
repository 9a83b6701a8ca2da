import re

import pytest

from tosca_mlmt.config import Config, describe_fields, load_config
from tosca_mlmt.errors import ConfigError


def test_defaults_validate_and_every_field_has_help():
    cfg = load_config()
    assert isinstance(cfg, Config)
    rows = describe_fields()
    assert len(rows) > 30
    missing = [name for name, _, _, help_ in rows if not help_.strip()]
    assert missing == []


@pytest.mark.parametrize("override, field, allowed", [
    ({"engine.nme": "x"}, "engine.nme", "name, batch_size"),
    ({"bogus": 1}, "bogus", "seed"),
    ({"engine.name": "tgi"}, "engine.name", "hf, vllm"),
    ({"task.name": "chess"}, "task.name", "arith, gsm8k, math500, mbpp"),
])
def test_unknown_or_invalid_field_names_field_and_allowed_values(override, field, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=override)
    assert f"'{field}'" in str(e.value) and allowed in str(e.value)


@pytest.mark.parametrize("override, field", [
    ({"episode.n_samples": 0}, "episode.n_samples"),
    ({"task.limit": "many"}, "task.limit"),
    ({"solver_sampling.top_p": 1.5}, "solver_sampling.top_p"),
    ({"episode.strategies": [{"name": "a", "instruction": "x"}, {"name": "a", "instruction": "y"}]},
     "episode.strategies[1].name"),
    ({"logging.wandb": "maybe"}, "logging.wandb"),
])
def test_bad_values_are_rejected_with_the_field_name(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=override)
    assert field in str(e.value)


def test_partial_section_merges_onto_that_sections_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("writer_sampling:\n  temperature: 0\nepisode:\n  rounds: 2\n")
    cfg = load_config(p)
    assert cfg.writer_sampling.temperature == 0.0
    assert cfg.writer_sampling.max_new_tokens == Config().writer_sampling.max_new_tokens == 64
    assert cfg.episode.rounds == 2 and cfg.episode.n_samples == Config().episode.n_samples


def test_a_section_given_as_a_mapping_merges_onto_what_was_set_before(tmp_path):
    """--set 'lower={kl_coef: 0.1}' sets kl_coef and keeps the file's and earlier overrides' lower.*
    (it used to put every other lower field back to its default)."""
    p = tmp_path / "c.yaml"
    p.write_text("lower:\n  iterations: 50\n  lr: 0.00002\n")
    cfg = load_config(p, {"lower.lr": 3e-5, "lower": {"kl_coef": 0.1, "score": {"alpha": 5.0}}})
    assert (cfg.lower.iterations, cfg.lower.lr, cfg.lower.kl_coef, cfg.lower.score.alpha) == (50, 3e-5, 0.1, 5.0)
    with pytest.raises(ConfigError, match="lower.no_such"):
        load_config(p, {"lower": {"no_such": 1}})


@pytest.mark.parametrize("override, field", [
    ({"episode.prefix_only": [["confirm"]]}, "episode.prefix_only[0]"),
    ({"episode.prefix_only": [{"a": 1}]}, "episode.prefix_only[0]"),
    ({"upper.snapshots": ["snap-a", "snap-a"]}, "upper.snapshots"),
])
def test_unhashable_names_and_repeated_ids_name_their_field(override, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(overrides=override)


HINTED = {"name": "point_at_step", "instruction": "Point at the flagged step.", "prefix": "{tool_hint}"}


@pytest.mark.parametrize("override, message", [
    ({"episode.writer_sees": "none", "episode.prefix_only": ["point_at_step"]}, "needs episode.writer_sees=tool"),
    ({"episode.writer_sees": "tool", "episode.prefix_only": []}, "only for a strategy in episode.prefix_only"),
    ({"episode.writer_sees": "tool", "episode.prefix_only": ["point_at_step"], "episode.feedback": "static"},
     "only for a strategy in episode.prefix_only with feedback=generate"),
])
def test_a_tool_hint_prefix_needs_the_check_and_a_fixed_sentence(override, message):
    """{tool_hint} is filled in from the check writer_sees=tool runs, where a prefix_only strategy's sentence is
    sent: anywhere else it would reach the solver as the literal placeholder."""
    with pytest.raises(ConfigError, match=r"episode\.strategies\[0\]\.prefix.*" + re.escape(message)):
        load_config(overrides={"episode.strategies": [HINTED], **override})
    ok = load_config(overrides={"episode.strategies": [HINTED], "episode.writer_sees": "tool",
                                "episode.prefix_only": ["point_at_step"]})
    assert ok.episode.strategies[0]["prefix"] == "{tool_hint}"


def test_include_and_overrides_layer_in_order(tmp_path):
    (tmp_path / "base.yaml").write_text("seed: 3\ntask:\n  limit: 5\n")
    (tmp_path / "top.yaml").write_text("include: base.yaml\ntask:\n  limit: 7\n")
    cfg = load_config(tmp_path / "top.yaml", {"seed": 9})
    assert (cfg.seed, cfg.task.limit) == (9, 7)


def test_shipped_presets_load():
    from pathlib import Path

    import os

    root = Path(__file__).resolve().parents[3]
    presets = sorted(root.glob("configs/*.yaml")) + sorted(root.glob("configs/cluster/*.yaml"))
    assert len(presets) > 9
    cwd = os.getcwd()
    os.chdir(root)  # presets name other files (DeepSpeed JSONs) relative to the repository root
    try:
        for p in presets:
            load_config(p)
    finally:
        os.chdir(cwd)


def test_docs_document_every_knob_and_the_readme_every_command():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    reference = (repo / "docs" / "reference" / "config.md").read_text()
    missing = [name for name, *_ in describe_fields() if f"`{name}`" not in reference]
    assert missing == [], f"docs/reference/config.md lacks: {missing}"
    readme = (repo / "README.md").read_text()
    for cmd in ("collect", "train-upper", "train-lower", "train-joint", "eval", "analyze", "snapshots"):
        assert f"mlmt {cmd}" in readme, cmd


def test_allowed_values_are_the_registries():
    """config/ cannot import algos/ (torch; config imports only the ground floor), so it lists the
    registries' names itself: a name added to one side only fails here."""
    from tosca_mlmt.algos.advantages import ADVANTAGES
    from tosca_mlmt.algos.bonus import GATES
    from tosca_mlmt.algos.losses import POLICY_LOSSES
    from tosca_mlmt.config import ADVANTAGE_ESTIMATORS, BONUS_GATES, BUILTIN_TASKS, POLICY_LOSSES as LOSS_NAMES
    from tosca_mlmt.config import task_names as config_task_names
    from tosca_mlmt.strategies import MODES
    from tosca_mlmt.tasks import TASKS, task_names

    assert set(ADVANTAGES) == set(ADVANTAGE_ESTIMATORS)
    assert set(GATES) == set(BONUS_GATES)
    assert set(POLICY_LOSSES) == set(LOSS_NAMES)
    # task.name: the built-ins, plus installed entry points (tests/unit/tasks/test_byo_task.py installs one)
    assert tuple(TASKS) == BUILTIN_TASKS and task_names() == config_task_names()
    choices = {name: f.metadata["choices"] for name, f in _knob_fields().items()}
    assert choices["lower.advantage"] == ADVANTAGE_ESTIMATORS and choices["lower.bonus.gate"] == BONUS_GATES
    assert choices["lower.policy_loss"] == LOSS_NAMES and choices["episode.strategy_selection"] == MODES


def test_config_loads_without_torch():
    """A bad value or `mlmt config --explain` answers at once, not after torch has loaded."""
    import subprocess
    import sys

    code = ("import sys; from tosca_mlmt.config import load_config; load_config(); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_sections_validate_themselves():
    from dataclasses import replace

    cfg = load_config()
    cfg.validate()
    with pytest.raises(ConfigError, match="'lower.lr'"):
        replace(cfg, lower=replace(cfg.lower, lr=-1.0)).validate()
    with pytest.raises(ConfigError, match="'joint.upper_every'"):
        replace(cfg, joint=replace(cfg.joint, upper_every=0)).validate()
    with pytest.raises(ConfigError, match="'grad_accum'"):
        replace(cfg.lower, minibatch_size=6, grad_accum=4).validate()
    # a discount the estimator would never read is an error, not a silent no-op
    with pytest.raises(ConfigError, match="'lower.turn_gamma'"):
        load_config(overrides={"lower.advantage": "gae", "lower.turn_gamma": 0.0})
    load_config(overrides={"lower.advantage": "rloo", "lower.turn_gamma": 0.0})


def _knob_fields():
    import dataclasses

    out = {}

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")
            else:
                out[prefix + f.name] = f

    walk(Config(), "")
    return out
