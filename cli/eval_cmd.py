"""``mlmt eval``: greedy three-turn evaluation on a held-out split."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tosca_mlmt.cli import common
from tosca_mlmt.cli.common import (CONFIG, DATA, NO_PROGRESS, NO_WANDB, SEED, SET, TASK, command_config,
                                  common_overrides, err, out_folder, parse_sets, print_result, print_summary)

# The summary table's rows: what the eval says about the pair. The other metrics (lengths, finish reasons,
# strategy counts and shares, timings) are in eval.json, and in the table with `mlmt --verbose eval`.
HEADLINE = ("episodes", "acc_t1", "acc_final",
            # the inference-matched controls (--majority, --resample), when asked: same solver generations, no feedback
            "acc_majority", "majority_k", "acc_resample", "resample_flagged", "resample_fixed", "resample_broke",
            "delta", "wrong_to_right", "right_to_wrong", "leak_rate",
            # a partial-credit reward shows in its mean where Acc (reward >= 1) sees nothing
            "reward_mean_t1", "reward_mean_final", "reward_std_final", "tokens_per_s")


def eval_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="Folder for eval.json and the eval snapshot.", parser=out_folder),
    run: Optional[Path] = typer.Option(None, "--run", help="A training run folder: its solver/ and writer/, and the "
                                       "config it trained with (config.yaml; -c and --set go on top, with a warning "
                                       "naming each field they change)."),
    solver: Optional[str] = typer.Option(None, help="Solver adapter folder (instead of --run)."),
    writer: Optional[str] = typer.Option(None, help="Writer folder: adapter + Q head + strategies (instead of --run)."),
    task: Optional[str] = TASK,
    split: str = typer.Option("test", help="test, or test-unseen (arith: the test facts in phrasings training "
                              "never uses): eval never touches training problems."),
    limit: Optional[int] = typer.Option(None, help="Number of held-out problems (0 = all)."),
    engine: Optional[str] = typer.Option(None, help="hf or vllm."),
    compare_to: Optional[Path] = typer.Option(None, "--compare-to", help="An earlier eval folder on the same "
                                              "problems (e.g. the untrained pair): print before/after with 95 % "
                                              "intervals, the paired difference and McNemar's p; saved in eval.json."),
    majority: Optional[int] = typer.Option(None, "--majority", metavar="K", help="Control: the solver also answers "
                                           "each problem K times, sampled at solver_sampling.temperature with no "
                                           "feedback; the most frequent answer counts (ties: the first in sample "
                                           "order). Acc@majority in eval.json; 0 = 1 + episode.rounds, the feedback "
                                           "method's solver generations."),
    resample: Optional[str] = typer.Option(None, "--resample", metavar="tool", help="Control: where the task's "
                                           "checker flags an answer the solver answers again, sampled with no "
                                           "feedback, up to episode.rounds times; the first unflagged answer (else "
                                           "the last) is final. Acc@resample, flagged, fixed and broke in eval.json."),
    refine: str = typer.Option("greedy", "--refine", metavar="greedy|sampled", help="How the refine turns "
                               "decode: greedy (the eval protocol), or sampled at solver_sampling.temperature "
                               "(seeded; turn 1 and the writer stay greedy), the decoding of --resample's answers, "
                               "so the two differ by the feedback alone."),
    config: Optional[Path] = CONFIG,
    set_: list[str] = SET,
    seed: Optional[int] = SEED,
    data: Optional[str] = DATA,
    no_wandb: bool = NO_WANDB,
    no_progress: bool = NO_PROGRESS,
):
    """Run solve -> feedback -> refine greedily on held-out problems (no oracle stop) and report
    Acc@t1, Acc@final, delta, wrong->right, right->wrong on stderr (with --verbose also strategy counts,
    lengths and timings; all in eval.json), and snapshot_id, acc_t1, acc_final, delta as one JSON line on stdout.
    With --majority / --resample also the controls at equal solver generations: Acc@majority, Acc@resample."""
    import json

    from tosca_mlmt.pipelines.evaluate import evaluate

    ov = {k: v for k, v in {"task.name": task, "task.split": split, "task.limit": limit,
                            "engine.name": engine, "model.solver_adapter": solver,
                            "model.writer_adapter": writer}.items() if v is not None}
    ov.update(common_overrides(seed, data, no_wandb, no_progress))
    ov.update(parse_sets(set_))
    res = evaluate(command_config(config, ov, run=run), out, console=err, compare_to=compare_to,
                   majority=majority, resample=resample, refine=refine)
    rep = res.report
    if "compared_to" in rep:
        _print_comparison(rep["compared_to"])
    metrics = {k: v for k, v in rep.items() if isinstance(v, (int, float))}
    shown = metrics if common.VERBOSE else {k: metrics[k] for k in HEADLINE if k in metrics}
    print_summary(f"eval on {rep['task']}/{rep['split']}", shown)
    if len(shown) < len(metrics):
        err.print(f"{len(metrics) - len(shown)} more metrics in {res.path} (`mlmt --verbose eval` prints them all)",
                  highlight=False)
    print_result(json.dumps({k: rep[k] for k in ("snapshot_id", "acc_t1", "acc_final", "delta")}))


def _print_comparison(c: dict) -> None:
    iv = lambda d: f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"  # noqa: E731
    err.print(f"before vs after on the same {c['problems']} problems (95 % intervals):", highlight=False)
    for k, label in (("t1", "Acc@t1"), ("final", "Acc@final")):
        err.print(f"  {label:9s} before {iv(c[f'before_acc_{k}'])}   after {iv(c[f'after_acc_{k}'])}", highlight=False)
    d, m = c["final_difference"], c["final_mcnemar"]
    err.print(f"  Acc@final after - before: {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] (paired bootstrap), "
              f"McNemar p = {m['p']:.3g} ({m['a_only']} fixed, {m['b_only']} lost)", highlight=False)
    envs = {c["before_environment"], c["after_environment"]}
    if any(str(e).startswith("privileged") for e in envs):  # honest:tool is honest
        err.print(f"  environment: {', '.join(sorted(envs))} (privileged: a sanity check, not a result)",
                  highlight=False)
