"""The model card of `mlmt export` (issue 67): the held-out eval of the exported weights (given or
found beside the run, checked by fingerprint), training-batch numbers labelled as such, and the prompt
format, which must equal what training's runner builds. All on the random debug base."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import FP32, random_lora_b, run_mlmt
from tosca_mlmt.analysis.stats import wilson

# the run's config: the debug base, short turns, fixed (static) feedback so evals need no writer text
RUN_CFG = {**FP32, "model.solver": "tiny-random", "logging.wandb": False, "logging.progress": False,
           "task.level": 2, "episode.feedback": "static", "solver_sampling.max_new_tokens": 12,
           "writer_sampling.max_new_tokens": 8, "episode.max_feedback_tokens": 8}
EVAL = {"task.split": "test", "task.limit": 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs/run (trained-looking solver and writer, config.yaml, the solver's training-batch numbers as
    train-lower records them), runs/eval-before (the untrained pair) and runs/eval (`mlmt eval --run`
    with --compare-to eval-before), as `make demo` lays them out."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.pipelines.evaluate import evaluate, run_config
    from tosca_mlmt.pipelines.train_lower import _describe_final

    root = tmp_path_factory.mktemp("runs")
    run = root / "run"
    cfg = load_config(overrides=RUN_CFG)
    evaluate(load_config(overrides={**RUN_CFG, **EVAL}), root / "eval-before")
    pair = PolicyPair(cfg.model, seed=0)
    for i, role in enumerate(("solver", "writer")):
        random_lora_b(pair, role, seed=i)
    pair.describe("solver", stage="train-lower", config=cfg)
    _describe_final(pair, run, None, {"lower/acc_t1": 0.0625, "lower/acc_final": 0.125, "lower/delta": 0.0625,
                                      "lower/episodes": 16}, 2, 0.7)
    for role in ("solver", "writer"):
        pair.save_role(role, run / role)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # task.split/limit differ from the run's: what eval --run warns about
        evaluate(run_config(run, overrides=EVAL)[0], root / "eval", compare_to=root / "eval-before")
    return root, pair, cfg


def _export(src: Path, out: Path, **kw) -> str:
    from tosca_mlmt.pipelines.export import export

    export(src, out, **kw)
    return (out / "README.md").read_text()


def _interval(acc: float, n: int) -> str:
    lo, hi = wilson(round(acc * n), n)
    return f"[{lo:.3f}, {hi:.3f}]"


def _section(card: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    body = card.index(heading + "\n") + len(heading) + 1
    nxt = re.search(rf"^#{{1,{len(level)}}} ", card[body:], re.M)
    return card[body - len(heading) - 1:body + nxt.start() if nxt else len(card)]


def _block(card: str, label: str, lang: str = "text") -> str:
    """The fenced ``lang`` block that follows ``label`` in the card."""
    rest = card[card.index(label):]
    return re.search(rf"```{lang}\n(.*?)\n```", rest, re.S).group(1)


def _eval_row(card: str, report: dict, turn: str) -> None:
    n, acc = report["episodes"], report[f"acc_{turn}"]
    row = next(line for line in card.splitlines() if line.startswith(f"| Acc@{turn}"))
    assert f"| {acc:.3f} ({round(acc * n)}/{n}) | {_interval(acc, n)} | {n} |" in row, row


# ---------------------------------------------------------------------- held-out evals


def test_card_reports_the_held_out_eval_found_beside_the_run_and_labels_training_numbers(runs, tmp_path):
    root, _, _ = runs
    card = _export(root / "run", tmp_path / "merged")
    report = json.loads((root / "eval" / "eval.json").read_text())
    ev = _section(card, "### Held-out eval `eval`")
    assert "found beside the run" in ev and "on task `arith` (level 2), split `test`" in ev
    assert f"{report['episodes']} problems, greedy decoding (temperature 0), 1 feedback round" in ev
    for turn in ("t1", "final"):
        _eval_row(ev, report, turn)
    meta = json.loads((tmp_path / "merged" / "tosca_mlmt.json").read_text())
    (held,) = meta["held_out_evals"]  # eval-before ran the untrained adapters: not these weights
    exported = json.loads((root / "run" / "solver" / "tosca_mlmt.json").read_text())
    assert held["matches"] is True and held["models"]["solver"]["adapter_sha"] == exported["adapter_sha"]
    sha = exported["adapter_sha"]
    assert f"It ran exactly the exported weights: its snapshot fingerprints the solver adapter `{sha}`" in ev
    assert "(this run's `writer/`)" in ev
    c = report["compared_to"]
    assert (f"against the eval `eval-before` on the same {c['problems']} problems, Acc@t1 "
            f"{c['before_acc_t1']['mean']:.3f} -> {c['after_acc_t1']['mean']:.3f}") in ev
    d = c["final_difference"]
    assert f"Acc@final after - before {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" in ev
    assert "### Held-out eval `eval-before`" not in card
    assert str(root) not in card + (tmp_path / "merged" / "tosca_mlmt.json").read_text()  # names, no machine paths
    # the training batch is still there, labelled, after the held-out numbers
    evaluation = _section(card, "## Evaluation")
    assert evaluation.index("### Held-out eval") < evaluation.index("| metric (training-batch, not held-out) | value |")
    assert "No held-out eval" not in card


def test_without_a_held_out_eval_only_labelled_training_batch_numbers(runs, tmp_path):
    root, _, _ = runs
    alone = tmp_path / "alone" / "run"
    shutil.copytree(root / "run", alone)  # no eval folder in or beside it
    card = _export(alone, tmp_path / "merged")
    evaluation = _section(card, "## Evaluation")
    assert "**No held-out eval of these weights was given to `mlmt export` or found beside the run.**" in evaluation
    assert "They are not this model's accuracy" in evaluation
    assert ("the 16 training episodes of iteration 2, sampled at temperature 0.7 (a training batch, not a held-out "
            "eval)") in evaluation
    assert "| metric (training-batch, not held-out) | value |" in evaluation and "| acc_t1 | 0.0625 |" in evaluation
    assert "Held-out eval" not in card
    assert "held_out_evals" not in json.loads((tmp_path / "merged" / "tosca_mlmt.json").read_text())
    # the adapter's own card, written when training saved it, says the same
    saved = _section((alone / "solver" / "README.md").read_text(), "## Evaluation")
    assert "**No held-out eval of these weights is recorded with this folder.**" in saved
    assert "| metric (training-batch, not held-out) | value |" in saved


def _hand_made_eval(folder: Path, patterns, models: dict, config: dict) -> dict:
    """An eval folder with chosen outcomes (t1, final per problem) and the given fingerprints."""
    from factories import patterned_episode

    from tosca_mlmt.store import write_snapshot

    eps = [patterned_episode(i, p, ["verify"], [4], "t") for i, p in enumerate(patterns)]
    sid, _ = write_snapshot(folder / "snapshots", eps, {"kind": "collect", "models": models, "config": config,
                                                        "sampling": {"solver": {"temperature": 0.0},
                                                                     "writer": {"temperature": 0.0}}})
    n = len(patterns)
    report = {"snapshot_id": sid, "task": "arith", "split": "test", "strategy_selection": "auto", "episodes": n,
              "acc_t1": sum(p[0] for p in patterns) / n, "acc_final": sum(p[-1] for p in patterns) / n}
    (folder / "eval.json").write_text(json.dumps(report))
    return report


def _manifest(eval_dir: Path) -> dict:
    sid = json.loads((eval_dir / "eval.json").read_text())["snapshot_id"]
    return json.loads((eval_dir / "snapshots" / sid / "manifest.json").read_text())


def test_a_given_eval_is_reported_with_its_numbers_and_one_of_other_weights_is_flagged(runs, tmp_path):
    root, _, _ = runs
    real = _manifest(root / "eval")
    R, W = True, False
    pats = [(R, R), (W, R), (W, W), (R, R), (W, R), (R, W), (W, R)]  # t1 3/7, final 5/7
    mine = _hand_made_eval(tmp_path / "mine", pats, real["models"], real["config"])
    other = _hand_made_eval(tmp_path / "other", pats[:3], _manifest(root / "eval-before")["models"], real["config"])
    with pytest.warns(UserWarning, match="--eval other: it evaluated other weights than the exported ones"):
        card = _export(root / "run", tmp_path / "merged", evals=[tmp_path / "mine", tmp_path / "other"])
    ev = _section(card, "### Held-out eval `mine`")
    assert "given to `mlmt export --eval`" in ev and "It ran exactly the exported weights" in ev
    for turn in ("t1", "final"):
        _eval_row(ev, mine, turn)
    bad = _section(card, "### Held-out eval `other`")
    assert "**This eval ran other weights than the exported ones** (solver adapter" in bad
    assert "It ran exactly" not in bad
    assert "### Held-out eval `eval`" not in card  # given evals replace the search beside the run
    # an eval.json that disagrees with its own snapshot is refused before anything is merged
    (tmp_path / "mine" / "eval.json").write_text(json.dumps({**mine, "acc_final": 0.9}))
    from tosca_mlmt.errors import ConfigError

    with pytest.raises(ConfigError, match="eval.json says acc_final=0.9, but its snapshot's 7 episodes give"):
        _export(root / "run", tmp_path / "again", evals=[tmp_path / "mine"])
    assert not (tmp_path / "again").exists()


def test_export_cli_takes_eval_and_refuses_a_folder_that_is_no_eval(runs, tmp_path):
    root, _, _ = runs
    p = run_mlmt("export", "--run", root / "run", "--eval", root / "eval", "--out", tmp_path / "m")
    assert p.returncode == 0, p.stderr
    card = (tmp_path / "m" / "README.md").read_text()
    assert "given to `mlmt export --eval`" in card and "It ran exactly the exported weights" in card
    p = run_mlmt("export", "--run", root / "run", "--eval", root / "run", "--out", tmp_path / "n")
    assert p.returncode == 2 and f"--eval {root / 'run'}: not an eval folder" in p.stderr
    assert not (tmp_path / "n").exists()


# ---------------------------------------------------------------------- prompt format


def _runner(cfg, pair):
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.tasks.registry import build_task

    task = build_task(cfg.task)
    return EpisodeRunner(cfg, task, None, pair), task.load("test", limit=1).problems[0]


def test_the_card_prompts_are_the_ones_training_builds_and_its_snippet_runs(runs, tmp_path):
    from transformers import AutoTokenizer

    from tosca_mlmt.pipelines.model_card import EXAMPLE_ATTEMPT, EXAMPLE_FEEDBACK
    from tosca_mlmt.prompts import TEMPLATE_VARS
    from tosca_mlmt.records import Episode, Turn

    root, pair, cfg = runs
    out = tmp_path / "merged"
    card = _export(root / "run", out)
    runner, problem = _runner(cfg, pair)
    tok, sfmt = pair.tokenizer("solver"), runner.fmt["solver"]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731

    # turn 1 and the refine of the card's example, as EpisodeRunner builds them in training
    p1 = runner.first_prompts([problem])[0]
    assert _block(card, "`solve` (tokenizing it gives the very ids training built") == decode(p1)
    ep = Episode(f"{problem.id}/s0", problem, 0)
    attempt = sfmt.encode(EXAMPLE_ATTEMPT) + [sfmt.close_id]
    ep.turns = [Turn(0, 0, "solver", "solve", p1, attempt, [0.0] * len(attempt), "stop", EXAMPLE_ATTEMPT),
                Turn(1, 1, "writer", "feedback", [], runner.fmt["writer"].encode(EXAMPLE_FEEDBACK), [], "fixed",
                     EXAMPLE_FEEDBACK, strategy=0, strategy_name=runner.strategies[0]["name"])]
    refine, _ = runner.refine_prompt(ep, p1 + attempt)
    assert _block(card, "`refine` (tokenizing it gives the very ids training built") == decode(refine)
    # the templates with {slots}, filled the way the snippet fills them, render through the chat template
    # to the prompt training builds for any answer and feedback
    solve_t, refine_t = _block(card, "**Turn 1 (solve)**"), _block(card, "**Refine**")
    assert solve_t == runner.task.instruction(problem).replace(problem.question, "{question}")
    answer, feedback = "The answer is: 12", "Check the second number."
    ep.turns[0].response_ids = sfmt.encode(answer) + [sfmt.close_id]
    ep.turns[1].response_ids = runner.fmt["writer"].encode(feedback)
    want, _ = runner.refine_prompt(ep, p1 + ep.turns[0].response_ids)
    messages = [{"role": "user", "content": solve_t.replace("{question}", problem.question)},
                {"role": "assistant", "content": answer},
                {"role": "user",
                 "content": refine_t.replace("{feedback}", feedback).replace("{question}", problem.question)}]
    exported = AutoTokenizer.from_pretrained(out)
    rendered = exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **TEMPLATE_VARS)
    assert rendered == decode(want)
    # the notes say what else the solver read: this run's feedback was each strategy's fixed instruction
    assert f"\"{runner.strategies[0]['instruction']}\"" in _section(card, "## Prompt format")

    code = _block(card, "### Run it with transformers", "python")
    code = code.replace("THIS_FOLDER", str(out)).replace("MAX_NEW_TOKENS = 256", "MAX_NEW_TOKENS = 4")
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(code, "card-snippet", "exec"), ns)  # noqa: S102 (the card's own code, on the tiny model)
    assert [m["role"] for m in ns["messages"]] == ["user", "assistant", "user"] and printed.getvalue()
    assert ns["messages"][0]["content"] == runner.task.instruction(problem)


def test_a_writer_card_gives_the_feedback_prompt_plan_feedback_builds(runs, tmp_path):
    from tosca_mlmt.pipelines.model_card import EXAMPLE_ATTEMPT
    from tosca_mlmt.records import Episode, Turn

    root, pair, cfg = runs
    out = tmp_path / "writer"
    card = _export(root / "run", out, role="writer")
    meta = json.loads((out / "tosca_mlmt.json").read_text())
    assert [h["matches"] for h in meta["held_out_evals"]] == [True]  # the eval ran this writer and its Q head
    runner, problem = _runner(cfg, pair)
    attempt = runner.fmt["solver"].encode(EXAMPLE_ATTEMPT) + [runner.fmt["solver"].close_id]
    ep = Episode(f"{problem.id}/s0", problem, 0)
    ep.turns = [Turn(0, 0, "solver", "solve", [], attempt, [0.0] * len(attempt), "stop", EXAMPLE_ATTEMPT)]
    n = len(runner.strategies)
    runner.choose_strategies = lambda q, k, rng: (np.zeros(k, int), np.ones(k), np.full((k, n), 1 / n))
    (plan,) = runner.plan_feedback([ep], np.random.default_rng(0))
    tok = pair.tokenizer("writer")
    text = _block(card, "`feedback` (")
    assert text == tok.decode(plan.prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    # whether the text tokenizes back to training's ids, as the card says (pieces are encoded one by one)
    same = tok(text, add_special_tokens=False)["input_ids"] == plan.prompt
    assert ("`feedback` (tokenizing it gives the very ids training built" in card) == same
    code = _block(card, "### Run it with transformers", "python")
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code.replace("THIS_FOLDER", str(out)).replace("MAX_NEW_TOKENS = 256", "MAX_NEW_TOKENS = 4"),
                     "card-snippet", "exec"), ns)  # noqa: S102
    assert set(ns["STRATEGIES"]) == {s["name"] for s in runner.strategies}
