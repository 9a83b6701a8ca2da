"""What ``mlmt export`` adds to a merged model's card (rendered by models/artefacts.py):

* held-out evals of the exported weights: ``mlmt eval --out`` folders, given (``--eval``) or found next
  to the run, each checked against the weights by the fingerprints its snapshot records;
* the prompt format training used, rendered by the code that builds the prompts (tosca_mlmt.prompts,
  pieced together as rollout/turns.py does), so a plain-transformers user prompts the model the way it
  learned, and the card cannot drift from what training does.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError, MlmtError

EVAL_FILE = "eval.json"
# what the card's example refine shows in place of a real answer and feedback
EXAMPLE_ATTEMPT = "[the model's answer to turn 1]"
EXAMPLE_FEEDBACK = "[the feedback on that answer]"
SLOTS = {"question": "{question}", "attempt": "{attempt}", "feedback": "{feedback}", "instruction": "{instruction}"}


# ---------------------------------------------------------------------- held-out evals


def read_eval(path: str | Path) -> dict:
    """An ``mlmt eval --out`` folder's result: Acc@t1 and Acc@final, each with its 95 % Wilson interval,
    counted on the episodes of its snapshot (verified: hashes checked), with what the eval ran: task,
    split, decoding, rounds, environment and the fingerprints of the weights. The folder is named by
    its name only (no machine path in a card)."""
    path = Path(path)
    report, manifest, outcomes = _load_eval(path)
    rec = {"name": path.name, "task": report.get("task") or (manifest.get("task") or {}).get("name"),
           "split": report.get("split"), "problems": len(outcomes["ids"]), "environment": outcomes["environment"],
           "strategy_selection": report.get("strategy_selection")}
    for k in ("t1", "final"):
        rec[f"acc_{k}"] = _accuracy(path, report, outcomes, k)
    rec.update(_eval_settings(manifest, rec["task"]))
    if isinstance(report.get("compared_to"), dict):
        c = report["compared_to"]
        rec["compared_to"] = {**c, "eval": Path(str(c.get("eval") or "?")).name}
    return rec


def _load_eval(path: Path) -> tuple[dict, dict, dict]:
    """The folder's eval.json, its snapshot's manifest and the episodes' outcomes (eval_outcomes);
    ConfigError naming ``--eval`` when any of them cannot be read."""
    from tosca_mlmt.pipelines.evaluate import eval_outcomes
    from tosca_mlmt.store import load_snapshot

    try:
        report = json.loads((path / EVAL_FILE).read_text())
        sid = report["snapshot_id"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--eval {path}: not an eval folder, an `mlmt eval --out` folder with {EVAL_FILE} "
                          f"({type(e).__name__}: {e})") from None
    try:
        manifest = load_snapshot(path / "snapshots", sid).manifest
        outcomes = eval_outcomes(path)
    except MlmtError as e:
        raise ConfigError(f"--eval {path}: its snapshot {sid} cannot be read ({e})") from None
    return report, manifest, outcomes


def _accuracy(path: Path, report: dict, outcomes: dict, k: str) -> dict:
    """Acc@``k`` counted on the snapshot's episodes, with its Wilson interval; eval.json's own number
    must agree, or the file was edited or belongs to another snapshot."""
    from tosca_mlmt.analysis.stats import wilson

    n = len(outcomes["ids"])
    hits = sum(outcomes[k])
    mean = hits / n if n else 0.0
    said = report.get(f"acc_{k}")
    if isinstance(said, (int, float)) and abs(said - mean) > 1e-9:
        raise ConfigError(f"--eval {path}: {EVAL_FILE} says acc_{k}={said}, but its snapshot's {n} episodes "
                          f"give {mean} (the file was edited, or belongs to another snapshot)")
    lo, hi = wilson(hits, n)
    return {"mean": mean, "lo": lo, "hi": hi, "correct": hits}


def _eval_settings(manifest: dict, task: str | None) -> dict:
    """What the eval ran, from its snapshot's manifest: rounds, arith's level, the sampling
    temperatures and the weights' fingerprints."""
    cfg = manifest.get("config") or {}
    out = {"rounds": (cfg.get("episode") or {}).get("rounds")}
    if task == "arith":  # task.level only means something to arith
        out["level"] = (cfg.get("task") or {}).get("level")
    out["temperature"] = {r: ((manifest.get("sampling") or {}).get(r) or {}).get("temperature")
                          for r in ("solver", "writer")}
    out["models"] = {r: {k: v for k, v in (fp or {}).items() if k != "base"}  # "base" is a machine path
                     for r, fp in (manifest.get("models") or {}).items()}
    return out


def find_evals(roots: list[Path], role: str, fingerprints) -> list[Path]:
    """Eval folders directly under ``roots`` (where `make demo` puts them: runs/demo/eval beside
    runs/demo/run) whose snapshot ran exactly the exported weights (``fingerprints()``, computed only
    when some eval is there to compare). Folders that are not readable evals are passed over."""
    from tosca_mlmt.store import read_manifest, snapshot_path

    found = []
    for root in dict.fromkeys(Path(r).resolve() for r in roots):
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            if not (d / EVAL_FILE).is_file():
                continue
            try:
                sid = json.loads((d / EVAL_FILE).read_text())["snapshot_id"]
                models = read_manifest(snapshot_path(d / "snapshots", sid)).get("models") or {}
            except (OSError, ValueError, KeyError, TypeError, MlmtError):
                continue
            if weights_differ(models, role, fingerprints()) == []:
                found.append(d)
    return found


def weights_differ(models: dict, role: str, fingerprints: dict) -> list[str] | None:
    """How an eval's recorded ``models`` differ from the exported ``role`` (``fingerprints``): [] when
    they are the same weights, None when the eval does not fingerprint them (nothing to compare)."""
    got = (models or {}).get(role) or {}
    if not got.get("adapter_sha"):
        return None
    names = {"adapter_sha": f"{role} adapter", "base_sha": "base weights", "q_head_sha": "Q head"}
    return [f"{label} {got[k]} (exported: {fingerprints[k]})" for k, label in names.items()
            if got.get(k) and fingerprints.get(k) and got[k] != fingerprints[k]]


def eval_facts(records: list[dict], role: str, fingerprints: dict, folder: Path, explicit: bool) -> list[dict]:
    """``records`` (read_eval) with whether each ran the exported weights; a given one that did not is
    kept, marked, and warned about: the card must not pass its numbers off as this model's."""
    from tosca_mlmt.models.artefacts import read_meta

    other = "writer" if role == "solver" else "solver"
    partner = read_meta(folder.parent / other).get("adapter_sha")  # the run's other policy, if beside it
    out = []
    for rec in records:
        diff = weights_differ(rec["models"], role, fingerprints)
        rec = {**rec, "matches": diff == [] if diff is not None else None, "differences": diff or []}
        theirs = (rec["models"].get(other) or {}).get("adapter_sha")
        rec["partner"] = {"role": other, "adapter_sha": theirs, "this_run": bool(partner) and theirs == partner}
        if explicit and rec["matches"] is False:
            warnings.warn(f"--eval {rec['name']}: it evaluated other weights than the exported ones ("
                          f"{'; '.join(diff)}); the card says so", stacklevel=2)
        elif explicit and rec["matches"] is None:
            warnings.warn(f"--eval {rec['name']}: its snapshot does not fingerprint the weights it ran, so it cannot "
                          "be checked against the exported ones; the card says so", stacklevel=2)
        out.append(rec)
    return out


# ---------------------------------------------------------------------- prompt format


def example_problem(task):
    """The first held-out problem (what an eval starts with), or, when the task's data is not here,
    a stand-in question."""
    from tosca_mlmt.tasks.base import Problem

    try:
        problems = task.load("test", limit=1).problems
        if problems:
            return problems[0], True
    except Exception:  # noqa: BLE001 (any task's loader: missing data must not stop the export)
        pass
    return Problem(task.name, "example", "[the problem]", "", "test"), False


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _slot(text: str, value: str, slot: str) -> str | None:
    """``text`` with its one occurrence of ``value`` replaced by ``slot``; None when it has not exactly one."""
    return text.replace(value, slot) if value and text.count(value) == 1 else None


def prompt_format(cfg: Config, merged, config_known: bool) -> dict:
    """The prompts ``merged`` (models.export.Merged) was trained with, for the card: per turn the user
    message with ``{slots}``, and one example rendered by tosca_mlmt.prompts.ChatFormat from the ids
    training would build, with checks that the chat template over plain messages and the tokenizer
    over the text give the same prompt."""
    from tosca_mlmt.prompts import TEMPLATE_VARS, ChatFormat
    from tosca_mlmt.tasks.registry import build_task

    task = build_task(cfg.task)
    problem, real = example_problem(task)
    kwargs = {**TEMPLATE_VARS, **cfg.model.chat_template_kwargs}
    fmt = ChatFormat(merged.tokenizer, merged.eos_ids, cfg.model.chat_template_kwargs)
    out = {"role": merged.role, "task": cfg.task.name, "config_known": config_known, "template_kwargs": kwargs,
           "example_question": problem.question, "example_is_real": real}
    turns = solver_turns(fmt, task, problem, cfg) if merged.role == "solver" else writer_turn(fmt, problem, cfg, merged)
    tok = merged.tokenizer
    for turn in turns:
        ids = turn.pop("ids")
        turn["text"] = _decode(tok, ids)
        rendered = tok.apply_chat_template(turn["messages"], add_generation_prompt=True, tokenize=False, **kwargs)
        turn["chat_template_matches"] = rendered == turn["text"]
        # training appends each piece's ids; tokenizing the joined text may merge across a join
        turn["same_ids"] = list(tok(turn["text"], add_special_tokens=False)["input_ids"]) == ids
    out["turns"] = turns
    out["notes"] = training_notes(cfg, merged.role)
    return out


def solver_turns(fmt, task, problem, cfg: Config) -> list[dict]:
    """Turn 1 (solve) and the refine, as Turns.first_prompts and refine_prompt (rollout/turns.py) build them."""
    from tosca_mlmt.prompts import REFINE_USER_PREFIX, REFINE_USER_SUFFIX

    user1 = task.instruction(problem)
    p1 = fmt.first_prompt(user1)
    answer_format = getattr(task, "answer_format", "")
    attempt = fmt.encode(EXAMPLE_ATTEMPT) + [fmt.close_id]  # an answer that ended its turn, as most do
    ctx = p1 + attempt
    suffix = REFINE_USER_SUFFIX.format(question=problem.question, answer_format=answer_format)
    cont, _ = fmt.continue_with_user(ctx, [REFINE_USER_PREFIX, "", fmt.encode(EXAMPLE_FEEDBACK), suffix])
    refine_user = REFINE_USER_PREFIX + EXAMPLE_FEEDBACK + suffix
    first = [{"role": "user", "content": user1}]
    slotted = REFINE_USER_PREFIX + SLOTS["feedback"] + REFINE_USER_SUFFIX.format(question=SLOTS["question"],
                                                                                 answer_format=answer_format)
    return [{"name": "solve", "user": _slot(user1, problem.question, SLOTS["question"]), "messages": first,
             "ids": p1},
            {"name": "refine", "user": slotted, "attempt": EXAMPLE_ATTEMPT, "feedback": EXAMPLE_FEEDBACK,
             "messages": [*first, {"role": "assistant", "content": EXAMPLE_ATTEMPT},
                          {"role": "user", "content": refine_user}],
             "ids": ctx + cont}]


def writer_turn(fmt, problem, cfg: Config, merged) -> list[dict]:
    """The writer's feedback prompt after attempt 1, as Turns.plan_feedback builds it (its
    first strategy as the example)."""
    from tosca_mlmt.prompts import WRITER_STATE, WRITER_STRATEGY, WRITER_SYSTEM

    strategies = writer_strategies(merged.folder, cfg)
    instruction = strategies[0]["instruction"]
    attempt = fmt.encode(EXAMPLE_ATTEMPT)  # the writer reads the attempt without its eos
    pieces = [WRITER_STATE.format(question=problem.question), "Student's attempt 1:\n", attempt, "\n\n",
              WRITER_STRATEGY.format(instruction=instruction)]
    ids, _ = fmt.user_prompt_with_ids(WRITER_SYSTEM, pieces)
    user = (WRITER_STATE.format(question=problem.question) + f"Student's attempt 1:\n{EXAMPLE_ATTEMPT}\n\n"
            + WRITER_STRATEGY.format(instruction=instruction))
    slotted = (WRITER_STATE.format(question=SLOTS["question"]) + f"Student's attempt 1:\n{SLOTS['attempt']}\n\n"
               + WRITER_STRATEGY.format(instruction=SLOTS["instruction"]))
    messages = fmt._messages(WRITER_SYSTEM, user)  # what user_prompt_with_ids renders: system folded in or not
    return [{"name": "feedback", "system": WRITER_SYSTEM, "system_in_user": not fmt.system_role,
             "user": slotted, "attempt": EXAMPLE_ATTEMPT, "instruction": instruction,
             "strategies": [{"name": s["name"], "instruction": s["instruction"]} for s in strategies],
             "messages": messages, "ids": ids}]


def writer_strategies(folder: Path, cfg: Config) -> list[dict]:
    """The strategy list the writer was trained with: its folder's, else the config's."""
    from tosca_mlmt.models.policies import saved_strategies

    try:
        saved = saved_strategies(folder)
    except (OSError, ValueError):  # a card is written whatever the folder holds
        saved = None
    return saved or cfg.episode.strategies


def training_notes(cfg: Config, role: str) -> list[str]:
    """What else shaped the prompts in training, which the template alone does not show."""
    e, notes = cfg.episode, []
    if role == "solver":
        fixed = {s["name"]: s.get("prefix", "") for s in e.strategies if s["name"] in e.prefix_only and s.get("prefix")}
        if e.feedback == "static":
            notes.append("the feedback was always one strategy's fixed instruction: "
                         + "; ".join(f"\"{s['instruction']}\"" for s in e.strategies))
        elif e.feedback == "verdict":
            notes.append("the feedback was the verifier's verdict, \"Your answer is right.\" or \"Your answer is "
                         "wrong.\" (a privileged control)")
        elif e.feedback == "tool":
            notes.append("the feedback was the task's own check's fixed hint on the attempt (e.g. \"Recheck 7 + 10.\")")
        elif fixed:
            notes.append("for some strategies the feedback was only their fixed sentence: "
                         + "; ".join(f"\"{v}\"" for v in fixed.values()))
        if e.strategy_prefix and e.feedback == "generate":
            notes.append("the writer's feedback opened with its strategy's fixed sentence (episode.strategy_prefix)")
        if e.rounds == 0:
            notes.append("episodes had no feedback round (episode.rounds=0): only turn 1 was trained")
        elif e.rounds > 1:
            notes.append(f"episodes had {e.rounds} feedback rounds; each refine repeats the refine message after "
                         "the last answer")
    elif e.writer_sees != "none" and role == "writer":
        notes.append(f"the writer also saw one line per attempt on {e.writer_sees} (episode.writer_sees), "
                     "after the attempt")
    if e.reasoning_tags:
        notes.append(f"the solver thinks between {e.reasoning_tags[0]} and {e.reasoning_tags[1]}")
    return notes
