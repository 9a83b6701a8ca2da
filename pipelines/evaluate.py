"""``mlmt eval``: the three-turn loop, greedy decoding, on held-out problems only.

Strategies are chosen by the same rule before and after training (``episode.strategy_selection``,
default ``auto``: uniform without a trained Q head, epsilon-softmax over Q with one), drawn with
the run's seed; eval.json records the rule.

There is no oracle stop: every episode runs all K rounds even when turn 1 was already
right, so Acc@final measures what a user of the system would get, and right->wrong
(breaking a correct answer) is counted.

``--majority K`` and ``--resample tool`` add the inference-matched controls (analysis/controls.py):
the same solver, sampled at its own temperature with no feedback, given as many generations as the
feedback method. Their answers are one more snapshot in the eval folder, each problem's votes and
checks are in controls.json, and the accuracies in eval.json.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.pipelines.collect import collect
from tosca_mlmt.pipelines.support.drift import USE_SAFE, drifted, predates_text, read_run_config, show_drift
from tosca_mlmt.pipelines.support.rundir import RunDir


@dataclass
class EvalResult:
    path: Path  # eval.json
    report: dict


def adapters_from_run(run: Path) -> dict[str, str]:
    """A run folder's trained policies: ``solver/`` (train-lower/joint), ``writer/`` (train-upper/joint)."""
    found = {}
    for role in ("solver", "writer"):
        if (run / role / "adapter_config.json").exists():
            found[f"model.{role}_adapter"] = str(run / role)
    if not found:
        raise ConfigError(f"--run {run}: no trained solver/ or writer/ adapter folder in it")
    return found


def run_config(run: str | Path, path: str | Path | None = None, overrides: dict | None = None,
               flag: str = "--run") -> tuple[Config, list[str]]:
    """The config of a command that uses a trained run (eval, chat, export ``--run``), and the
    warnings to show for it.

    Its base is the run's ``config.yaml`` (what it trained with: the writer's strategies, whether
    it writes text or only selects a sentence, the task, the prompts) with the run's trained
    adapters (``adapters_from_run``); the ``-c`` file (``path``) and ``overrides`` go on top of it,
    in that order. A train-joint run's top-level config.yaml is the one: each round's stage runs
    (``rounds/NNN/lower``, ``.../upper``) derive theirs from it by seed, lengths and logging only.
    Each field that ``-c``/``overrides`` change from what training used is named in a warning
    (drift, as ``--resume`` reports it), but those of ``drift.USE_SAFE``: where and how the
    command runs. A folder without config.yaml (adapters copied by hand) keeps the old way: the
    ``-c`` config with the adapters, and a warning that the training config is unknown."""
    from tosca_mlmt.config import load_config

    run = Path(run)
    adapters = adapters_from_run(run)
    if not (run / "config.yaml").exists():
        cfg = load_config(path, {**adapters, **(overrides or {})})
        return cfg, [f"{flag} {run}: no config.yaml in it, so what the run trained with is unknown; using "
                     f"{'-c ' + str(path) if path is not None else 'the default config'} with its adapters"]
    trained, notes = _trained_config(run, adapters, flag)
    cfg = load_config(None, _on_top(trained, path, overrides))
    new = cfg.to_dict()
    changed = drifted(trained, new, USE_SAFE)
    if changed:
        notes.append(f"{flag}: the config differs from {run}/config.yaml, what the run was trained with, in "
                     f"{show_drift(trained, new, changed)}: -c/--set changed it")
    return cfg, notes


def _trained_config(run: Path, adapters: dict, flag: str) -> tuple[dict, list[str]]:
    """The run's config.yaml with its trained adapters, as it loads now, and the warning for the
    fields it predates (if any)."""
    from tosca_mlmt.config import load_config

    saved, added = read_run_config(run, flag)
    notes = [predates_text(run, flag, added)] if added else []
    try:
        trained = load_config(None, {**saved, **adapters}).to_dict()
    except ConfigError as e:
        raise ConfigError(f"{flag}: {run}/config.yaml no longer loads ({e})") from None
    return trained, notes


def _on_top(trained: dict, path: str | Path | None, overrides: dict | None) -> dict:
    """``trained`` with the ``-c`` file and then ``overrides`` on top, as ``load_config`` applies
    them (a section merges field by field)."""
    from tosca_mlmt.config.load import set_dotted
    from tosca_mlmt.config.presets import resolve_config
    from tosca_mlmt.config.yamlfile import deep_merge, read_yaml

    tree = copy.deepcopy(trained)
    if path is not None:
        tree = deep_merge(tree, read_yaml(resolve_config(path)))
    for dotted, value in (overrides or {}).items():
        set_dotted(tree, dotted, value)
    return tree


def evaluate(cfg: Config, out: str | Path, *, console=None, compare_to: str | Path | None = None,
             majority: int | None = None, resample: str | None = None, refine: str = "greedy") -> EvalResult:
    """``compare_to``: an earlier eval folder on the same problems; the before/after comparison
    (``compare_outcomes``) is added to the report as ``compared_to``. ``majority`` (k; 0 = 1 +
    episode.rounds) and ``resample`` ("tool"): the controls (``plan_controls``), added to the report.
    ``refine``: how the refine turns decode (``eval_config``)."""
    from tosca_mlmt.analysis.controls import plan_controls

    if cfg.task.split not in ("test", "test-unseen"):
        raise ConfigError("invalid value for field 'task.split': eval runs on held-out problems only (test, "
                          "or arith's test-unseen)")
    rd = RunDir(out, "eval", console)
    before = eval_outcomes(compare_to) if compare_to is not None else None  # a bad folder fails before the eval
    plan = plan_controls(majority, resample, cfg.episode.rounds, cfg.solver_sampling.temperature)
    task = _control_task(cfg, plan)  # a task without a checker fails before the eval
    sampled, cfg = cfg, eval_config(cfg, refine)
    with _shared_models(cfg, plan) as shared:
        res = collect(cfg, rd.path / "snapshots", console=console, prefix="eval", **shared)
        ctl = (collect(control_config(sampled, plan), rd.path / "snapshots", console=console, prefix="eval", **shared)
               if plan is not None else None)
    report = {"snapshot_id": res.snapshot_id, "task": cfg.task.name, "split": cfg.task.split,
              "solver_adapter": cfg.model.solver_adapter or None, "writer_adapter": cfg.model.writer_adapter or None,
              "strategy_selection": cfg.episode.strategy_selection, "epsilon": cfg.episode.epsilon,
              "refine": refine, **res.summary}
    if before is not None and dist.is_main():  # under torchrun every rank collected its share; one reports
        after = _outcomes(rd.path / "snapshots", res.snapshot_id, report.get("environment", "honest"))
        report["compared_to"] = {"eval": str(compare_to), **compare_outcomes(before, after, compare_to)}
    if ctl is not None and dist.is_main():
        report.update(_controls(rd, task, plan, sampled, res.snapshot_id, ctl.snapshot_id))
    return EvalResult(rd.write_json("eval.json", report), report)


def control_config(cfg: Config, plan) -> Config:
    """The controls' collect (``cfg`` as given, before eval_config): turn 1 only, ``plan.samples``
    answers per problem sampled at the solver's own temperature (solver_sampling), no writer turn."""
    return replace(cfg, collect=replace(cfg.collect, solve_temperature=-1.0, refine_temperature=-1.0,
                                        writer_temperature=-1.0),
                   episode=replace(cfg.episode, rounds=0, n_samples=plan.samples, counterfactual=False,
                                   gold_prob=False))


def _control_task(cfg: Config, plan):
    """The task whose checker gates the resamples (None without ``--resample``)."""
    from tosca_mlmt.analysis.controls import require_checker
    from tosca_mlmt.tasks import make_task

    if plan is None or not plan.resample:
        return None
    task = make_task(cfg.task)
    require_checker(task)
    return task


@contextmanager
def _shared_models(cfg: Config, plan):
    """One model load and one engine for the eval and its controls' collect; without controls
    nothing (collect loads its own, as before)."""
    if plan is None:
        yield {}
        return
    from tosca_mlmt import runtime
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.rollout.engines import make_engine

    runtime.setup(cfg)  # as collect's setup does first: threads, seeds, process group
    policies = PolicyPair(cfg.model, seed=cfg.seed)
    engine = make_engine(cfg, policies)
    try:
        yield {"policies": policies, "engine": engine}
    finally:
        engine.close()


def _controls(rd: RunDir, task, plan, cfg: Config, sid: str, control_sid: str) -> dict:
    """The controls' numbers for eval.json; each problem's samples, votes and checks go to controls.json."""
    from tosca_mlmt.analysis.controls import control_row, control_summary, flagged

    tags, reads, snaps = cfg.episode.reasoning_tags, cfg.episode.writer_reads_thinking, rd.path / "snapshots"
    firsts, samples = _attempts(snaps, sid), _attempts(snaps, control_sid)
    rows = []
    for pid, [(problem, first)] in firsts.items():
        flag = lambda a, p=problem: flagged(task, p, a.turn, tags, reads)  # noqa: E731
        rows.append({"id": pid, **control_row(first, [a for _, a in samples[pid]], plan, flag)})
    rd.write_json("controls.json", {"snapshot_id": control_sid, "rows": rows})
    return {**control_summary(rows, plan),
            "controls": {"snapshot_id": control_sid, "temperature": cfg.solver_sampling.temperature,
                         "samples_per_problem": plan.samples, "rows": "controls.json"}}


def _attempts(snapshots: Path, sid: str) -> dict:
    """Each problem's turn-1 answers in one snapshot, by problem id and then sample: (problem, Attempt),
    the Attempt holding the stored turn for the checker (which reads it as the method's tool does)."""
    from tosca_mlmt.analysis.controls import Attempt
    from tosca_mlmt.store import load_snapshot

    out: dict = {}
    for e in sorted(load_snapshot(snapshots, sid).episodes(), key=lambda e: (e.problem.id, e.sample)):
        t = e.solver_turns[0]
        out.setdefault(e.problem.id, []).append((e.problem, Attempt(t.extracted, bool(t.correct), t)))
    return out


REFINE_DECODING = ("greedy", "sampled")


def eval_config(cfg: Config, refine: str = "greedy") -> Config:
    """The eval protocol (mlmt eval, train-joint's per-round eval): greedy solver and writer, one
    sample per problem, and the configured strategy selection (episode.strategy_selection, seeded):
    switching to argmax only once a writer is trained would compare two protocols.

    ``refine="sampled"``: the refine turns sample at ``cfg``'s own solver_sampling.temperature (seeded),
    turn 1 and the writer stay greedy. ``--resample tool`` samples its answers at that temperature, so a
    refine decoded the same way is what it must be compared with: a greedy refine of a small solver
    mostly repeats its attempt, a sampled resample does not, and a greedy-refine-vs-sampled-resample
    gap mixes the feedback's effect with the decoding's."""
    if refine not in REFINE_DECODING:
        raise ConfigError(f"invalid value {refine!r} for --refine; allowed: {', '.join(REFINE_DECODING)}")
    refine_t = -1.0
    if refine == "sampled":
        refine_t = cfg.solver_sampling.temperature
        if refine_t <= 0:
            raise ConfigError("--refine sampled: solver_sampling.temperature is 0, so the refine would be greedy; "
                              "set it (--set solver_sampling.temperature=0.7) to the temperature to sample at")
    return replace(cfg, solver_sampling=replace(cfg.solver_sampling, temperature=0.0),
                   writer_sampling=replace(cfg.writer_sampling, temperature=0.0),
                   collect=replace(cfg.collect, solve_temperature=-1.0, refine_temperature=refine_t,
                                   writer_temperature=-1.0),
                   episode=replace(cfg.episode, n_samples=1))


def _outcomes(snapshots: Path, sid: str, environment: str, texts: bool = False) -> dict:
    """Per-problem 0/1 outcomes of one eval snapshot, ordered by problem id (so two evals pair up);
    with ``texts`` also the answers themselves (t1_text, final_text), in the same order."""
    from tosca_mlmt.store import load_snapshot

    eps = sorted(load_snapshot(snapshots, sid).episodes(), key=lambda e: e.problem.id)
    out = {"ids": [e.problem.id for e in eps], "environment": environment,
           "t1": [int(bool(e.solver_turns[0].correct)) for e in eps],
           "final": [int(bool(e.solver_turns[-1].correct)) for e in eps]}
    if texts:
        out.update(t1_text=[e.solver_turns[0].text for e in eps], final_text=[e.solver_turns[-1].text for e in eps])
    return out


def eval_outcomes(eval_dir: str | Path, texts: bool = False) -> dict:
    """``_outcomes`` of an eval folder (its eval.json names the snapshot)."""
    eval_dir = Path(eval_dir)
    try:
        report = json.loads((eval_dir / "eval.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{eval_dir}: not an eval folder ({e})") from None
    return _outcomes(eval_dir / "snapshots", report["snapshot_id"], report.get("environment", "honest"), texts)


def compare_outcomes(a: dict, b: dict, before_name: str | Path = "the earlier eval") -> dict:
    """Before (a) / after (b) on the same problems: each accuracy with its Wilson interval, the
    paired difference in Acc@final with a bootstrap interval, and an exact McNemar test."""
    import numpy as np

    from tosca_mlmt.analysis.stats import mcnemar, paired_bootstrap, wilson

    if a["ids"] != b["ids"]:
        raise ConfigError(f"--compare-to {before_name}: its problems differ from this eval's "
                          f"({len(a['ids'])} vs {len(b['ids'])}); run both with the same task, split and --limit")
    n = len(a["ids"])
    out = {"problems": n}
    for name, o in (("before", a), ("after", b)):
        for k in ("t1", "final"):
            lo, hi = wilson(sum(o[k]), n)
            out[f"{name}_acc_{k}"] = {"mean": sum(o[k]) / max(n, 1), "lo": lo, "hi": hi}
        out[f"{name}_environment"] = o["environment"]
    out["final_difference"] = paired_bootstrap(np.array([b["final"]]), np.array([a["final"]]))
    out["final_mcnemar"] = mcnemar(np.array(b["final"]), np.array(a["final"]))
    return out

