"""Does the method make answers better? Methods at equal compute, several seeds, paired statistics.

Every method trains with train-joint on arith (the same rounds, problems per round, PPO iterations,
writer steps: equal compute counted in episodes and optimizer steps; a frozen part spends none) and
is then evaluated by `mlmt eval`'s protocol (greedy decoding, the same strategy-selection rule, the
same fixed test problems, no oracle stop). Per-problem outcomes are kept, so methods are compared
*paired*: a two-level bootstrap over seeds x problems gives 95 % intervals, and an exact McNemar test
per seed checks the primary contrast.

Pre-registered primary contrast: `mlmt` minus each baseline on Acc@final.

arith's test set asks few distinct facts (level 2: about 35 in 300 problems) in phrasings training also uses, so
learning_summary reports beside each per-problem interval one that resamples whole facts (the honest one; "CI > 0"
targets are judged by it), and every unit is also evaluated out of distribution (--ood-evals, OOD_EVALS): on
arith's test-unseen split (the same facts in phrasings training never uses) and on gsm8k's test problems.

Environments (--env): `none` (the writer sees problem and attempts), `confidence` (plus the solver's
bucketed mean log-prob: honest), `verdict` (plus the verifier's right/wrong: a privileged sanity
environment; its results are labelled and never mixed with honest ones).

    python -m benchmarks.learning.learning_efficacy --env verdict --seeds 0 1 2 --test-problems 300
    python -m benchmarks.learning.learning_efficacy --smoke          # minutes: wiring only, decides nothing
    python -m benchmarks.learning.learning_efficacy --env confidence --methods mlmt --seeds 0 --tag fixes  # a grid apart
    python -m benchmarks.learning.learning_efficacy --env none --ladder --methods single-turn-grpo-x2 single-turn-grpo-x4

Each (method, seed) is one *unit*, written as soon as it finishes to
benchmarks/results/learning_efficacy/<env>-L<level>/<method>-seed<k>-<hash>.json with its git sha, the
sizes that define it and the hash of the resolved configuration it trained with. A unit counts for a
method only under that hash: when a preset changes, the old units stop counting for it (they stay on
disk and count for a method named with the old settings), and two names for one configuration share
units. A rerun with the same sizes skips finished units (``--force`` redoes them), so a grid larger
than one sitting fills up over several runs (``--budget-minutes`` stops starting units).
``--eval-strategy-temperature 0`` evaluates by argmax Q; with ``--reuse-runs`` the policies an earlier
invocation trained are evaluated again under the new rule instead of being retrained.
The table is assembled from every finished unit with the same sizes and written to
benchmarks/results/learning_efficacy/<date>_<variant>.json (+ .md; VARIANT: env, primary, eval rule,
smoke, tag) with date, machine, load and seeds; units
from different code (git sha) are listed so a reader can judge whether they may be pooled.
benchmarks/learning/learning_summary.py turns the stored units of all three environments into tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.common import RESULTS, ROOT, machine_info, result_path  # noqa: E402

# the table's file name: results/learning_efficacy/<date>_<env>_<primary>_<eval rule>_<smoke>_<tag>.json, the keys
# that differ from the defaults only (the units stay under results/learning_efficacy/<env>-L<level>[-<tag>]/)
VARIANT = ("env", "primary", "eval", "smoke", "tag")
MLMT = ROOT / "configs" / "mlmt.yaml"

# configs/mlmt.yaml's solver credit before 2026-11-26: reward-to-go over the turns, the KL as a reward
REWARD_TO_GO = {"lower.turn_gamma": 1.0, "lower.kl_mode": "reward"}
# the verdict template's two sentences as a writer's strategy set, each sent as its sentence alone
VERDICT_SENTENCES = [
    {"name": "say_right", "instruction": "Tell the solver its answer is right.", "prefix": "Your answer is right."},
    {"name": "say_wrong", "instruction": "Tell the solver its answer is wrong.", "prefix": "Your answer is wrong."}]
VERDICT_SELECTOR = {"episode.strategies": VERDICT_SENTENCES,
                    "episode.prefix_only": [s["name"] for s in VERDICT_SENTENCES]}
SCORE = ROOT / "configs" / "score.yaml"
SINGLE_TURN_GRPO = ROOT / "configs" / "single-turn-grpo.yaml"
# name -> (preset, overrides). All share the compute budget set in main(). Units are found by the hash of
# the resolved configuration, not by name (identity), so a renamed method keeps its units.
METHODS = {
    "untrained": (MLMT, None),  # no training: eval of the base pair
    "score": (SCORE, {}),
    "single-turn-grpo": (SINGLE_TURN_GRPO, {}),
    "mlmt": (MLMT, {}),
    "mlmt-no-bonus": (MLMT, {"lower.bonus.coef": 0.0}),
    "writer-only": (MLMT, {"joint.freeze_solver": True}),
    "solver-only": (MLMT, {"joint.freeze_writer": True}),
    # the writer's collected text written greedily, as eval writes it: Q is then fitted on the outcomes of
    # the text it will be judged by (at T = 0.7, seed 0's check_arithmetic broke 3 of 34 right answers in
    # collect and 16 of 66 at greedy eval)
    "mlmt-greedy-writer-data": (MLMT, {"collect.writer_temperature": 0.0}),
    # the writer as a pure strategy selector: every strategy's feedback is its fixed sentence alone. In the
    # verdict env the trained writer trailed the template, whose one true sentence breaks nothing, while
    # confirm's sentence alone broke 3-6 % and the writer's text after the others more
    "mlmt-sentences-only": (ROOT / "configs" / "mlmt-selector.yaml", {}),
    # the same with the context bonus scored by the rollout engine (lower.bonus.scorer=engine, the faster
    # PPO iteration): bf16 engine and trainer log-probs differ by ~0.03 nats a token, so whether it learns
    # as the trainer-scored selector does is measured, paired seed by seed, not assumed
    "mlmt-sentences-only-engine-bonus": (ROOT / "configs" / "mlmt-selector.yaml", {"lower.bonus.scorer": "engine"}),
    # every writer update starting with upper.warmup_steps Q-only steps, as every unit before 2026-11-29 did:
    # on the fixed code mlmt ended lower in two seeds of three, and the warm-up is the one fix that changes
    # what the writer's text loss trains (the others fix seeds, the verifier's reading and grad_accum)
    "mlmt-writer-warmup-update": (MLMT, {"joint.writer_warmup": "update"}),
    # PPO's ratio, KL and bonus scored under softmax(logits / 0.7), the distribution the batches were drawn
    # from (lower.logprob_temperature=sampling, verl's and TRL's choice), against the raw temperature-1
    # log-probs every other unit scores: paired seed by seed with the preset and the selector
    "mlmt-sampling-logprobs": (MLMT, {"lower.logprob_temperature": "sampling"}),
    "mlmt-sentences-only-sampling-logprobs": (ROOT / "configs" / "mlmt-selector.yaml",
                                              {"lower.logprob_temperature": "sampling"}),
    # the selector choosing between the verdict template's own two sentences: in the verdict env the template
    # is then the best policy it can learn, so its gap to the template is what learning the choice costs (the
    # six-sentence selector trailed the template by 5.7 points over 5 seeds, all of it in Acc@t1)
    "mlmt-verdict-sentences": (ROOT / "configs" / "mlmt-selector.yaml", VERDICT_SELECTOR),
    # the same, with each decision rewarded by the rise in the solver's probability of the gold answer
    # (episode.gold_prob, upper.reward=gold_prob): the greedy refines' 0/1 outcomes hardly depended on the
    # sentence (it broke 0-9 % of right answers and fixed 0-14 % of wrong ones under either), so Q ranked
    # the two by noise; the probability still moves when the argmax does not
    "mlmt-verdict-sentences-gold-prob": (ROOT / "configs" / "mlmt-selector.yaml",
                                         {**VERDICT_SELECTOR, "episode.gold_prob": True, "upper.reward": "gold_prob"}),
    # the same with the writer's refines sampled at the PPO batches' temperature (collect.refine_temperature -1 =
    # solver_sampling's 0.7) instead of greedily: in seed 0 of the p_gold line the PPO batches' feedback told the
    # truth 60 % of the time (lower/strategy_share/*), wrong attempts hearing "wrong" 25-73 %, because the greedy
    # refine barely depends on the sentence, so Q ranks the two by noise. The sampled refine is what the solver
    # learns from; a decision rewarded by it is rewarded for what its sentence does there
    "mlmt-verdict-sentences-sampled-refines": (ROOT / "configs" / "mlmt-selector.yaml",
                                               {**VERDICT_SELECTOR, "collect.refine_temperature": -1.0}),
    # the same two sentences drawn at random (writer frozen: no collect, no writer update): the verdict template
    # trains its solver under true verdicts, this one under coin flips, so their Acc@t1 gap measures what the
    # truth of the feedback in the PPO batches does for the first answer
    "solver-only-verdict-sentences": (ROOT / "configs" / "mlmt-selector.yaml",
                                      {**VERDICT_SELECTOR, "joint.freeze_writer": True}),
    # turn 1 credited mostly by its own reward, a quarter by the refine's: in the honest confidence env
    # turn-own credit (turn_gamma 0) left nothing that asks a first answer to survive its refine
    # (c->i 3.0 % against i->c 2.8 %), while reward-to-go (1) broke the PPO batches' right attempts' credit
    "mlmt-turn-gamma-0.25": (MLMT, {"lower.turn_gamma": 0.25}),
    # --- the preset before turn-own credit (the units that led to it) ---
    # turn 1 credited by r1 + r_final: in the PPO batches (T = 0.7) the refine broke many right first
    # answers (18 of 23 in seed 0 of the greedy-writer-data line, 9 of 23 in seed 1), so a right attempt
    # that a refine broke scored like a wrong one a refine fixed
    "mlmt-reward-to-go": (MLMT, REWARD_TO_GO),
    "mlmt-reward-to-go-no-signal-table": (MLMT, {**REWARD_TO_GO, "upper.q_signal": False}),
    "mlmt-reward-to-go-greedy-writer-data": (MLMT, {**REWARD_TO_GO, "collect.writer_temperature": 0.0}),
    "solver-only-reward-to-go": (MLMT, {**REWARD_TO_GO, "joint.freeze_writer": True}),
    # turn-own credit with the KL still a reward: seed 0 collapsed (Acc@t1 0.063) because, in a group whose
    # task rewards tie, std normalisation blows the per-token KL penalties' tiny spread up to unit
    # advantages that favour short answers. The preset moved the KL into the loss (GRPO's form).
    "mlmt-turn-own-credit-kl-reward": (MLMT, {"lower.kl_mode": "reward"}),
    # the preset's configuration under the name it was measured by before it became the preset
    "mlmt-turn-own-credit-kl-loss": (MLMT, {"lower.turn_gamma": 0.0, "lower.kl_mode": "loss"}),
    # the refines masked out of the solver's loss (lower.train_refine: false): does training the refine
    # interfere with turn 1? Paired with mlmt, its Acc@t1 gap is what the refine's gradient does to turn 1
    "mlmt-masked-refine": (ROOT / "configs" / "mlmt-masked-refine.yaml", {}),
    # --- the baselines as first measured, before every method got one KL setting (beta 0.01 in the loss) ---
    # SCoRe with its KL as a per-token reward under grpo's std division: seed 0 collapsed (Acc@t1 0.053)
    "score-kl-reward": (SCORE, {"lower.kl_mode": "reward"}),
    # single-turn GRPO without a KL (beta 0), pinned to the values its units were measured with
    "single-turn-grpo-no-kl": (SINGLE_TURN_GRPO, {"lower.kl_coef": 0.0, "lower.kl_mode": "reward",
                                                  "lower.turn_gamma": 1.0}),
}
# the compute ladder (--ladder): single-turn GRPO at 2x, 4x and 8x the PPO iterations of a round (1x is
# single-turn-grpo), so the hierarchy is also compared with a single-turn solver given its wall time
LADDER = (2, 4, 8)


def ladder(lower_iterations: int) -> dict[str, tuple[Path, dict]]:
    """The ladder's methods at a grid's ``--lower-iterations``: each differs from single-turn-grpo in
    joint.lower_iterations alone."""
    return {f"single-turn-grpo-x{k}": (SINGLE_TURN_GRPO, {"joint.lower_iterations": k * lower_iterations})
            for k in LADDER}
# the control of the privileged environment: the verdict itself as feedback, solver trained like mlmt's. Its
# stored units ran code that opened the verdict with a uniformly drawn strategy sentence (strategy_prefix applied
# to fixed feedback until 2026-12-07); a new unit sends the verdict alone
VERDICT_CONTROL = {"verdict-template": (MLMT, {"episode.feedback": "verdict", "joint.freeze_writer": True}),
                   "verdict-template-reward-to-go": (MLMT, {**REWARD_TO_GO, "episode.feedback": "verdict",
                                                            "joint.freeze_writer": True})}
# the controls of the tool environment (issue 66): the check's hint after every attempt by a fixed rule (no
# writer model), and the selector that may send that hint or another sentence, chosen by its Q
TOOL_TEMPLATE = {"episode.feedback": "tool", "joint.freeze_writer": True}
# the template with refine groups (lower.refine_samples 4): each flagged attempt's hint refined 4 times and the
# refines compared with each other, so a fix is credited against the other refines of the same attempt (at one
# refine an attempt, the template fixed 2.5 % of flagged wrong attempts at 16 steps, seed 0). Minibatches of 4x
# the trajectories keep the optimizer steps and turn-1 samples equal; accumulation keeps the micro-batch at 8
TOOL_CONTROL = {"tool-template": (MLMT, TOOL_TEMPLATE),
                "tool-template-refine-groups": (MLMT, {**TOOL_TEMPLATE, "lower.refine_samples": 4,
                                                       "lower.minibatch_size": 32, "lower.grad_accum": 4}),
                # the same batches in minibatches of 8: the same turn-1 samples and token FLOPs, 4x the optimizer
                # steps (64). At 16 steps refine groups fixed no more flagged attempts than one refine did (seed 0,
                # 3 of 124), while the template at 64 steps on 4x the data fixed 16.9 %: steps or data?
                "tool-template-refine-groups-mb8": (MLMT, {**TOOL_TEMPLATE, "lower.refine_samples": 4}),
                # its control for the steps: one refine an attempt, minibatches of 2, so the same 64 optimizer steps
                # over the same 128 turn-1 samples (mb8 lifted turn 1 from 0.423 to 0.503: steps or refine groups?)
                "tool-template-mb2": (MLMT, {**TOOL_TEMPLATE, "lower.minibatch_size": 2}),
                "mlmt-tool-selector": (ROOT / "configs" / "mlmt-tool-selector.yaml", {}),
                # its writer-only ablation: the base solver, the selector's Q trained on that solver's refines.
                # The writer-only target asks it of the learned writer that ships; mlmt's writer-only (text)
                # is the first reading of it
                "mlmt-tool-selector-writer-only": (ROOT / "configs" / "mlmt-tool-selector.yaml",
                                                   {"joint.freeze_solver": True}),
                # the tool selector with the solver trained as tool-template-refine-groups-mb8 (4 refines an
                # attempt, 64 steps: the best honest solver of seed 0) and its writer's data collected with
                # sampled refines (collect.refine_temperature -1): in the selector's seed 0 no greedy collect
                # refine fixed a wrong attempt, so every strategy's return was the attempt's and Q had nothing
                # to rank; a sampled refine is what the solver learns from, and it fixes some
                "mlmt-tool-selector-refine-groups": (ROOT / "configs" / "mlmt-tool-selector.yaml",
                                                     {"lower.refine_samples": 4, "collect.refine_temperature": -1.0})}
# tool: the writer reads the task's own check of each attempt (honest:tool); q_signal gives Q its flag
ENV_OVERRIDES = {"none": {}, "confidence": {"episode.writer_sees": "confidence"},
                 "verdict": {"episode.writer_sees": "verdict"},
                 "tool": {"episode.writer_sees": "tool", "upper.q_signal": True}}
ENV_LABELS = {"verdict": "privileged (writer sees the verdict)",
              "tool": "honest:tool (writer sees the task's own check of the attempt)"}
# The settings every unit of the grids before the tool environment ran with, pinned there so stored units keep
# their hashes: vLLM's PyTorch norm (before engine.vllm.cpu_norm_kernel, on by default since), a 2 GiB KV cache
# and whole-batch scoring (before the 2026-12-06 memory defaults; bf16 scoring rounds by shape), the context
# bonus scored by the trainer (before lower.bonus.scorer=auto; a method that wants the engine says so). The
# tool grid started after them and runs the library's defaults.
LEGACY_COMMON = {"engine.vllm.cpu_norm_kernel": False, "engine.vllm.kv_cache_gb": 2}
LEGACY_TRAIN = {"lower.score_batch": 0, "lower.bonus.scorer": "trainer"}
# The tool grid's units are gathered over sessions on whichever 2-core CPU each gets, with native bf16 or without:
# fp32 throughout is one numerics path on every one of them, so its seeds pool wherever they ran ('auto' would file
# an AVX2 machine's units and an AMX machine's apart, identity()).
PORTABLE_COMMON = {"model.dtype": "float32"}
PORTABLE_TRAIN = {"lower.autocast": "none"}
# Inference-matched controls (issue 66), run on these methods' solvers in the tool environment: majority of
# CONTROL_K sampled answers and tool-gated resampling (analysis/controls.py), and the tool's hint at test time
# on a solver never trained under it. K = 3: a feedback method makes three generations a problem (attempt,
# feedback, refine); counting the writer's too gives the control the larger budget.
CONTROLLED = ("single-turn-grpo",)
CONTROL_K = 3


def run_method(name: str, preset: Path, extra: dict | None, common: dict, train: dict, evalsel: dict, seed: int,
               work: Path, sha: str, reuse: Path | None = None, evals: dict[str, dict] | None = None,
               controls: bool = False) -> dict:
    """Train (unless ``extra`` is None), evaluate on arith's test split, then on each of ``evals`` (name ->
    overrides of the eval config: out-of-distribution evals, OOD_EVALS), kept under the unit's "evals", and
    with ``controls`` the inference-matched controls on the trained solver (``control_eval``)."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.evaluate import adapters_from_run, eval_outcomes, evaluate
    from tosca_mlmt.pipelines.train_joint import train_joint
    from tosca_mlmt.runtime import git_sha

    # the code this unit runs: the tree as this child process imported it just now, read here rather than
    # once per invocation (a later unit of one invocation imports commits made while the earlier ones ran)
    sha = git_sha() or sha
    t0 = time.time()
    folder = work / name / f"seed{seed}"
    run = folder / "run"
    adapters, used, reused = {}, {}, None
    if extra is not None:
        old = reuse / name / f"seed{seed}" / "run" if reuse is not None else None
        if old is not None and (old / "manifest.json").exists():
            # a change of eval protocol only: the policies trained by an earlier invocation are evaluated again
            run, reused = old, str(old)
            manifest = json.loads((old / "manifest.json").read_text())
        else:
            cfg = load_config(preset, {**common, **train, **extra, "seed": seed})
            manifest = train_joint(cfg, run).manifest
        adapters = adapters_from_run(run)
        used = {"rounds": len(manifest["rounds"]),
                "writer_updates": sum(1 for r in manifest["rounds"] if r.get("upper")),
                "solver_updates": sum(1 for r in manifest["rounds"] if r.get("lower"))}
    train_s = time.time() - t0
    curve = train_curve(run / "metrics.jsonl") if extra is not None else {}
    # eval: test split, the same problems and eval seed for every method and training seed
    ecfg = load_config(preset, {**common, **(extra or {}), **adapters, **evalsel, "task.split": "test", "seed": 0})
    report = evaluate(ecfg, folder / "eval").report
    o = eval_outcomes(folder / "eval", texts=True)  # per problem, sorted by id: every method pairs up
    out = {"ids": o["ids"], "t1": np.array(o["t1"], dtype=float), "final": np.array(o["final"], dtype=float),
           "answers": answer_tails(o)}
    flags = tool_flags(folder / "eval")
    if flags is not None:
        out["flagged"] = flags
        # the refine sampled as the resample control samples (mlmt eval --refine sampled): tool-gated, the two
        # differ by the feedback alone, where the greedy refine also differs from the resample by its decoding
        evaluate(ecfg, folder / "eval-refine-sampled", refine="sampled")
        o = eval_outcomes(folder / "eval-refine-sampled")
        out["refine_sampled"] = {"ids": list(o["ids"]), "t1": [float(v) for v in o["t1"]],
                                 "final": [float(v) for v in o["final"]],
                                 "flagged": tool_flags(folder / "eval-refine-sampled")}
    if evals:
        out["evals"] = {}
    for ood, overrides in (evals or {}).items():
        evaluate(load_config(preset, {**common, **(extra or {}), **adapters, **evalsel, "task.split": "test",
                                      "seed": 0, **overrides}), folder / f"eval-{ood}")
        o = eval_outcomes(folder / f"eval-{ood}")
        out["evals"][ood] = {"ids": list(o["ids"]), "t1": [float(v) for v in o["t1"]],
                             "final": [float(v) for v in o["final"]]}
    if controls:
        out["controls"] = control_eval(load_config(preset, {**common, **(extra or {}), **adapters, **evalsel,
                                                            "task.split": "test", "seed": 0}), folder / "eval-controls")
    from tosca_mlmt.runtime import allocator_in_use

    return {"method": name, "seed": seed, "git_sha": sha, "train_seconds": None if reused else round(train_s, 1),
            "allocator": allocator_in_use(),
            "eval_seconds": round(time.time() - t0 - train_s, 1), "used": used, "reused_run": reused,
            "environment": report.get("environment"), "train_curve": curve, **out}


def tool_flags(eval_dir: Path) -> list[int] | None:
    """Per problem in id order, whether the task's check flagged the first attempt (the tool report stored on
    the eval's first feedback turn); None when an episode has none (no refine turn, or no tool)."""
    from tosca_mlmt.store import load_snapshot

    sid = json.loads((eval_dir / "eval.json").read_text())["snapshot_id"]
    flags = []
    for e in sorted(load_snapshot(eval_dir / "snapshots", sid).episodes(), key=lambda e: e.problem.id):
        report = next((t.info.get("tool_report") for t in e.turns if t.kind == "feedback"), None)
        if report is None:
            return None
        flags.append(int(bool(report["flagged"])))
    return flags


def control_eval(cfg, folder: Path) -> dict:
    """The controls on ``cfg``'s solver, over the test problems in id order (as t1/final): majority of
    CONTROL_K sampled answers, tool-gated resampling with one resample, and the eval's own episode with the
    tool's hint as feedback (episode.feedback: tool) on a solver that may never have been trained under it."""
    from dataclasses import replace

    from tosca_mlmt.pipelines.evaluate import eval_outcomes, evaluate

    cfg = replace(cfg, episode=replace(cfg.episode, rounds=1, feedback="tool"))
    report = evaluate(cfg, folder, majority=CONTROL_K, resample="tool").report
    rows = sorted(json.loads((folder / "controls.json").read_text())["rows"], key=lambda r: r["id"])
    o = eval_outcomes(folder)
    if [r["id"] for r in rows] != list(o["ids"]):
        raise RuntimeError(f"{folder}: the controls' problems differ from the eval's")
    return {"ids": list(o["ids"]), "k": CONTROL_K, "majority": [int(r["majority_correct"]) for r in rows],
            "resample": [int(r["resample_correct"]) for r in rows], "tool_hint": [int(v) for v in o["final"]],
            **{k: report[k] for k in ("resample_flagged", "resample_used", "resample_fixed", "resample_broke")}}


# what the arith/math verifiers read of an answer (tasks/mathverify.extract_answer): the last \boxed{}, the
# last "The answer is" line, "#### x", else the last number; a kept answer starts this many characters
# before the earliest of those, so a sign or currency before the number stays too
ANSWER_MARGIN = 80
_DIGIT_RE = re.compile(r"\d")


def answer_tail(text: str) -> str:
    """The end of an answer from where the verifier can start reading it (ANSWER_MARGIN before)."""
    low = text.lower()
    marks = [low.rfind("the answer is"), text.rfind("\\boxed"), text.rfind("####")]
    digits = [m.start() for m in _DIGIT_RE.finditer(text)]
    marks = [m for m in marks + digits[-1:] if m >= 0]
    return text[max(0, min(marks) - ANSWER_MARGIN):] if marks else text[-ANSWER_MARGIN:]


def answer_tails(outcomes: dict) -> dict[str, list[str]]:
    """answer_tail of every eval turn-1 and final answer of ``outcomes`` (eval_outcomes with texts), in
    its problem order: a later verifier can score a unit again without retraining it (probes/rescore.py
    LABEL=UNIT.json), where the eval's snapshot stays behind in the work folder."""
    return {k: [answer_tail(t) for t in outcomes[f"{k}_text"]] for k in ("t1", "final")}


def method_config(preset, overrides: dict):
    """A method's resolved configuration, read to name or describe it: the baselines kept as first measured
    (score-kl-reward, ...) are configurations the load warns about, and reading them is not running them."""
    import warnings

    from tosca_mlmt.config import load_config
    from tosca_mlmt.config.section import ConfigWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(preset, overrides)


def identity(preset: Path, extra: dict | None, common: dict, train: dict,
             bf16: bool | None = None) -> tuple[str, bool]:
    """(config hash, writer has Q) from one resolution of the method's configuration.

    The hash covers what the method trains with (preset, its includes, the overrides, every default),
    seed left out. A unit counts for a method only under it: a preset that changes makes the old units
    stale instead of silently pooling them, and two names for one configuration share units.
    Without Q-values (nothing trained, or a frozen writer) every selection rule is uniform, so the
    eval-selection sizes do not define the method's units (a greedy-eval table reuses them)."""
    import dataclasses
    import hashlib

    from tosca_mlmt.precision import model_dtype, native_bf16

    resolved = method_config(preset, {**common, **train, **(extra or {}), "seed": 0})
    has_q = extra is not None and not resolved.joint.freeze_writer
    cfg = dataclasses.asdict(resolved)
    cfg.pop("seed")
    # engine.vllm.stop_in_engine ends a turn at its answer line inside vLLM instead of cutting it
    # afterwards: the same kept tokens, less decoding. It defines speed, not the method, so units from
    # before the knob existed (post-hoc cut) count for the same configuration.
    cfg["engine"]["vllm"].pop("stop_in_engine")
    # engine.vllm.direct_sync serves, bit for bit, the weights vLLM's reload serves
    # (tests/unit/rollout/engines/vllm/test_vllm_engine.py): it too defines speed, so units from before it count
    # either way
    cfg["engine"]["vllm"].pop("direct_sync")
    # engine.vllm.rpc_transport and rpc_bucket_mb: how the same tensors cross into a multiprocess engine
    # (tests/unit/rollout/engines/vllm/test_vllm_multiprocess.py: the trainer's log-probs either way); speed and
    # memory, not the method
    cfg["engine"]["vllm"].pop("rpc_transport")
    cfg["engine"]["vllm"].pop("rpc_bucket_mb")
    # engine.allocator picks the process's malloc: the demo trained to bit-identical weights on glibc, jemalloc
    # and tcmalloc (memory-allocator*.json), so it defines time and memory, and units count under any
    cfg["engine"].pop("allocator")
    # lower.bonus.scorer=trainer is how every unit before the knob was scored; engine scoring is
    # another numerics path (bf16: ~0.03 nats per token), so it defines units of its own
    if cfg["lower"]["bonus"]["scorer"] == "trainer":
        cfg["lower"]["bonus"].pop("scorer")
    # engine.vllm.cpu_norm_kernel=false is vLLM's own PyTorch norm, which every unit before the knob ran;
    # the C++ kernel rounds once instead of twice (bf16), another numerics path, so it defines units of its own
    if not cfg["engine"]["vllm"]["cpu_norm_kernel"]:
        cfg["engine"]["vllm"].pop("cpu_norm_kernel")
    # engine.vllm.writer_share only splits memory between two bases' engines (rollout/engines/vllm/pair.py): with one base
    # it is unread, so units from before the knob count
    if not cfg["model"]["writer"]:
        cfg["engine"]["vllm"].pop("writer_share")
    # engine.vllm.continuous_episodes=false is the batched turns every unit before the knob ran; continuous
    # episodes put other requests in a decode step (bf16: other samples), so they define units of their own
    if not cfg["engine"]["vllm"]["continuous_episodes"]:
        cfg["engine"]["vllm"].pop("continuous_episodes")
    # joint.writer_warmup=run is the code's schedule since 2026-11-29 (units before then restarted the warm-up
    # every update, which is what =update now asks for by name; the grids keep them apart by tag)
    if cfg["joint"]["writer_warmup"] == "run":
        cfg["joint"].pop("writer_warmup")
    # lower.logprob_temperature=raw is how every unit before the knob scored its tokens; sampling is another
    # objective, so it defines units of its own
    if cfg["lower"]["logprob_temperature"] == "raw":
        cfg["lower"].pop("logprob_temperature")
    # lower.train_refine on trains the refines, as every unit before the knob did
    if cfg["lower"]["train_refine"]:
        cfg["lower"].pop("train_refine")
    # lower.refine_samples 1 is one refine an attempt, as every unit before the knob played
    if cfg["lower"]["refine_samples"] == 1:
        cfg["lower"].pop("refine_samples")
    # lower.mask_truncated off trains on every turn, as every unit before the knob did
    if not cfg["lower"]["mask_truncated"]:
        cfg["lower"].pop("mask_truncated")
    # episode.gold_prob off scores nothing and samples the same: units from before the knob count
    if not cfg["episode"]["gold_prob"]:
        cfg["episode"].pop("gold_prob")
    if not cfg["episode"]["reasoning_tags"]:  # no thinking block: turns cut and read as before the knob
        cfg["episode"].pop("reasoning_tags")
    if cfg["episode"]["writer_reads_thinking"]:  # the whole attempt, as the writer read it before the knob
        cfg["episode"].pop("writer_reads_thinking")
    # the tokenizer's own template, with no variables, renders the prompts every unit before the knobs saw
    for knob in ("chat_template", "chat_template_kwargs"):
        if not cfg["model"][knob]:
            cfg["model"].pop(knob)
    # 'auto' precision resolves per machine. Every stored unit ran where bf16 is native (bf16 weights and
    # autocast), where 'auto' hashes as it always did; on a CPU without avx512_bf16/amx_bf16 it resolves to
    # fp32, another numerics path, so that machine's units are units of their own instead of pooling silently
    if not (native_bf16() if bf16 is None else bf16):
        if cfg["model"]["dtype"] == "auto":
            cfg["model"]["dtype"] = f"auto={model_dtype('auto')}"
        if cfg["lower"]["autocast"] == "auto":
            cfg["lower"]["autocast"] = "auto=none"
    if extra is None:  # nothing trains: what only training reads does not define the unit
        for section in ("lower", "upper", "joint"):
            cfg.pop(section)
    text = json.dumps({"trained": extra is not None, "config": cfg}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], has_q


# what the PPO batches saw, per iteration: the first attempts' accuracy at the sampling temperature
# and what the refines did to them (the mechanism behind Acc@t1 and c->i, kept with the unit)
CURVE_KEYS = ("lower/reward_turn0", "lower/reward_turn1", "lower/right_to_wrong", "lower/wrong_to_right",
              "lower/episodes")


def train_curve(metrics: Path) -> dict[str, list[float]]:
    curve: dict[str, list[float]] = {k: [] for k in CURVE_KEYS}
    if not metrics.exists():
        return {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "lower/episodes" in row:
            for k in CURVE_KEYS:
                curve[k].append(row.get(k))
            # whether the writer's choice in the PPO batches followed the attempt's correctness (a strategy
            # no batch chose is absent from a row: None keeps every list one entry per iteration)
            n = len(curve["lower/episodes"])
            for k in {k for k in [*row, *curve] if k.startswith("lower/strategy_share/")}:
                curve.setdefault(k, [None] * (n - 1)).append(row.get(k))
    return curve


def paired_finals(per: dict[str, list[dict]], a: str, b: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(the seeds both methods have, a's and b's per-problem Acc@final [seeds, problems] on them)."""
    mine, theirs = {r["seed"]: r for r in per.get(a, [])}, {r["seed"]: r for r in per.get(b, [])}
    common = sorted(set(mine) & set(theirs))
    if not common:
        return [], np.empty((0, 0)), np.empty((0, 0))
    return common, np.stack([mine[k]["final"] for k in common]), np.stack([theirs[k]["final"] for k in common])


def problem_ids(runs: list[dict], method: str) -> list | None:
    """The test problems' ids that ``method``'s units were evaluated on (None when a unit keeps none); a
    ValueError when its seeds disagree, as the per-problem pairing needs one order of problems."""
    ids = [r.get("ids") for r in runs]
    if not ids or any(i is None for i in ids):
        return None
    if any(list(i) != list(ids[0]) for i in ids):
        raise ValueError(f"{method}: units of seeds {[r['seed'] for r in runs]} were evaluated on different problems")
    return list(ids[0])


def table(per: dict[str, list[dict]], primary: str) -> tuple[dict, list[str]]:
    from tosca_mlmt.analysis.stats import mcnemar, paired_bootstrap
    from tosca_mlmt.tasks.arith import facts_of

    summary, lines = {}, []
    lines.append("| method | seeds x problems | Acc@t1 | Acc@final | Δ | i→c | c→i |")
    lines.append("|---|---|---|---|---|---|---|")
    for name, runs in per.items():
        t1 = np.stack([r["t1"] for r in runs])
        fin = np.stack([r["final"] for r in runs])
        cells = {"acc_t1": paired_bootstrap(t1), "acc_final": paired_bootstrap(fin),
                 "delta": paired_bootstrap(fin, t1),
                 "wrong_to_right": paired_bootstrap((1 - t1) * fin), "right_to_wrong": paired_bootstrap(t1 * (1 - fin))}
        summary[name] = cells
        fmt = lambda c: f"{c['mean']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]"  # noqa: E731
        lines.append(f"| {name} | {t1.shape[0]} x {t1.shape[1]} | " + " | ".join(fmt(cells[k]) for k in
                     ("acc_t1", "acc_final", "delta", "wrong_to_right", "right_to_wrong")) + " |")
    if primary in per:
        lines += ["", f"Contrast: {primary} minus each baseline on Acc@final (paired over the seeds both have x "
                      "problems; McNemar p per seed; the interval over facts resamples arith's facts, not its "
                      "problems).", "", "| baseline | seeds | difference [95 % CI] | 95 % CI over facts | "
                      "McNemar p per seed |", "|---|---|---|---|---|"]
        ids = problem_ids(per[primary], primary)
        facts = None if ids is None else np.array(facts_of(ids))  # once: facts_of reads the test files
        for name in per:
            if name == primary:
                continue
            common, a, b = paired_finals(per, primary, name)
            if not common:
                continue
            d = paired_bootstrap(a, b)
            theirs = problem_ids([r for r in per[name] if r["seed"] in common], name)
            if ids is not None and theirs is not None and theirs != ids:
                raise ValueError(f"{name} was evaluated on other problems than {primary}: their Acc@final "
                                 "cannot be paired problem by problem")
            f = paired_bootstrap(a, b, groups=facts) if facts is not None and theirs is not None else None
            ps = [mcnemar(a[i], b[i])["p"] for i in range(len(common))]
            summary[f"{primary}-minus-{name}"] = {**d, "mcnemar_p": ps, "seeds": common, "by_fact": f}
            by_fact = f"[{f['lo']:+.3f}, {f['hi']:+.3f}] ({f['clusters']} facts)" if f else "—"
            lines.append(f"| {name} | {', '.join(map(str, common))} | {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] | "
                         f"{by_fact} | " + ", ".join(f"{p:.3g}" for p in ps) + " |")
    return summary, lines


def batch_lines(per: dict[str, list[dict]]) -> list[str]:
    """What each trained method's PPO batches saw (units that recorded a train_curve)."""
    lines = ["", "PPO batches (sampled, not the eval): first-attempt accuracy over the first and the second "
                 "half of the iterations, and right first attempts the refine turned wrong.", "",
             "| method | seeds | turn-1 reward, first half → second half | right first attempts broken |",
             "|---|---|---|---|"]
    rows = 0
    for name, runs in per.items():
        # a frozen solver (writer-only) ran no PPO iteration: its curve has no points
        curves = [r["train_curve"] for r in runs if (r.get("train_curve") or {}).get("lower/episodes")]
        if not curves:
            continue
        early, late, broken, right = [], [], 0, 0
        for c in curves:
            t0, n = c["lower/reward_turn0"], c["lower/episodes"]
            half = len(t0) // 2
            early += t0[:half]
            late += t0[half:]
            right += sum(round(a * k) for a, k in zip(t0, n))
            broken += sum(round((b or 0.0) * k) for b, k in zip(c["lower/right_to_wrong"], n))
        rows += 1
        lines.append(f"| {name} | {len(curves)} | {np.mean(early):.3f} → {np.mean(late):.3f} | "
                     + (f"{broken} of {right}" if any(c["lower/reward_turn1"][0] is not None for c in curves)
                        else "(no refine)") + " |")
    return lines if rows else []


def _unit_key(args) -> dict:
    """The sizes that make two units comparable (the same problems, compute and protocol)."""
    return {k: getattr(args, k) for k in ("env", "level", "test_problems", "rounds", "collect_problems",
                                          "lower_iterations", "problems_per_iteration", "upper_steps", "engine",
                                          "n_samples", "eval_strategy_temperature", "smoke")}


EVAL_SELECTION = ("eval_strategy_temperature",)


def _same_unit(stored: dict | None, key: dict, has_q: bool) -> bool:
    if not stored:
        return False
    if has_q:
        return stored == key
    drop = lambda k: {a: b for a, b in k.items() if a not in EVAL_SELECTION}  # noqa: E731
    return drop(stored) == drop(key)


def run_overrides(args) -> tuple[dict, dict]:
    """(overrides of every run and eval, overrides of training only) from the sizes."""
    legacy = args.env != "tool"  # LEGACY_COMMON / LEGACY_TRAIN: the settings the earlier grids' units ran
    common = {"task.name": "arith", "task.level": args.level, "task.limit": args.test_problems,
              "logging.wandb": False, "logging.progress": False, "engine.name": args.engine,
              "episode.max_prompt_tokens": 768, "engine.vllm.max_model_len": 1024,
              **(LEGACY_COMMON if legacy else PORTABLE_COMMON), **ENV_OVERRIDES[args.env]}
    # equal compute for every trained method (a frozen part simply spends none of it)
    train = {"task.split": "train", "task.limit": 0, "joint.rounds": args.rounds, "episode.n_samples": args.n_samples,
             "joint.collect_problems": args.collect_problems, "joint.lower_iterations": args.lower_iterations,
             "lower.problems_per_iteration": args.problems_per_iteration, "joint.upper_steps": args.upper_steps,
             # warm-up below the writer's steps, so some train its text (at the grid's 30 steps: 5, as before)
             "upper.warmup_steps": min(5, max(0, args.upper_steps - 1)), "upper.eval_every": max(1, args.upper_steps),
             "upper.save_every": max(1, args.upper_steps), **(LEGACY_TRAIN if legacy else PORTABLE_TRAIN)}
    return common, train


# the out-of-distribution evals every unit also runs (--ood-evals), beside arith's test split: the same test
# facts in phrasings training never uses (does what was learned transfer past the templates?), and grade-school
# word problems (gsm8k's test split, from ../shared/data or $TOSCA_MLMT_DATA). Their results sit under the unit's
# "evals" and do not define it (a unit without them still counts).
OOD_EVALS = {"test-unseen": {"task.split": "test-unseen"}, "gsm8k": {"task.name": "gsm8k", "task.split": "test"}}


def ood_overrides(args) -> dict[str, dict]:
    """name -> eval-config overrides of the OOD evals ``args`` asks for (--ood-evals, --ood-problems)."""
    limit = {"task.limit": args.ood_problems} if args.ood_problems else {}
    return {name: {**OOD_EVALS[name], **(limit if name != "test-unseen" else {})} for name in args.ood_evals}


def ood_lines(per: dict[str, list[dict]]) -> list[str]:
    """Every method's Acc@t1 / Acc@final on each OOD eval its units ran (pooled over seeds; test-unseen's
    interval resamples facts, as the summary's do)."""
    from tosca_mlmt.analysis.stats import paired_bootstrap
    from tosca_mlmt.tasks.arith import facts_of

    lines = []
    for name, runs in per.items():
        for ood in sorted({k for r in runs for k in r.get("evals") or {}}):
            got = [r["evals"][ood] for r in runs if ood in (r.get("evals") or {})]
            if any(g["ids"] != got[0]["ids"] for g in got):
                continue  # seeds on different problems (another --ood-problems) do not pool
            fin, t1 = np.array([g["final"] for g in got]), np.array([g["t1"] for g in got])
            groups = np.array(facts_of(got[0]["ids"])) if ood == "test-unseen" else None
            d = paired_bootstrap(fin, groups=groups)
            lines.append(f"| {name} | {ood} | {len(got)} x {fin.shape[1]} | {t1.mean():.3f} | "
                         f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}] |")
    head = ["", "Out-of-distribution evals (test-unseen: interval over facts).", "",
            "| method | eval | seeds x problems | Acc@t1 | Acc@final [95 % CI] |", "|---|---|---|---|---|"]
    return head + lines if lines else []


CONTROL_NAMES = {"majority": f"majority of {CONTROL_K}", "resample": "tool-gated resample",
                 "tool_hint": "tool hint at test only"}


def control_lines(per: dict[str, list[dict]], primary: str) -> list[str]:
    """Each controlled method's inference-matched controls (pooled over seeds, interval over problems) and
    ``primary``'s Acc@final minus each, paired seed by seed (and resampling arith's facts)."""
    from tosca_mlmt.analysis.stats import paired_bootstrap
    from tosca_mlmt.tasks.arith import facts_of

    lines, mine = [], {r["seed"]: r for r in per.get(primary, [])}
    for name, runs in per.items():
        got = [r for r in runs if r.get("controls")]
        if not got or any(r["controls"]["ids"] != got[0]["controls"]["ids"] for r in got):
            continue
        facts = np.array(facts_of(got[0]["controls"]["ids"]))
        for key, label in CONTROL_NAMES.items():
            acc = paired_bootstrap(np.array([r["controls"][key] for r in got]))
            common = [r for r in got if r["seed"] in mine and list(mine[r["seed"]]["ids"]) == r["controls"]["ids"]]
            diff = "—"
            if common:
                a = np.stack([mine[r["seed"]]["final"] for r in common])
                d = paired_bootstrap(a, np.array([r["controls"][key] for r in common]), groups=facts)
                diff = f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] ({len(common)} seeds)"
            lines.append(f"| {name} | {label} | {len(got)} x {len(got[0]['controls']['ids'])} | "
                         f"{acc['mean']:.3f} [{acc['lo']:.3f}, {acc['hi']:.3f}] | {diff} |")
    head = ["", f"Inference-matched controls on the solver (sampled at its temperature, no writer): majority of "
                f"{CONTROL_K} answers; tool-gated resample (the check flags turn 1 -> one sampled answer replaces "
                "it); the tool's hint as feedback at test only. Last column: " + primary + "'s Acc@final minus the "
                "control, interval over facts.", "",
            "| solver | control | seeds x problems | Acc [95 % CI] | " + primary + " minus it |",
            "|---|---|---|---|---|"]
    return head + lines if lines else []


def in_child(fn, *args):
    """``fn(*args)`` in a spawned child process of its own. A child killed by a signal (the OOM killer)
    raises BrokenProcessPool here: multiprocessing.Pool replaced such a worker and waited for its lost
    task forever (2026-12-01: a unit killed beside a test suite hung its invocation)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def run_unit(*args) -> dict:
    """run_method in a child process of its own: an in-process vLLM engine and the trained pair are not
    all given back when a unit ends, and one process running unit after unit grew to 20 GB of RSS after
    eight units (the OOM killer ended it). A child returns everything to the OS, and a crash costs one unit."""
    return in_child(run_method, *args)


class Units:
    """The stored units of one environment and protocol (``args``: the sizes), found by the hash of each
    method's resolved configuration, whichever name ran them."""

    def __init__(self, args):
        self.every = dict(METHODS, **(VERDICT_CONTROL if args.env == "verdict" else {}),
                          **(TOOL_CONTROL if args.env == "tool" else {}),
                          **(ladder(args.lower_iterations) if getattr(args, "ladder", False) else {}))
        common, train = run_overrides(args)
        bf16 = {"auto": None, "yes": True, "no": False}[getattr(args, "native_bf16", "auto")]
        ids = {name: identity(preset, extra, common, train, bf16) for name, (preset, extra) in self.every.items()}
        self.hashes = {name: h for name, (h, _) in ids.items()}
        self.has_q = {name: q for name, (_, q) in ids.items()}
        self.key = _unit_key(args)
        self.folder = RESULTS / "learning_efficacy" / (f"{args.env}-L{args.level}" + ("-smoke" if args.smoke else "")
                                                      + (f"-{args.tag}" if getattr(args, "tag", "") else ""))
        self.stored = [json.loads(f.read_text()) for f in sorted(self.folder.glob("*.json"))]

    def finished(self, name: str, seed: int) -> dict | None:
        """A unit of this configuration and seed under this protocol, whichever method name ran it."""
        for u in self.stored:
            if (u["seed"] == seed and u.get("config") == self.hashes[name]
                    and _same_unit(u.get("key"), self.key, self.has_q[name])):
                return u
        return None

    def per_method(self) -> tuple[dict[str, list[dict]], set[str], dict[str, str]]:
        """(method -> its units with t1/final as arrays, the code shas they ran, name -> the earlier name
        of the same configuration). The untrained pair has no training seed: its one eval stands for
        every seed the trained methods have, so it pairs with each."""
        per: dict[str, list[dict]] = {}
        shas: set[str] = set()
        same_as: dict[str, str] = {}
        shown: dict[str, str] = {}
        for name in self.every:
            if self.hashes[name] in shown:
                same_as[name] = shown[self.hashes[name]]
                continue
            shown[self.hashes[name]] = name
            for seed in sorted({u["seed"] for u in self.stored}):
                u = self.finished(name, seed)
                if u is not None:
                    shas.add(u["git_sha"])
                    per.setdefault(name, []).append({**u, "t1": np.array(u["t1"]), "final": np.array(u["final"])})
        seeds = sorted({r["seed"] for name, runs in per.items() if name != "untrained" for r in runs})
        if "untrained" in per and seeds:
            per["untrained"] = [{**per["untrained"][0], "seed": k} for k in seeds]
        return per, shas, same_as


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="none", choices=tuple(ENV_OVERRIDES))
    ap.add_argument("--methods", nargs="+", default=None, help="subset of the methods (default: all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--level", type=int, default=2, help="arith level (1 has too few distinct test facts)")
    ap.add_argument("--test-problems", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--collect-problems", type=int, default=32)
    ap.add_argument("--lower-iterations", type=int, default=2)
    ap.add_argument("--problems-per-iteration", type=int, default=4)
    ap.add_argument("--upper-steps", type=int, default=30)
    ap.add_argument("--n-samples", type=int, default=4, help="turn-1 samples per problem (the GRPO group)")
    ap.add_argument("--eval-strategy-temperature", type=float, default=0.1,
                    help="softmax temperature over the writer's Q at eval, no epsilon (the same rule for every "
                         "method; a writer without Q-values picks uniformly); 0 = greedy (argmax Q, the policy "
                         "offline Q-learning defines). Collection keeps the config's exploration: softmax(Q / 1) "
                         "over Q-values that differ by a fraction of a reward would hide what the writer learned")
    ap.add_argument("--reuse-runs", type=Path, default=None,
                    help="an earlier invocation's work folder (<work>/<env>-<time>): a (method, seed) trained there "
                         "is evaluated again instead of retrained (for a change of eval protocol only; the unit "
                         "records the folder)")
    ap.add_argument("--engine", default="vllm", choices=("hf", "vllm"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the wiring, decides nothing")
    ap.add_argument("--tag", default="", help="a grid of its own: units under <env>-L<level>-<tag>/ and tables "
                                              "named with it, e.g. the same protocol on other code, kept apart "
                                              "from the units the README's tables pool")
    ap.add_argument("--native-bf16", default="auto", choices=("auto", "yes", "no"),
                    help="where model.dtype and lower.autocast 'auto' resolve to bf16, which defines the units: "
                         "auto = as on this machine; yes reads (--table-only) grids measured on a CPU with native "
                         "bf16, as every stored grid was, from a machine without it")
    ap.add_argument("--ladder", action="store_true",
                    help="add the compute ladder: single-turn GRPO at " + ", ".join(f"{k}x" for k in LADDER)
                         + " the PPO iterations (methods single-turn-grpo-x<k>; 1x is single-turn-grpo), to compare "
                           "the hierarchy at equal wall time; run and tabled only with this option")
    ap.add_argument("--ood-evals", nargs="*", default=list(OOD_EVALS), choices=tuple(OOD_EVALS),
                    help="out-of-distribution evals each new unit also runs after arith's test split (none: "
                         "--ood-evals with no name); they do not define the unit")
    ap.add_argument("--ood-problems", type=int, default=300,
                    help="problems of each OOD eval other than test-unseen (which pairs with --test-problems)")
    ap.add_argument("--force", action="store_true", help="redo units that already have results")
    ap.add_argument("--budget-minutes", type=float, default=0.0, help="start no unit after this (0 = none)")
    ap.add_argument("--table-only", action="store_true",
                    help="start no unit: assemble the table from the units already measured")
    ap.add_argument("--primary", default="mlmt", help="the method every other is contrasted with (the "
                                                        "pre-registered one is mlmt; another writes its own file)")
    ap.add_argument("--work", default="/tmp/tosca-bench-efficacy")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    # the malloc mlmt itself runs on (engine.allocator auto: tcmalloc where installed), for this process and the
    # units it spawns (they inherit LD_PRELOAD): on glibc's a two-turn unit peaked at 10-14 GiB and one was
    # killed beside the test suite (2026-12-07). It defines time and memory, not the unit (identity()).
    from tosca_mlmt.runtime import use_allocator

    use_allocator("auto")
    if args.smoke:
        args.seeds, args.test_problems, args.rounds, args.ood_problems = args.seeds[:1], 8, 1, 8
        args.collect_problems, args.lower_iterations, args.problems_per_iteration, args.upper_steps = 2, 1, 2, 2

    from tosca_mlmt.precision import native_bf16

    if not args.table_only and args.native_bf16 != "auto" and (args.native_bf16 == "yes") != native_bf16():
        ap.error(f"--native-bf16 {args.native_bf16}: this machine resolves 'auto' the other way, so the units it "
                 "trains would be filed under the other precision; it only reads grids, with --table-only")

    # the CPU's model and bf16 flags pick the kernels, so two machines' samples differ (and with 'auto'
    # precision, the dtype): every unit says where it ran
    machine = machine_info()
    cpu = {k: machine[k] for k in ("cpu_model", "cpu_flags")}
    # --methods picks the units to run; the table always holds every method with finished units, so a
    # run of one ablation does not rewrite the environment's table with that ablation alone
    units = Units(args)
    every = units.every
    methods = every
    if args.methods:
        unknown = set(args.methods) - set(every)
        if unknown:
            ap.error(f"unknown method(s) {sorted(unknown)}; allowed: {', '.join(every)}")
        methods = {k: every[k] for k in args.methods}  # in the order given: the first ones run first
    common, train = run_overrides(args)
    if args.eval_strategy_temperature < 0:
        ap.error("--eval-strategy-temperature must be >= 0 (0 = greedy)")
    evalsel = ({"episode.strategy_selection": "epsilon_greedy", "episode.epsilon": 0.0}
               if args.eval_strategy_temperature == 0 else
               {"episode.strategy_selection": "epsilon_softmax", "episode.epsilon": 0.0,
                "episode.strategy_temperature": args.eval_strategy_temperature})
    # units of a writer with Q under another eval rule sit beside the default ones, not over them
    default_rule = args.eval_strategy_temperature == ap.get_default("eval_strategy_temperature")
    eval_tag = "greedy-eval" if args.eval_strategy_temperature == 0 else f"eval-T{args.eval_strategy_temperature:g}"
    units.folder.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) / f"{args.env}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    from tosca_mlmt.runtime import git_sha

    # the code that runs: read before the first unit imports it (a commit may land while units run)
    sha = git_sha() or "unknown"
    t_start = time.time()
    hashes, has_q, key = units.hashes, units.has_q, units.key

    lost: list[str] = []  # units whose process was killed
    # seed-major: every method's seed 0 before any seed 1, so a budget cut leaves complete pairings
    for seed in args.seeds:
        for name, (preset, extra) in methods.items():
            if extra is None and seed != args.seeds[0]:
                continue
            if not args.force and units.finished(name, seed) is not None:
                continue
            path = units.folder / (f"{name}-seed{seed}-{hashes[name][:8]}"
                                   + (f"-{eval_tag}" if not default_rule and has_q[name] else "")
                                   + ".json")
            if args.table_only:
                print(f"table only: {name} seed {seed} has no unit", flush=True)
                continue
            if args.budget_minutes and time.time() - t_start > 60 * args.budget_minutes:
                print(f"budget spent: {name} seed {seed} not started", flush=True)
                continue
            try:
                r = run_unit(name, preset, extra, common, train, evalsel, seed, work, sha, args.reuse_runs,
                             ood_overrides(args), args.env == "tool" and name in CONTROLLED)
            except BrokenProcessPool:  # killed, not failed: the next units may fit
                lost.append(f"{name} seed {seed}")
                print(f"{name} seed {seed}: its process was killed (out of memory?); no unit written, a rerun "
                      "redoes it", flush=True)
                continue
            unit = {"key": key, "config": hashes[name], "date": dt.datetime.now().isoformat(timespec="seconds"),
                    "load_avg": os.getloadavg(), "cpu": cpu,
                    **{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()}}
            path.write_text(json.dumps(unit))
            units.stored.append(unit)
            print(f"{name} seed {seed}: Acc@t1 {r['t1'].mean():.3f} Acc@final {r['final'].mean():.3f} "
                  f"({r['train_seconds'] or 0:.0f} s train, {r['eval_seconds']:.0f} s eval)", flush=True)
    per, shas, same_as = units.per_method()
    if args.primary in same_as:
        ap.error(f"--primary {args.primary} has the configuration of {same_as[args.primary]}; name that one")
    seeds = sorted({r["seed"] for name, runs in per.items() if name != "untrained" for r in runs}) or args.seeds
    summary, lines = table(per, args.primary)
    lines += batch_lines(per) + ood_lines(per) + control_lines(per, args.primary)
    if same_as:
        lines += ["", "Same configuration, shown once: " + "; ".join(f"{a} = {b}" for a, b in same_as.items()) + "."]
    label = ENV_LABELS.get(args.env, "honest")
    head = [f"# Learning efficacy, env `{args.env}` ({label}), arith level {args.level}",
            # the machine that wrote the table: with --table-only not where the units ran (each unit's "cpu")
            f"{dt.datetime.now():%Y-%m-%d}, written on {cpu['cpu_model'] or platform.machine()} "
            f"({' '.join(cpu['cpu_flags'])}), {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
            f"seeds {seeds}, {args.test_problems} test problems, engine {args.engine}, code {sorted(shas)}"
            + (" — SMOKE RUN: decides nothing" if args.smoke else ""),
            f"Compute per trained method and seed: {args.rounds} rounds x ({args.collect_problems} writer problems + "
            f"{args.lower_iterations} PPO iterations x {args.problems_per_iteration} problems) x "
            f"{args.n_samples} samples, {args.upper_steps} writer steps per round. Eval: greedy decoding, strategies by "
            + ("argmax Q" if args.eval_strategy_temperature == 0 else f"softmax(Q / {args.eval_strategy_temperature})")
            + " (uniform without Q-values)." + (" Trained policies reused from earlier units' folders where recorded."
                                                 if args.reuse_runs else ""), ""]
    out = result_path("learning_efficacy", VARIANT, env=args.env, primary=None if args.primary == "mlmt" else args.primary,
                      eval=None if default_rule else eval_tag, smoke=args.smoke, tag=args.tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(head + lines) + "\n")
    out.write_text(json.dumps({
        "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine,
        "load_avg": os.getloadavg(), "args": vars(args), "environment": label, "summary": summary,
        "code": sorted(shas), "runs": [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()
                                        if k != "ids"} for runs in per.values() for r in runs]},
        indent=1, default=str))  # default=str: --reuse-runs and --work are Paths
    print("\n".join(head + lines))
    if lost:
        raise SystemExit(f"{len(lost)} unit(s) killed, not written: {', '.join(lost)}")


if __name__ == "__main__":
    main()
