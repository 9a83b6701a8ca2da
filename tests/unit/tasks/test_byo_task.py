"""Bring your own task and reward: the registry (built-ins, entry points, paths), the generic
``jsonl`` task and the ``task.reward`` hook; the user's side lives in tests/byo_plugin.py."""

import json
import os
import warnings
from pathlib import Path

import pytest

from conftest import DEBUG_MODEL, TINY, run_mlmt, set_args
from tosca_mlmt.config import load_config, task_names
from tosca_mlmt.errors import ConfigError, DataError
from tosca_mlmt.tasks import make_task
from tosca_mlmt.tasks.base import Problem, Verdict
from tosca_mlmt.tasks.reward import RewardFunctionWarning

TESTS = Path(__file__).resolve().parents[2]  # byo_plugin.py
PLUGIN = TESTS / "byo_plugin.py"


def _task(**over):
    return make_task(load_config(overrides=over).task)


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------- registry: paths and entry points

def test_task_by_module_path_and_by_file_path():
    t = _task(**{"task.name": "byo_plugin:CountTask", "task.level": 3})
    assert t.name == "count" and t.load("train", 2).problems[0].answer == "3"  # got the task: section
    t = _task(**{"task.name": f"{PLUGIN}:make_count_task"})  # a factory taking no arguments
    assert [p.id for p in t.load("test", 2).problems] == ["count-test-0", "count-test-1"]


@pytest.mark.parametrize("name, why", [
    ("mydata", "allowed: arith, gsm8k, math500, mbpp, jsonl"),
    ("no_such_module_xyz:Task", "cannot import no_such_module_xyz"),
    ("byo_plugin:Missing", "has no attribute 'Missing'"),
    ("byo_plugin:NotATask", "without verifier_version, load, instruction, verify"),
    ("/no/such/file.py:Task", "file not found"),
    ("a:b:c", "module:attribute"),
])
def test_a_bad_task_name_is_one_error_naming_the_field(name, why):
    with pytest.raises(ConfigError) as e:
        _task(**{"task.name": name})
    assert "'task.name'" in str(e.value) and why in str(e.value)


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A distribution installed the way pip leaves one: a dist-info folder on sys.path whose
    entry_points.txt files two tasks under the tosca_mlmt.tasks group (one of them broken)."""
    dist = tmp_path / "byo_tasks-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: byo-tasks\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tosca_mlmt.tasks]\ncount = byo_plugin:CountTask\n"
                                           "broken = byo_plugin_gone:Task\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_an_installed_entry_point_is_a_task_name(installed_plugin):
    from tosca_mlmt.tasks import task_names as registry_names

    assert task_names() == registry_names() and {"count", "broken"} <= set(task_names())
    t = _task(**{"task.name": "count"})
    assert t.name == "count" and len(t.load("train", 3).problems) == 3
    with pytest.raises(ConfigError, match="'task.name'.*entry point byo_plugin_gone:Task failed to load"):
        _task(**{"task.name": "broken"})
    # the config's own error lists the installed names next to the built-ins
    with pytest.raises(ConfigError, match="allowed: arith, gsm8k, math500, mbpp, jsonl, broken, count"):
        load_config(overrides={"task.name": "chess"})


def test_without_the_plugin_the_entry_point_name_is_refused():
    assert "count" not in task_names()
    with pytest.raises(ConfigError, match="'task.name'"):
        load_config(overrides={"task.name": "count"})


# ---------------------------------------------------------------- the jsonl task

def _rows(n=30):
    return [{"prompt": f"What is {i} + 2?", "solution": f"{i} + 2 = {i + 2}\n#### {i + 2}", "uid": f"q{i}",
             "tags": ["add"]} for i in range(n)]


def test_jsonl_with_a_custom_key_mapping(tmp_path):
    f = _write_jsonl(tmp_path / "my-data.jsonl", _rows())
    over = {"task.name": "jsonl", "task.path": str(f), "task.question_key": "prompt", "task.answer_key": "solution"}
    t = _task(**over)
    train, test = t.load("train").problems, t.load("test").problems
    assert len(train) + len(test) == 30 and train and test
    assert not {p.question for p in train} & {p.question for p in test}
    p = train[0]
    assert p.id.startswith("my-data-") and p.task == "jsonl" and p.answer == str(int(p.question.split()[2]) + 2)
    assert p.meta["fields"] == {"uid": f"q{p.meta['row'] - 1}", "tags": ["add"]} and "####" in p.meta["solution"]
    assert t.verify(p, f"so\nThe answer is: {p.answer}\n").correct
    assert not t.verify(p, "The answer is: 1000\n").correct
    assert "The answer is" in t.instruction(p)
    # an id key and a prefix; test_fraction 0 puts every row in train
    t = _task(**over, **{"task.id_key": "uid", "task.id_prefix": "adds", "task.test_fraction": 0.0})
    assert [p.id for p in t.load("train", 2).problems] == ["adds-q0", "adds-q1"]


def test_jsonl_row_without_the_key_names_file_row_and_key(tmp_path):
    f = _write_jsonl(tmp_path / "d.jsonl", [*_rows(3), {"prompt": "x"}])
    with pytest.raises(DataError) as e:
        _task(**{"task.name": "jsonl", "task.path": str(f)}).load("train")  # the default keys
    msg = str(e.value)
    assert f"{f}:1: field 'question': missing" in msg and "prompt, solution" in msg and "task.question_key" in msg
    t = _task(**{"task.name": "jsonl", "task.path": str(f), "task.question_key": "prompt",
                 "task.answer_key": "solution"})
    with pytest.raises(DataError, match=rf"{f}:4: field 'solution': missing"):
        t.load("train")
    res = t.load("train", skip_bad_rows=True)
    assert res.skipped_rows == 1


@pytest.mark.parametrize("row, field, why", [
    ('{"question": "q", "answer": "no hash here"}', "answer", "no '####'"),
    ('{"question": "", "answer": "#### 1"}', "question", "non-empty string"),
    ('["q", "a"]', "<row>", "JSON object"),
    ('{"question": "q", ', "<row>", "invalid JSON"),
])
def test_jsonl_bad_rows_name_the_row_and_field(tmp_path, row, field, why):
    f = _write_jsonl(tmp_path / "d.jsonl", [{"question": "ok", "answer": "#### 2"}, row])
    with pytest.raises(DataError) as e:
        _task(**{"task.name": "jsonl", "task.path": str(f), "task.answer_format": "hash"}).load("train")
    assert f"{f}:2: field '{field}'" in str(e.value) and why in str(e.value)


def test_jsonl_duplicate_ids_are_refused(tmp_path):
    f = _write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1", "k": 7}, {"question": "b", "answer": "2",
                                                                                       "k": 7}])
    with pytest.raises(DataError, match=r"d.jsonl:2: field 'k': duplicate problem id 'd-7' \(also row 1\)"):
        _task(**{"task.name": "jsonl", "task.path": str(f), "task.id_key": "k"}).load("train")


def test_jsonl_answer_formats_boxed_and_regex(tmp_path):
    f = _write_jsonl(tmp_path / "mc.jsonl", [{"question": f"Pick {c}.", "answer": f"Answer: {c}"} for c in "ABCD"])
    t = _task(**{"task.name": "jsonl", "task.path": str(f), "task.answer_format": "regex",
                 "task.answer_regex": r"Answer:\s*([A-D])", "task.test_fraction": 0.0,
                 "task.prompt": "{question}\nEnd with 'Answer: X'."})
    p = t.load("train").problems[1]
    assert p.answer == "B" and t.instruction(p) == "Pick B.\nEnd with 'Answer: X'."
    assert t.verify(p, "hmm, Answer: A... no. Answer: B").correct and not t.verify(p, "Answer: C").correct
    f = _write_jsonl(tmp_path / "boxed.jsonl", [{"question": "q", "answer": "so \\boxed{\\frac{1}{2}}"}])
    t = _task(**{"task.name": "jsonl", "task.path": str(f), "task.answer_format": "boxed",
                 "task.test_fraction": 0.0})
    p = t.load("train").problems[0]
    assert p.answer == "\\frac{1}{2}" and t.verify(p, "\\boxed{0.5}").correct and "\\boxed{}" in t.instruction(p)


def test_jsonl_reads_parquet_split_files_and_a_saved_datasetdict(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist([{"q": f"{split} {i}", "a": i} for i in range(3)]),
                       tmp_path / f"nums-{split}.parquet")
    t = _task(**{"task.name": "jsonl", "task.path": str(tmp_path / "nums-{split}.parquet"), "task.question_key": "q",
                 "task.answer_key": "a"})
    test = t.load("test").problems
    assert [p.id for p in test] == ["nums-test-00001", "nums-test-00002", "nums-test-00003"]
    assert test[2].answer == "2" and test[2].question == "test 2"

    import datasets

    datasets.DatasetDict({s: datasets.Dataset.from_list([{"question": f"{s} {i}", "answer": str(i)} for i in range(2)])
                          for s in ("train", "test")}).save_to_disk(str(tmp_path / "hf"))
    t = _task(**{"task.name": "jsonl", "task.path": str(tmp_path / "hf")})
    assert [p.id for p in t.load("train").problems] == ["hf-train-00001", "hf-train-00002"]
    datasets.Dataset.from_list([{"question": "only", "answer": "1"}]).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataError, match="no problems"):  # one row, hashed into train
        _task(**{"task.name": "jsonl", "task.path": str(tmp_path / "one"), "task.test_fraction": 0.0}).load("test")


@pytest.mark.parametrize("over, field", [
    ({"task.name": "jsonl"}, "task.path"),
    ({"task.name": "jsonl", "task.path": "/no/such/data.jsonl"}, "task.path"),
    ({"task.answer_format": "regex"}, "task.answer_regex"),
    ({"task.answer_regex": "(unclosed"}, "task.answer_regex"),
    ({"task.answer_format": "####"}, "task.answer_format"),
    ({"task.prompt": "no placeholder"}, "task.prompt"),
    ({"task.id_prefix": "a/b"}, "task.id_prefix"),
    ({"task.test_fraction": 1.5}, "task.test_fraction"),
    ({"task.question_key": ""}, "task.question_key"),
    ({"task.reward": "not a path"}, "task.reward"),
    ({"task.reward": "/no/such/reward.py:fn"}, "task.reward"),
])
def test_new_knobs_are_validated_at_load(over, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config(overrides=over)


# ---------------------------------------------------------------- the reward hook

def _problem(i=0):
    return Problem("count", f"count-train-{i}", "Write the number 5.", "5", "train")


@pytest.mark.parametrize("fn, reward, correct", [("length_reward", 0.5, False), ("flaky_reward", 1.0, True)])
def test_reward_function_replaces_the_score(fn, reward, correct):
    t = _task(**{"task.name": "byo_plugin:CountTask", "task.reward": f"{PLUGIN}:{fn}"})
    v = t.verify(_problem(), "it is 7 or so")  # 13 characters, no 5: the task says wrong
    assert (v.reward, v.correct) == (pytest.approx(reward if fn == "flaky_reward" else 13 / 20), correct)
    assert t.verifier_version.startswith("count-v1+reward:") and t.name == "count"
    assert t.instruction(_problem()).endswith("number only.")  # everything else is the task's own


@pytest.mark.parametrize("fn", ["broken_reward", "none_reward"])
def test_failing_reward_scores_zero_is_counted_and_warned_once(fn):
    t = _task(**{"task.name": "byo_plugin:CountTask", "task.reward": f"byo_plugin:{fn}"})
    with pytest.warns(RewardFunctionWarning, match="count-train-0"):
        v = t.verify(_problem(), "5")
    assert (v.reward, v.correct, v.extracted) == (0.0, False, "5") and v.info["reward_error"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            t.verify(_problem(), "5")
    assert (t.calls, t.errors) == (4, 4)


def test_reward_that_is_not_a_function_is_a_config_error():
    with pytest.raises(ConfigError, match="'task.reward'.*not a function"):
        _task(**{"task.reward": "byo_plugin:CountTask.name"})


def test_reward_may_return_a_verdict():
    from tosca_mlmt.tasks.reward import RewardHook

    t = RewardHook(_task(**{"task.name": "byo_plugin:CountTask"}), lambda p, r: Verdict(True, 0.25, "x"), "f:g")
    assert t.verify(_problem(), "") == Verdict(True, 0.25, "x")


# ---------------------------------------------------------------- end to end through the CLI

@pytest.mark.slow
def test_collect_with_a_path_task_and_a_flaky_reward(tmp_path):
    """The task by module path, the reward by file path, through the CLI: half the reward calls
    raise, the run finishes, and the count is in the summary, the metrics and the turns."""
    from tosca_mlmt.store import load_snapshot

    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    p = run_mlmt("collect", "--task", "byo_plugin:CountTask", "--limit", "2", "--out", tmp_path, "--greedy",
                 "--n-samples", "1", "--no-wandb", "--no-progress", "--set", f"task.reward={PLUGIN}:flaky_reward",
                 # which calls fail depends on the problem, not the text: the debug base serves
                 *set_args(DEBUG_MODEL), *TINY, env=env, check=True)
    snap = load_snapshot(tmp_path, p.stdout.strip().splitlines()[-1])
    m = snap.manifest
    assert m["task"]["name"] == "count" and m["task"]["problem_ids"] == ["count-train-0", "count-train-1"]
    assert "+reward:" in m["task"]["verifier_version"]
    solver_turns = [t for ep in snap.episodes() for t in ep.turns if t.role == "solver"]
    failed = [t for t in solver_turns if "reward_error" in t.info]
    assert failed and all(t.reward == 0.0 for t in failed)
    assert m["summary"]["reward_errors"] == len(failed) and m["summary"]["reward_calls"] >= len(solver_turns)
    assert "reward service unreachable" in p.stderr
    metrics = (tmp_path / "_logs").glob("*/metrics.jsonl")
    assert '"collect/reward_errors": %d' % len(failed) in next(metrics).read_text()


@pytest.mark.slow
def test_train_lower_counts_failed_reward_calls_per_iteration(tmp_path):
    """The same flaky reward inside PPO: the run trains on, and each iteration's metrics count
    exactly the turns whose reward call failed (recomputed here from the batch snapshots)."""
    from tosca_mlmt.store import load_snapshot

    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    run = tmp_path / "run"
    run_mlmt("train-lower", "--out", run, "--no-wandb", "--set", "task.name=byo_plugin:CountTask",
             "--set", f"task.reward={PLUGIN}:flaky_reward", "--set", "lower.iterations=2",
             "--set", "lower.problems_per_iteration=2", "--set", "lower.minibatch_size=4",
             *set_args(DEBUG_MODEL), *TINY, env=env, check=True)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        eps = load_snapshot(run / "snapshots", m["lower/snapshot"]).episodes()
        failed = sum("reward_error" in t.info for e in eps for t in e.turns)
        assert m["lower/reward_errors"] == failed
    assert sum(m["lower/reward_errors"] for m in lines) > 0
