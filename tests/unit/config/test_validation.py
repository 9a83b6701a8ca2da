"""Every knob's range, YAML safety, data-file errors and the non-finite-training stop.

All of it fails before a model loads, except one CLI run that must train an iteration."""

import dataclasses
import json
import math
import subprocess
import sys
import time
import typing

import pytest
import torch
from torch import nn

from conftest import DEBUG_MODEL, TINY, run_mlmt, set_args
from tosca_mlmt.config import Config, SamplingConfig, describe_fields, load_config, markdown_reference, parse_override
from tosca_mlmt.config.knobs import INT_MAX
from tosca_mlmt.errors import ConfigError, DataError, TrainingDiverged

# ---------------------------------------------------------------- knob ranges


@pytest.mark.parametrize("field, value, reason", [
    # the reproductions: each trained nothing, trained NaN, or crashed after the model loaded
    ("lower.lr", "nan", "finite"),
    ("lower.lr", -1, "> 0"),
    ("lower.lr", 0, "> 0"),
    ("lower.minibatch_size", -4, ">= 1"),
    ("lower.minibatch_size", 0, ">= 1"),
    ("joint.rounds", 0, ">= 1"),
    ("episode.max_feedback_tokens", 0, ">= 1"),
    ("lower.save_every", 0, ">= 1"),
    ("joint.upper_every", 0, ">= 1"),
    ("lower.problems_per_iteration", 0, ">= 1"),
    ("model.lora.r", 0, ">= 1"),
    # the rest of the rules, one out-of-range value each
    ("seed", -1, ">= 0"),
    ("seed", INT_MAX + 1, "32 bits"),
    ("model.lora.alpha", 0, ">= 1"),
    ("model.lora.dropout", 1.0, "[0, 1)"),
    ("model.lora.target_modules", "", "non-empty"),
    ("model.lora.target_modules", ["q_proj", ""], "non-empty strings"),
    ("model.solver", " ", "non-empty"),
    ("model.solver_adapter", "/no/such/adapter", "existing folder"),
    ("model.writer_adapter", "/no/such/writer", "existing folder"),
    ("engine.batch_size", 0, ">= 1"),
    ("engine.threads", -1, ">= 0"),
    ("engine.vllm.gpu_memory_utilization", 0, "(0, 1]"),
    ("engine.vllm.gpu_memory_utilization", 1.5, "(0, 1]"),
    ("engine.vllm.max_model_len", 1, ">= 2"),
    ("engine.vllm.kv_cache_gb", 0, ">= 1"),
    ("engine.vllm.writer_share", 1.0, "(0, 1)"),
    ("episode.writer_reads_thinking", False, "needs episode.reasoning_tags"),
    ("engine.vllm.weight_sync", "disk", "allowed: memory, file"),
    ("solver_sampling.temperature", -0.5, "0 (greedy) or >= 0.001"),
    ("writer_sampling.temperature", 1e-9, "0 (greedy) or >= 0.001"),
    ("solver_sampling.top_p", 0, "(0, 1]"),
    ("writer_sampling.top_k", -1, ">= 0"),
    ("writer_sampling.max_new_tokens", 0, ">= 1"),
    ("task.data_path", "/no/such/data", "existing folder"),
    ("task.limit", -1, ">= 0"),
    ("task.level", 7, "[1, 6]"),
    ("episode.n_samples", 0, ">= 1"),
    ("episode.rounds", -1, ">= 0"),
    ("episode.strategy_temperature", 0, "> 0"),
    ("episode.epsilon", 1.01, "[0, 1]"),
    ("episode.max_prompt_tokens", 0, ">= 1"),
    ("logging.project", "", "non-empty"),
    ("collect.out", "", "non-empty"),
    ("collect.parents", ["snap-a", ""], "non-empty strings"),
    ("distributed.deepspeed", "/no/such/zero.json", "existing file"),
    ("distributed.timeout_minutes", 0, ">= 1"),
    ("lower.iterations", 0, ">= 1"),
    ("lower.archer_tau", 0, "(0, 1]"),
    ("lower.critic_lr", 0, "> 0"),
    ("lower.gamma", 1.5, "[0, 1]"),
    ("lower.lam", -0.1, "[0, 1]"),
    ("lower.clip_low", 1.0, "(0, 1)"),
    ("lower.clip_low", 0, "(0, 1)"),
    ("lower.clip_high", 0, "> 0"),
    ("lower.value_clip", 0, "> 0"),
    ("lower.vf_coef", -1, ">= 0"),
    ("lower.value_lr", -1e-3, "> 0"),
    ("lower.weight_decay", -0.1, ">= 0"),
    ("lower.warmup_steps", -1, ">= 0"),
    ("lower.epochs", 0, ">= 1"),
    ("lower.grad_accum", 0, ">= 1"),
    ("lower.max_grad_norm", 0, "> 0"),
    ("lower.kl_coef", -0.01, ">= 0"),
    ("lower.score.stage1_steps", -1, ">= 0"),
    ("lower.score.alpha", -1, ">= 0"),
    ("lower.score.beta1", -1, ">= 0"),
    ("lower.score.beta2", -1, ">= 0"),
    ("lower.bonus.coef", -0.1, ">= 0"),
    ("lower.bonus.clip", 0, "> 0"),
    ("lower.logprob_chunk", 0, ">= 1"),
    ("lower.score_batch", -1, ">= 0"),
    ("lower.keep_checkpoints", 0, ">= 1"),
    ("joint.collect_problems", 0, ">= 1"),
    ("joint.lower_iterations", 0, ">= 1"),
    ("joint.upper_steps", 0, ">= 1"),
    ("joint.replay_window", -1, ">= 0"),
    ("joint.max_seconds", -1, ">= 0"),
    ("upper.snapshots", ["ok", 3], "non-empty strings"),
    ("upper.steps", 0, ">= 1"),
    ("upper.batch_size", 0, ">= 1"),
    ("upper.micro_batch_size", -1, ">= 0"),
    ("upper.lr", 0, "> 0"),
    ("upper.head_lr", -1, "> 0"),
    ("upper.weight_decay", -1, ">= 0"),
    ("upper.max_grad_norm", 0, "> 0"),
    ("upper.break_penalty", -1, ">= 0"),
    ("upper.gamma", 2, "[0, 1]"),
    ("upper.cql_alpha", -1, ">= 0"),
    ("upper.iql_tau", 1, "(0, 1)"),
    ("upper.target_tau", 0, "(0, 1]"),
    ("upper.target_sync_every", 0, ">= 1"),
    ("upper.awr_beta", 0, "> 0"),
    ("upper.awr_max_weight", 0.5, ">= 1"),
    ("upper.bc_top_frac", 0, "(0, 1]"),
    ("upper.text_coef", -1, ">= 0"),
    ("upper.warmup_steps", -1, ">= 0"),
    ("upper.save_every", 0, ">= 1"),
    ("upper.keep_checkpoints", 0, ">= 1"),
    ("upper.log_every", 0, ">= 1"),
    ("upper.eval_every", 0, ">= 1"),
    ("upper.eval_batch_size", 0, ">= 1"),
])
def test_out_of_range_value_is_refused_naming_field_and_range(field, value, reason):
    with pytest.raises(ConfigError) as e:
        load_config(overrides={field: value})
    assert f"'{field}'" in str(e.value) and reason in str(e.value)


def _numeric_fields():
    hints_of = {}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, prefix + f.name + ".")
            else:
                hints_of[prefix + f.name] = (tp, f.metadata)

    walk(Config, "")
    return {name: v for name, v in hints_of.items() if v[0] in (int, float)}


def test_every_numeric_knob_states_a_range_and_explain_shows_it():
    rows = {name: help_ for name, _, _, help_ in describe_fields()}
    for name, (_, md) in _numeric_fields().items():
        assert md["min"] is not None or md["max"] is not None or md["rule"] is not None, name
        assert " Valid: " in rows[name], name


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", float("nan"), float("inf"), 10**400])
def test_every_float_knob_refuses_non_finite_values(bad):
    for name, (tp, _) in _numeric_fields().items():
        if tp is float:
            with pytest.raises(ConfigError, match="finite"):
                load_config(overrides={name: bad})


def test_range_edges_are_inclusive_or_exclusive_as_stated():
    ok = {"model.lora.dropout": 0.0, "lower.clip_low": 0.999, "episode.epsilon": 1, "solver_sampling.temperature": 0,
          "writer_sampling.temperature": 0.001, "solver_sampling.top_p": 1, "task.level": 5, "episode.rounds": 0,
          "lower.bonus.coef": 0, "joint.max_seconds": 0.0, "upper.micro_batch_size": 16, "seed": INT_MAX,
          "upper.target_tau": 1, "engine.threads": 0}
    cfg = load_config(overrides=ok)
    assert cfg.solver_sampling.temperature == 0.0 and cfg.upper.micro_batch_size == 16


@pytest.mark.parametrize("field, value, kind", [
    ("lower.iterations", True, "integer"),
    ("lower.iterations", 1.5, "integer"),
    ("lower.iterations", "1e3", "integer"),
    ("lower.lr", True, "number"),
    ("lower.lr", [1], "number"),
    ("model.solver", True, "string"),
    ("model.solver", ["a"], "string"),
    ("logging.wandb", 1, "true or false"),
    ("collect.parents", "snap-a", "list"),
    ("lower", 3, "mapping"),
])
def test_wrong_types_are_refused(field, value, kind):
    with pytest.raises(ConfigError, match=kind):
        load_config(overrides={field: value})


def test_yaml_strings_for_numbers_are_read_as_numbers():
    # YAML 1.1 reads 1e-4 (no dot) as a string; --set must still mean the number
    cfg = load_config(overrides=dict(parse_override(s) for s in ("lower.lr=1e-4", "task.limit=7")))
    assert cfg.lower.lr == 1e-4 and cfg.task.limit == 7


@pytest.mark.parametrize("value", ["x\x00y", "bad \udcff byte"])
def test_strings_with_nul_or_lone_surrogates_are_refused(value):
    with pytest.raises(ConfigError, match="NUL|surrogate"):
        load_config(overrides={"logging.project": value})
    with pytest.raises(ConfigError, match="NUL|surrogate"):
        load_config(overrides={"episode.strategies": [{"name": "a", "instruction": value}]})


@pytest.mark.parametrize("field", ["model.solver_adapter", "model.writer_adapter", "task.data_path",
                                   "distributed.deepspeed"])
def test_path_knobs_refuse_names_the_os_refuses(field):
    # Path.is_dir() raises OSError (not False) for a name longer than the OS allows
    with pytest.raises(ConfigError, match="must be empty or an existing"):
        load_config(overrides={field: "a" * 5000})


def test_target_modules_takes_a_string_or_a_list():
    assert load_config(overrides={"model.lora.target_modules": ["q_proj", "v_proj"]}).model.lora.target_modules == [
        "q_proj", "v_proj"]
    assert load_config(overrides=dict([parse_override("model.lora.target_modules=q_proj|v_proj")])
                       ).model.lora.target_modules == "q_proj|v_proj"


@pytest.mark.parametrize("override, field", [
    ({"lower.minibatch_size": 6, "lower.grad_accum": 4}, "lower.grad_accum"),
    ({"upper.batch_size": 8, "upper.micro_batch_size": 9}, "upper.micro_batch_size"),
    ({"engine.name": "vllm", "engine.vllm.max_model_len": 512, "episode.max_prompt_tokens": 512},
     "episode.max_prompt_tokens"),
    ({"episode.strategies": []}, "episode.strategies"),
    ({"episode.strategies": [{"name": "a", "instruction": 3}]}, "episode.strategies[0].instruction"),
    ({"episode.strategies": [{"name": "a"}]}, "episode.strategies[0]"),
])
def test_cross_field_rules(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=override)
    assert f"'{field}'" in str(e.value)


def test_explain_defaults_are_the_resolved_ones_and_the_config_reference_is_generated():
    from pathlib import Path

    rows = {name: default for name, _, default, _ in describe_fields()}
    resolved = load_config()
    assert rows["writer_sampling.max_new_tokens"] == resolved.writer_sampling.max_new_tokens == 64
    assert rows["solver_sampling.max_new_tokens"] == resolved.solver_sampling.max_new_tokens == 128
    page = (Path(__file__).resolve().parents[3] / "docs" / "reference" / "config.md").read_text()
    assert markdown_reference() in page, "docs/reference/config.md is stale; run python docs/gen/build.py"
    assert "| `writer_sampling.max_new_tokens` | int | `64` |" in page


def test_feedback_token_limit_means_what_it_says():
    from tosca_mlmt.rollout.turns import to_params

    # an `or` here once turned an explicit limit of 0 into the writer's 64
    assert to_params(SamplingConfig(max_new_tokens=64), seed=0, max_new_tokens=0).max_new_tokens == 0
    assert to_params(SamplingConfig(max_new_tokens=64), seed=0).max_new_tokens == 64


# ---------------------------------------------------------------- YAML files and --set


def _write(tmp_path, name, data: bytes | str):
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


BOMB = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
        'b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n'
        'd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n'
        'f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n'
        'h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\ni: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n')


@pytest.mark.parametrize("name, data, needle", [
    ("bomb.yaml", BOMB, "bomb.yaml:2: not valid YAML: aliases"),
    ("dup.yaml", "seed: 1\ntask:\n  limit: 2\nseed: 3\n", "dup.yaml:4: not valid YAML: duplicate key 'seed' (first at line 1)"),
    ("dup2.yaml", "lower:\n  lr: 1.0e-4\n  lr: 1.0e-3\n", "dup2.yaml:3: not valid YAML: duplicate key 'lr'"),
    ("inclist.yaml", "include: [a.yaml, b.yaml]\n", "'include' must name one YAML file"),
    ("incint.yaml", "include: 5\n", "'include' must name one YAML file"),
    ("incmissing.yaml", "include: nope.yaml\n", "config file not found"),
    ("self.yaml", "include: self.yaml\n", "include chain too deep"),
    ("latin1.yaml", b"seed: 1\n# caf\xe9\n", "latin1.yaml:2: not UTF-8 (byte 0xe9)"),
    ("deep.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("date.yaml", "seed: 2020-13-45\n", "not valid YAML: month must be in 1..12"),
    ("bigint.yaml", "seed: " + "9" * 5000 + "\n", "not valid YAML: Exceeds the limit"),
    ("twodocs.yaml", "seed: 1\n---\nseed: 2\n", "not valid YAML"),
    ("ctrl.yaml", "seed: \x01\n", "not valid YAML: unacceptable character"),
    ("list.yaml", "- seed\n", "top level must be a mapping"),
])
def test_bad_yaml_files_are_one_config_error(tmp_path, name, data, needle):
    p = _write(tmp_path, name, data)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert time.perf_counter() - t0 < 5  # the bomb expands to 9**8 nodes when aliases are followed
    assert needle in str(e.value)


def test_a_folder_or_a_device_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config("/dev/zero")


def test_anchors_without_aliases_and_bom_are_fine(tmp_path):
    p = _write(tmp_path, "ok.yaml", "\ufeffseed: &s 4\ntask:\n  limit: 3\n")
    cfg = load_config(p)
    assert (cfg.seed, cfg.task.limit) == (4, 3)


@pytest.mark.parametrize("text, needle", [
    ("x=[1,", "--set x: not valid YAML"),
    ("seed", "--set expects FIELD=VALUE"),
    ("=3", "bad field name"),
    ("lower..lr=1", "bad field name"),
    ("lower.lr=&a 1", None),  # an anchor alone is harmless
    ("lower.lr=*a", "aliases"),
    ("logging.project=\udcff", "surrogate"),
])
def test_set_values_are_parsed_strictly(text, needle):
    if needle is None:
        assert load_config(overrides=dict([parse_override(text)])).lower.lr == 1.0
        return
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=dict([parse_override(text)]))


# ---------------------------------------------------------------- data files


def _gsm8k(tmp_path, lines: list[bytes | str], name="test.jsonl"):
    from tosca_mlmt.tasks.math_tasks import GSM8KTask

    d = tmp_path / "gsm8k"
    d.mkdir(exist_ok=True)
    (d / name).write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return GSM8KTask(str(tmp_path)), d / name


GOOD = json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"})


@pytest.mark.parametrize("bad, field, reason", [
    (b'{"question": "caf\xe9?", "answer": "#### 1"}', None, "not UTF-8 (byte 0xe9 at column 18)"),
    ("[" * 100_000 + "]" * 100_000, "<row>", "nested too deeply"),
    (json.dumps({"question": "x\ud800y", "answer": "#### 1"}), "question", "lone surrogate"),
    (json.dumps({"question": "q", "answer": "#### 1\udfff"}), "answer", "lone surrogate"),
    ('{"question": "q", "answer": "#### 1", "n": ' + "9" * 5000 + "}", "<row>", "invalid JSON"),
    (json.dumps({"question": [[[[1]]]] * 1, "answer": "#### 1"}), "question", "got a list of 1 item(s)"),
])
def test_bad_rows_name_file_line_and_are_skipped_with_skip_bad_rows(tmp_path, bad, field, reason):
    task, path = _gsm8k(tmp_path, [GOOD, bad, GOOD])
    with pytest.raises(DataError) as e:
        task.load("test")
    assert (e.value.line, e.value.field) == (2, field)
    assert str(e.value).startswith(f"{path}:2: ") and reason in str(e.value)
    res = task.load("test", skip_bad_rows=True)
    assert res.skipped_rows == 1 and [p.id for p in res.problems] == ["gsm8k-test-00001", "gsm8k-test-00003"]


def test_mbpp_rows_with_lone_surrogates_or_bad_bytes_are_data_errors(tmp_path):
    from tosca_mlmt.tasks.mbpp import MBPPTask

    good = {"task_id": 11, "text": "Write f.", "code": "def f():\n    return 1", "test_list": ["assert f() == 1"]}
    lines = [json.dumps(good).encode(), json.dumps({**good, "task_id": 12, "test_list": ["assert f() == '\udc80'"]}
                                                   ).encode(), b'{"task_id": 13, "text": "\xff"}']
    (tmp_path / "mbpp").mkdir()
    (tmp_path / "mbpp" / "mbpp.jsonl").write_bytes(b"\n".join(lines))
    task = MBPPTask(str(tmp_path))
    with pytest.raises(DataError) as e:
        task.load("test")
    assert (e.value.line, e.value.field) == (2, "test_list") and "surrogate" in str(e.value)
    res = task.load("test", skip_bad_rows=True)
    assert res.skipped_rows == 2 and [p.id for p in res.problems] == ["mbpp-11"]


@pytest.mark.parametrize("lines, skip, reason", [
    ([], False, "no problems: the file holds no rows"),
    (["", "  "], False, "no problems: the file holds no rows"),
    (['{"question": 1}', "nope"], True, "no problems: all 2 row(s) are malformed (skipped)"),
])
def test_a_data_file_without_problems_is_an_error(tmp_path, lines, skip, reason):
    task, path = _gsm8k(tmp_path, lines)
    with pytest.raises(DataError) as e:
        task.load("test", skip_bad_rows=skip)
    assert str(e.value) == f"{path}: {reason}"


def test_a_split_without_problems_is_an_error(tmp_path):
    from tosca_mlmt.tasks.mbpp import MBPPTask

    (tmp_path / "mbpp").mkdir()
    (tmp_path / "mbpp" / "mbpp.jsonl").write_text(json.dumps(
        {"task_id": 700, "text": "Write f.", "code": "def f(): pass", "test_list": ["assert True"]}))
    assert [p.id for p in MBPPTask(str(tmp_path)).load("train").problems] == ["mbpp-700"]
    with pytest.raises(DataError, match=r"no problems: none of its 1 valid row\(s\) has a test task_id \(11-510\)"):
        MBPPTask(str(tmp_path)).load("test")


# ---------------------------------------------------------------- non-finite training


def _trainer(lr=0.1):
    from tosca_mlmt.config import DistributedConfig
    from tosca_mlmt.train.distributed import Trainer

    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    opt = torch.optim.AdamW(lin.parameters(), lr=lr)
    trainer = Trainer(DistributedConfig(), {"m": lin}, opt, None, slots=2, micro_size=1, max_grad_norm=1.0,
                      what="lower.grad_accum")
    return trainer, lin, opt


def _params(m):
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("poison, quantity", [
    ("loss_nan", "the loss is nan"),
    ("loss_inf", "the loss is inf"),
    ("grad_nan", "the gradient norm is nan"),
])
def test_a_non_finite_step_raises_and_leaves_weights_and_optimizer_untouched(poison, quantity):
    trainer, lin, opt = _trainer()
    x = torch.ones(2, 3)
    trainer.zero_grad()
    trainer.backward(trainer(lambda: lin(x).sum()), 0.5)
    trainer.backward(trainer(lambda: lin(x).sum()), 0.5)
    assert math.isfinite(trainer.step(at="iteration 1"))
    before, opt_state = _params(lin), {k: v["step"].clone() for k, v in opt.state.items()}
    trainer.zero_grad()
    trainer.backward(trainer(lambda: lin(x).sum()), 0.5)
    if poison == "grad_nan":  # a finite loss whose gradient is NaN
        lin.weight.register_hook(lambda g: g * float("nan"))
        loss = lin(x).sum()
    else:
        loss = lin(x).sum() + float("nan" if poison == "loss_nan" else "inf")  # gradient stays finite
    trainer.backward(trainer(lambda: loss), 0.5)
    with pytest.raises(TrainingDiverged) as e:
        trainer.step(at="iteration 2, optimizer step 2")
    assert str(e.value).startswith(f"lower training diverged at iteration 2, optimizer step 2: {quantity}")
    assert "not applied" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
    assert {k: v["step"] for k, v in opt.state.items()} == opt_state


def test_a_padding_slot_with_a_non_finite_loss_does_not_stop_training():
    # zero-weight slots repeat a row that a real slot also trains on; only real slots count
    trainer, lin, _ = _trainer()
    x = torch.ones(2, 3)
    trainer.zero_grad()
    trainer.backward(trainer(lambda: lin(x).sum()), 1.0)
    trainer.backward(trainer(lambda: lin(x).sum() + float("nan")), 0.0)
    assert math.isfinite(trainer.step())


# ---------------------------------------------------------------- the CLI: exit 2, one line, no traceback


def _one_error_line(p):
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1, p.stderr
    return next(ln for ln in lines if ln.startswith("error:"))


@pytest.mark.parametrize("args, needle", [
    (["--set", "lower.lr=nan"], "'lower.lr': must be a finite number"),
    (["--set", "x=[1,"], "--set x: not valid YAML"),
    (["--set", "a[/]=1"], "unknown config field 'a[/]'"),  # rich markup in a message must print as text
    (["--set", "lower.lr=-1"], "'lower.lr': must be > 0"),
    (["--set", "logging.trackers=[wandb, tb]"], "'logging.trackers': must be a list of distinct names from: wandb, "
                                                "tensorboard"),
])
def test_cli_config_errors_are_one_line(args, needle):
    line = _one_error_line(run_mlmt("config", *args, timeout=120))
    assert needle in line


def test_cli_bad_yaml_files_are_one_line(tmp_path):
    cases = {"bomb.yaml": (BOMB, "aliases"), "dup.yaml": ("seed: 1\nseed: 2\n", "dup.yaml:2"),
             "inc.yaml": ("include: [a, b]\n", "'include'"), "bad.yaml": (b"seed: 1 # \xff\n", "not UTF-8")}
    for name, (data, needle) in cases.items():
        assert needle in _one_error_line(run_mlmt("config", "-c", _write(tmp_path, name, data), timeout=120))
    assert "is a folder" in _one_error_line(run_mlmt("config", "-c", tmp_path, timeout=120))


def test_cli_bad_data_fails_before_the_model_loads(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    base = ["collect", "--task", "gsm8k", "--data", tmp_path, "--limit", "0", "--no-wandb"]
    line = _one_error_line(run_mlmt(*base, "--out", tmp_path / "o", timeout=300))
    assert f"train.jsonl:2: not UTF-8" in line and not (tmp_path / "o").exists()
    (tmp_path / "gsm8k" / "train.jsonl").write_bytes(b"\xff\n")
    line = _one_error_line(run_mlmt(*base, "--skip-bad-rows", "--out", tmp_path / "o", timeout=300))
    assert "no problems: all 1 row(s) are malformed" in line and not (tmp_path / "o").exists()


def test_cli_out_of_range_training_knob_writes_no_run_folder(tmp_path):
    run = tmp_path / "run"
    line = _one_error_line(run_mlmt("train-lower", "--out", run, "--no-wandb", "--set", "lower.save_every=0",
                                    timeout=120))
    assert "'lower.save_every'" in line and not run.exists()  # so a corrected rerun is not refused


# A NaN injected into the PPO loss from the second iteration on, in the real CLI process.
_DIVERGE = """
import sys
from tosca_mlmt.lower.learner import LowerLearner
orig, calls = LowerLearner.update, []
def update(self, trajs, step, *a, **kw):
    if step >= 1 and not calls:
        calls.append(step)
        loss_fn = self.loss
        self.loss = lambda *a, **kw: (lambda out: (out[0] * float("nan"), out[1]))(loss_fn(*a, **kw))
    return orig(self, trajs, step, *a, **kw)
LowerLearner.update = update
from tosca_mlmt.cli.main import app
sys.argv = ["mlmt"] + sys.argv[1:]
app()
"""


@pytest.mark.slow
def test_cli_divergence_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    from safetensors.torch import load_file

    run = tmp_path / "run"
    args = ["train-lower", "--out", str(run), "--no-wandb", *map(str, TINY), "--set", "lower.iterations=3",
            "--set", "lower.save_every=1", "--set", "lower.problems_per_iteration=1", "--set", "episode.n_samples=2",
            "--set", "lower.minibatch_size=2", "--set", "lower.keep_snapshots=false", "--set", "episode.rounds=1",
            *set_args(DEBUG_MODEL)]
    p = subprocess.run([sys.executable, "-c", _DIVERGE, *args], capture_output=True, text=True, timeout=900)
    line = _one_error_line(p)
    assert "lower training diverged at iteration 2, optimizer step 2: the loss is nan" in line
    cks = sorted(d.name for d in (run / "checkpoints").glob("step-*"))
    assert cks == ["step-000001"], cks
    tensors = [t for f in (run / "checkpoints" / "step-000001").rglob("*.safetensors") for t in load_file(f).values()]
    assert tensors and all(torch.isfinite(t).all() for t in tensors)


def test_an_unknown_field_suggests_the_nearest_one():
    with pytest.raises(ConfigError, match=r"unknown config field 'lower.kl_coeff' \(did you mean 'lower.kl_coef'\?\)"):
        load_config(overrides={"lower.kl_coeff": 0.05})
    with pytest.raises(ConfigError) as e:  # nothing close: no guess
        load_config(overrides={"lower.zzzz": 1})
    assert "did you mean" not in str(e.value) and "allowed fields here" in str(e.value)
