"""The runnable examples under examples/: every folder follows the convention examples/README.md states (a
README whose first ```bash block is the command, a config.yaml that loads), each command runs end to end from
a copy of its folder on tiny limits, and what the runs write is checked against numbers recomputed here from
the example's own reward or task code. The GPU example cannot run here: its config is loaded and its batch
sizes are checked against the world sizes its README promises."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import DEBUG_MODEL, MLMT, TINY, run_mlmt, set_args

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
FOLDERS = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
GPU_MARK = "# requires a GPU"  # the first line of a command block the suite cannot run (examples/README.md)


def command_block(name: str) -> str:
    """The example's command: the first ```bash block of its README ("" without one; the convention test
    names what is missing, instead of an error that stops the whole module)."""
    readme = EXAMPLES / name / "README.md"
    blocks = re.findall(r"^```bash\n(.*?)^```", readme.read_text(), re.S | re.M) if readme.is_file() else []
    return blocks[0] if blocks else ""


RUNNABLE = [name for name in FOLDERS if command_block(name) and not command_block(name).startswith(GPU_MARK)]

# Appended to every collect/train/eval call of a command block: the examples' own sizes take minutes, these
# take seconds. hf, not vLLM: an engine start per command would cost more than the episodes (the engines
# agree token for token: tests/unit/rollout/engines/vllm/).
SMALL = ["--no-wandb", "--no-progress", *TINY,
         *set_args({"engine.name": "hf", "task.limit": 2, "episode.n_samples": 2, "lower.iterations": 1,
                    "lower.problems_per_iteration": 1, "lower.minibatch_size": 2, "lower.grad_accum": 1,
                    "lower.score_batch": 0})]
# Per example, on top: custom_task checks its mechanics on the random debug model (its rewards are 0, and
# GRPO's zero advantages still run every step), and so does multiturn_reward, whose run is only checked to
# finish from a copy of its folder (its reward's values: tests/unit/tasks/). own_data keeps the embedded
# model as its solver: its partial credit needs answers with numbers in them, which the random debug model
# does not write; its writer, whose text no check reads, runs on the debug base.
EXTRA = {name: ["--set", f"model.solver={DEBUG_MODEL['model.solver']}"] for name in ("custom_task", "multiturn_reward")}
EXTRA["own_data"] = ["--set", f"model.writer={DEBUG_MODEL['model.solver']}"]


def _copy(tmp: Path, name: str) -> Path:
    """A bare directory holding only examples/<name>/: what the example needs beyond the installed package
    must be in its own folder."""
    shutil.copytree(EXAMPLES / name, tmp / "examples" / name, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """name -> (completed process, the run's output folder runs/examples/<name>, the copy's root): each
    README's command block once, run as it says (from the root holding examples/), with `mlmt` a shell
    function that runs this interpreter's CLI and appends SMALL and the example's EXTRA (exported, so a run.sh
    the block calls sees it too)."""
    done: dict[str, tuple] = {}
    cli = shlex.join(MLMT)

    def run(name: str):
        if name not in done:
            root = _copy(tmp_path_factory.mktemp(name), name)
            extra = shlex.join([*SMALL, *EXTRA.get(name, [])])
            shim = (f'mlmt() {{ case "$1" in collect|eval|train-*) {cli} "$@" {extra};; *) {cli} "$@";; esac; }}; '
                    'export -f mlmt\n')
            p = subprocess.run(["bash", "-euo", "pipefail", "-c", shim + command_block(name)], cwd=root,
                               capture_output=True, text=True, timeout=1200)
            done[name] = (p, root / "runs" / "examples" / name, root)
        return done[name]
    return run


# ---------------------------------------------------------------- the convention, for every folder

def test_the_index_lists_every_example_and_each_has_a_readme_and_a_config():
    index = (EXAMPLES / "README.md").read_text()
    assert FOLDERS and {"own_data", "custom_task", "gpu"} <= set(FOLDERS)
    for name in FOLDERS:
        assert f"]({name}/)" in index, f"examples/README.md does not link {name}/"
        assert f"examples/{name}/" in command_block(name), f"{name}/README.md: no first ```bash block running it"
        assert (EXAMPLES / name / "config.yaml").is_file()
    assert {"own_data", "custom_task"} <= set(RUNNABLE) and "gpu" not in RUNNABLE


@pytest.mark.parametrize("name", FOLDERS)
def test_every_example_config_validates_from_a_copy_of_its_folder(tmp_path, name):
    root = _copy(tmp_path, name)
    p = run_mlmt("config", "-c", f"examples/{name}/config.yaml", cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    assert yaml.safe_load(p.stdout)["model"]["solver"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNNABLE)
def test_every_cpu_example_runs_end_to_end(ran, name):
    p, _, root = ran(name)
    assert p.returncode == 0, f"examples/{name}: its README's command failed:\n{p.stderr[-4000:]}"
    assert any((root / "runs").rglob("manifest.json")), "no snapshot written under runs/"


# ---------------------------------------------------------------- own_data: keys, reward, outputs

def test_own_data_reward_gives_partial_credit():
    score = _module(EXAMPLES / "own_data" / "rewards.py").score
    gold = SimpleNamespace(answer="40")
    cases = {"8 x 5 = 40\nThe answer is: 40\n": 1.0, "The answer is: 42": 0.5, "The answer is: 13": 0.1,
             "5 days of 8 pages is 13": 0.0, "no idea": 0.0, "The answer is 40. Then 3 more pages": 1.0}
    assert {text: score(gold, text) for text in cases} == cases


def test_own_data_rows_are_hand_checked_word_problems():
    rows = [json.loads(x) for x in (EXAMPLES / "own_data" / "word_problems.jsonl").read_text().splitlines()]
    assert 20 <= len(rows) <= 30 and all(set(r) == {"pid", "q", "ans"} for r in rows)
    assert len({r["pid"] for r in rows}) == len(rows) and all(isinstance(r["ans"], int) for r in rows)


@pytest.mark.slow
def test_own_data_outputs_carry_the_partial_credit_reward(ran):
    from tosca_mlmt.store import load_snapshot

    p, out, root = ran("own_data")
    assert p.returncode == 0, p.stderr[-4000:]
    score = _module(root / "examples" / "own_data" / "rewards.py").score
    rows = {f"word_problems-{r['pid']}": r for r in
            map(json.loads, (root / "examples" / "own_data" / "word_problems.jsonl").read_text().splitlines())}

    def rescored(snap) -> list[float]:
        """Each episode's return from the rows and rewards.py alone: the reward the run used, recomputed."""
        returns = []
        for ep in snap.episodes():
            gold = SimpleNamespace(answer=str(rows[ep.problem.id]["ans"]))
            for t in ep.solver_turns:
                assert t.reward == pytest.approx(score(gold, t.text)), (ep.problem.id, t.text)
            returns.append(sum(t.reward for t in ep.solver_turns))
        return returns

    (collected,) = [load_snapshot(out / "snapshots", d.name) for d in (out / "snapshots").glob("snap-*")]
    version = collected.manifest["task"]["verifier_version"]
    assert version.endswith("+reward:examples/own_data/rewards.py:score@own-data-partial-v1"), version
    assert set(collected.manifest["task"]["problem_ids"]) <= set(rows)
    rescored(collected)

    (metrics,) = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    batch = load_snapshot(out / "run" / "snapshots", metrics["lower/snapshot"])
    returns = rescored(batch)
    assert metrics["lower/reward_mean"] == pytest.approx(sum(returns) / len(returns))
    assert (out / "run" / "checkpoints" / "step-000001").is_dir()
    assert (out / "run" / "solver" / "adapter_config.json").is_file()
    # the run's rewards are the example's scale (which turns earn partial credit depends on the model's
    # text, which differs between CPUs with and without native bf16: the values, not their mix, are checked)
    turns = [t.reward for snap in (collected, batch) for ep in snap.episodes() for t in ep.solver_turns]
    assert turns and set(turns) <= {0.0, 0.1, 0.5, 1.0}, turns

    # eval: the held-out rows, scored by the same reward
    ev = json.loads((out / "eval" / "eval.json").read_text())
    (evsnap,) = [load_snapshot(out / "eval" / "snapshots", d.name) for d in (out / "eval" / "snapshots").glob("snap-*")]
    held_out = evsnap.manifest["task"]["problem_ids"]
    assert len(held_out) == 2 and not set(held_out) & set(collected.manifest["task"]["problem_ids"])
    rescored(evsnap)
    first = [ep.solver_turns[0].reward for ep in evsnap.episodes()]
    assert ev["reward_mean_t1"] == pytest.approx(sum(first) / len(first))


# ---------------------------------------------------------------- custom_task: a task class by path

def _sort_task(root: Path = REPO, level: int = 2):
    return _module(root / "examples" / "custom_task" / "sort_task.py").SortTask(SimpleNamespace(level=level))


def test_sort_task_splits_are_disjoint_sets_and_verify_gives_partial_credit():
    task = _sort_task()
    train, test = task.load("train").problems, task.load("test").problems
    assert (len(train), len(test)) == (1000, 100) and len({p.id for p in train}) == 1000
    assert not {p.answer for p in train} & {p.answer for p in test}  # no test list is a reordered train list
    p = train[0]
    assert p.answer == ", ".join(map(str, sorted(p.meta["numbers"]))) and len(p.meta["numbers"]) == 4
    a, b, c, d = sorted(p.meta["numbers"])
    texts = {f"Sorted.\nThe answer is: {p.answer}\n": (True, 1.0),
             f"The answer is: [{a}, {b}, {d}, {c}]": (False, 0.5 * 2 / 3),  # 2 of 3 neighbouring pairs in order
             f"The answer is: {d}, {c}, {b}, {a}": (False, 0.0),
             f"The answer is: {a}, {b}, {c}": (False, 0.0), "I sorted it.": (False, 0.0)}
    verdicts = [task.verify(p, text) for text in texts]
    assert [(v.correct, pytest.approx(v.reward)) for v in verdicts] == list(texts.values())
    assert verdicts[0].feedback_context == "" and all(v.feedback_context.startswith("Checker:") for v in verdicts[1:])
    assert re.search(task.stop_regex, f"Sorted.\nThe answer is: {p.answer}\n")


@pytest.mark.slow
def test_custom_task_run_is_scored_by_the_example_class(ran):
    from tosca_mlmt.store import load_snapshot

    p, out, root = ran("custom_task")
    assert p.returncode == 0, p.stderr[-4000:]
    task = _sort_task(root)
    problems = {q.id: q for split in ("train", "test") for q in task.load(split, 2).problems}
    (snap,) = [load_snapshot(out / "snapshots", d.name) for d in (out / "snapshots").glob("snap-*")]
    m = snap.manifest
    assert (m["task"]["name"], m["task"]["verifier_version"]) == ("sort", "sort-v1")
    assert m["task"]["problem_ids"] == ["sort-4-train-0000", "sort-4-train-0001"]
    strategies = {t.strategy_name for ep in snap.episodes() for t in ep.turns if t.role == "writer"}
    assert strategies <= {"compare_neighbours", "count_numbers", "start_over", "confirm"} and strategies
    for ep in snap.episodes():
        for t in ep.solver_turns:
            v = task.verify(problems[ep.problem.id], t.text)
            assert (t.reward, t.correct, t.info.get("feedback_context", "")) == (v.reward, v.correct, v.feedback_context)
    assert (out / "run" / "checkpoints" / "step-000001").is_dir()
    ev = json.loads((out / "eval" / "eval.json").read_text())
    assert ev["episodes"] == 2


# ---------------------------------------------------------------- gpu: validated, not run

def test_gpu_example_is_vllm_zero2_bf16_with_batches_that_fit_one_node(tmp_path, monkeypatch):
    from tosca_mlmt.train import distributed

    root = _copy(tmp_path, "gpu")
    # from a folder without configs/: the DeepSpeed path still means the shipped JSON
    p = run_mlmt("config", "-c", "examples/gpu/config.yaml", cwd=root, check=True)
    cfg = yaml.safe_load(p.stdout)
    assert (cfg["engine"]["name"], cfg["model"]["dtype"], cfg["distributed"]["backend"]) == ("vllm", "bfloat16", "nccl")
    zero = root / cfg["distributed"]["deepspeed"]  # an absolute path stays itself
    conf = json.loads(zero.read_text())
    assert conf["zero_optimization"]["stage"] == 2
    lo, up, joint = cfg["lower"], cfg["upper"], cfg["joint"]
    for world in (1, 2, 4, 8):  # README: one process per GPU, 1 to 8 GPUs
        assert lo["grad_accum"] % world == 0 and lo["problems_per_iteration"] % world == 0
        assert joint["collect_problems"] % world == 0 and (up["batch_size"] // up["micro_batch_size"]) % world == 0
        micro, local = lo["minibatch_size"] // lo["grad_accum"], lo["grad_accum"] // world
        monkeypatch.setattr(distributed, "world", lambda w=world: w)  # what torch.distributed reports there
        filled = distributed.fill_deepspeed_config(conf, micro, local, lo["max_grad_norm"], True, str(zero))
        assert filled["train_batch_size"] == lo["minibatch_size"] and filled["bf16"]["enabled"] is True
