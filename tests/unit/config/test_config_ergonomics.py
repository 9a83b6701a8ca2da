"""Config ergonomics (issue 67, points 1 and 7): a combination the code knows to collapse is warned
about when the config loads (``mlmt config`` included), ``mlmt config --explain PATTERN`` filters
and shows the resolved values, and ``task.name`` / ``task.reward`` paths are resolved at load."""

from __future__ import annotations

import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from conftest import run_mlmt
from tosca_mlmt.cli.main import app
from tosca_mlmt.config import load_config
from tosca_mlmt.errors import ConfigError

TESTS = Path(__file__).resolve().parents[2]  # byo_plugin.py
COLLAPSE = "kl_mode=reward"  # what the warning names


def _load_warnings(path=None, overrides=None) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(path, overrides)
    return [w for w in caught if COLLAPSE in str(w.message)]


# ---------------------------------------------------------------- the known collapse, at load

def test_the_collapse_combination_warns_at_load_and_a_sane_one_does_not():
    # the case: the base config (grpo, grpo_norm_std, kl_mode reward) with a KL coefficient
    said = _load_warnings(overrides={"lower.kl_coef": 0.05})
    assert len(said) == 1 and type(said[0].message).__name__ == "ConfigWarning"
    text = str(said[0].message)
    assert "lower.kl_coef=0.05" in text and "lower.kl_mode=loss" in text and "lower.grpo_norm_std=false" in text
    assert _load_warnings(overrides={"lower.score.enabled": True})  # SCoRe's KL terms are in the reward too
    for sane in ({}, {"lower.kl_coef": 0.05, "lower.kl_mode": "loss"},
                 {"lower.kl_coef": 0.05, "lower.grpo_norm_std": False},
                 {"lower.kl_coef": 0.05, "lower.advantage": "rloo"}):
        assert not _load_warnings(overrides=sane), sane
    assert not _load_warnings("mlmt")  # the method's preset moved to kl_mode loss


def test_the_warning_is_said_once_per_loaded_section_and_again_for_one_built_in_code(monkeypatch):
    """LowerLearner calls the same rule: quiet about a section the loader warned about, a warning for a
    section built or replace-d in code (tests/unit/lower/test_lower_learner.py checks the learner itself)."""
    from tosca_mlmt.config.lower import warn_kl_reward_collapse

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(overrides={"lower.kl_coef": 0.05})
        warn_kl_reward_collapse(cfg.lower)  # what the learner does with the loaded config
        assert sum(COLLAPSE in str(w.message) for w in caught) == 1
        warn_kl_reward_collapse(replace(cfg.lower, kl_coef=0.1))
        assert sum(COLLAPSE in str(w.message) for w in caught) == 2
    # the process runtime.use_allocator re-executes loads the config again: its parent said it already
    monkeypatch.setenv("MLMT_ALLOCATOR_EXEC", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(overrides={"lower.kl_coef": 0.05})
        warn_kl_reward_collapse(cfg.lower)
    assert not [w for w in caught if COLLAPSE in str(w.message)]


def test_mlmt_config_warns_on_stderr_and_keeps_stdout_yaml():
    p = run_mlmt("config", "--set", "lower.kl_coef=0.05", check=True)
    assert COLLAPSE in p.stderr and "6 % Acc@t1" in p.stderr
    # one `warning:` line, as errors are one `error:` line: no file:line and source echo
    assert [x for x in p.stderr.splitlines() if COLLAPSE in x][0].startswith("warning: ") and "warnings.warn" not in p.stderr
    assert COLLAPSE not in p.stdout and yaml.safe_load(p.stdout)["lower"]["kl_coef"] == 0.05
    # loading is where it is said: before torch (and so any model) is imported
    probe = ("import sys, warnings\nfrom tosca_mlmt.config import load_config\nwarnings.simplefilter('error')\n"
             "try:\n    load_config(overrides={'lower.kl_coef': 0.05})\nexcept UserWarning as w:\n"
             "    print('torch' in sys.modules, type(w).__name__)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "ConfigWarning"]


# ---------------------------------------------------------------- mlmt config --explain PATTERN

def _config(*args):
    res = CliRunner().invoke(app, ["config", *args])
    return res.exit_code, res.stdout


def test_explain_pattern_filters_and_shows_resolved_values():
    code, out = _config("-c", "mlmt", "--explain", "lower.kl*")
    assert code == 0, out
    lines = out.splitlines()
    assert [ln.split(" ", 1)[0] for ln in lines] == ["lower.kl_coef", "lower.kl_estimator", "lower.kl_mode"]
    # the preset's value, the base default beside it where they differ
    assert lines[0].startswith("lower.kl_coef (float, default 0.01, base default 0.0): ")
    assert lines[2].startswith("lower.kl_mode (str, default 'loss', base default 'reward'): ")
    assert lines[1].startswith("lower.kl_estimator (str, default 'k3'): ")
    # a substring, --set values, and the base defaults when nothing is resolved
    code, out = _config("--explain", "kl_mode", "--set", "lower.kl_mode=loss")
    assert code == 0 and out.splitlines() == [out.splitlines()[0]]
    assert out.startswith("lower.kl_mode (str, default 'loss', base default 'reward'): ")
    code, out = _config("--explain", "writer_sampling.max_new")
    assert code == 0 and out.startswith("writer_sampling.max_new_tokens (int, default 64): ")
    code, _ = _config("--explain", "no_such_knob_xyz")
    assert code == 2


# ---------------------------------------------------------------- task.name / task.reward at load

@pytest.fixture
def user_file(tmp_path):
    """A user's reward and task file that logs each time it is executed."""
    log = tmp_path / "runs.log"
    f = tmp_path / "my_reward.py"
    f.write_text(f"from pathlib import Path\nPath({str(log)!r}).open('a').write('x')\n\n"
                 "def score(problem, response):\n    return 1.0\n\n"
                 "NOT_A_FUNCTION = 3\n")
    return f, log


@pytest.mark.parametrize("field, value, why", [
    ("task.reward", "{dir}/no_such_reward.py:score", "file not found: {dir}/no_such_reward.py"),
    ("task.reward", "{file}:nope", "has no attribute 'nope'"),
    ("task.reward", "{file}:NOT_A_FUNCTION", "names a int, not a function"),
    ("task.reward", "no_such_module_xyz:score", "cannot import no_such_module_xyz"),
    ("task.name", "{file}:NoSuchTask", "has no attribute 'NoSuchTask'"),
    ("task.name", "byo_plugin:Missing", "has no attribute 'Missing'"),
    ("task.name", "no_such_module_xyz:Task", "cannot import no_such_module_xyz"),
])
def test_a_missing_reward_or_task_is_a_config_error_at_load(user_file, field, value, why):
    f, _ = user_file
    fill = {"dir": str(f.parent), "file": str(f)}
    with pytest.raises(ConfigError) as e:
        load_config(overrides={field: value.format(**fill)})
    assert f"field '{field}'" in str(e.value) and why.format(**fill) in str(e.value)


def test_reward_and_task_paths_are_imported_at_load_once(user_file):
    from tosca_mlmt.tasks import make_task

    f, log = user_file
    cfg = load_config(overrides={"task.name": f"{TESTS / 'byo_plugin.py'}:CountTask", "task.reward": f"{f}:score"})
    assert log.read_text() == "x"  # resolved by the config, before any stage runs
    task = make_task(cfg.task)  # the registry gets the same module: the file runs once
    assert log.read_text() == "x" and task.verifier_version.startswith("count-v1+reward:")
    for preset in ("mlmt", "demo"):  # built-in task names need no import
        assert load_config(preset).task.name in ("arith", "gsm8k", "math500", "mbpp", "jsonl")


# ---------------------------------------------------------------- which config ran, how far from the method

def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def test_the_origin_line_counts_the_method_fields_that_differ_from_the_mlmt_preset():
    from tosca_mlmt.config.origin import METHOD_SECTIONS, origin_line

    # reference computed another way: the two configs' YAML trees, leaf by leaf
    base, method = _leaves(load_config(None).to_dict()), _leaves(load_config("mlmt").to_dict())
    differ = sorted(k for k in base if base[k] != method[k] and k.startswith(METHOD_SECTIONS))
    assert "lower.kl_mode" in differ and "task.limit" not in differ  # task is the user's, not the method's
    line = origin_line(load_config(None), None, 0)
    assert line.startswith("config: base defaults;") and f"; {len(differ)} method fields differ" in line
    assert "-c mlmt" in line and "include: mlmt" in line
    assert origin_line(load_config("mlmt"), "mlmt", 0).endswith("(the method)")
    moved = origin_line(load_config("mlmt", {"lower.kl_coef": 0.05}), "mlmt", 1)
    assert moved.startswith("config: preset mlmt + 1 --set; 1 method field differs") and "lower.kl_coef" in moved


def test_config_diff_lists_each_differing_field_with_both_values():
    code, out = _config("--diff", "mlmt", "--set", "lower.lr=0.003")
    assert code == 0, out
    lines = out.splitlines()
    base, method = _leaves(load_config(None, {"lower.lr": 0.003}).to_dict()), _leaves(load_config("mlmt").to_dict())
    assert lines[0] == f"# {sum(base[k] != method[k] for k in base)} fields differ from preset mlmt"
    assert "lower.lr: 0.003 (preset mlmt: 0.0002)" in lines and "lower.kl_mode: 'reward' (preset mlmt: 'loss')" in lines
    assert _config("-c", "mlmt", "--diff", "mlmt") == (0, "# no field differs from preset mlmt\n")


def test_a_model_command_names_its_config_on_stderr_before_any_work(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("")  # the command stops at its output check, before a model or data loads
    res = CliRunner().invoke(app, ["collect", "--out", str(taken), "--no-wandb"])
    assert res.exit_code == 2
    first = res.stderr.splitlines()[0]
    assert first.startswith("config: base defaults") and "not the method the README describes" in first
    assert "config:" not in res.stdout
