"""``episode:`` section: one problem's turns, the writer's strategy set and how it picks one."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tosca_mlmt.config.knobs import Rule, knob
from tosca_mlmt.config.section import Section, need, show

# The behaviour policies `tosca_mlmt.strategies` implements. They are listed here, not there,
# because config/ may import only the ground floor; strategies.py takes its MODES from this
# tuple, so the names exist once.
SELECTION_MODES = ("auto", "uniform", "softmax", "epsilon_softmax", "epsilon_greedy", "greedy")

# What episode.writer_sees tells the writer about an attempt, as levels; a level's index is the
# state's writer signal o(s) (0 when it sees nothing), the row of the Q head's signal table
# (upper.q_signal), which has SIGNAL_BUCKETS rows whatever the channel.
WRITER_SIGNALS = {"none": ("",), "confidence": ("low", "medium", "high"), "verdict": ("incorrect", "correct"),
                  "tool": ("not_flagged", "flagged")}
SIGNAL_BUCKETS = max(len(v) for v in WRITER_SIGNALS.values())
# In a prefix_only strategy's prefix, replaced by the hint of the task's own check on the attempt
# ("Recheck 7 + 10.", tasks/steps.hint): a learned writer can then choose the tool template's sentence
# where it works and another where it does not (configs/mlmt-tool-selector.yaml).
TOOL_HINT = "{tool_hint}"

# instruction: what the writer is told to do; prefix: the fixed sentence that opens the feedback
# the solver reads when episode.strategy_prefix is on.
DEFAULT_STRATEGIES: tuple[dict[str, str], ...] = (
    {"name": "check_arithmetic", "instruction": "Point to the calculation that is most likely wrong and ask the solver to redo it carefully.",
     "prefix": "Check your calculation carefully."},
    {"name": "reread_question", "instruction": "Remind the solver what the question actually asks and which numbers it gives.",
     "prefix": "Read the question again and use its numbers."},
    {"name": "verify_substitution", "instruction": "Ask the solver to check its answer by plugging it back into the problem.",
     "prefix": "Check your answer against the problem."},
    {"name": "start_over", "instruction": "Tell the solver to discard its attempt and solve the problem again step by step.",
     "prefix": "Your answer is probably wrong: solve the problem again step by step."},
    {"name": "confirm", "instruction": "Say the attempt looks right and ask the solver to state the final answer clearly.",
     "prefix": "Your answer looks right: give it again."},
    {"name": "simplify", "instruction": "Suggest a simpler way to set up the computation, one step at a time.",
     "prefix": "Solve it one simple step at a time."},
)

CONFIDENCE_EDGES = Rule("two ascending finite numbers", lambda v: isinstance(v, list) and len(v) == 2 and all(
    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v) and v[0] < v[1])


REASONING_TAGS = Rule("[] or two different non-empty strings [open, close]",
                      lambda v: v == [] or (len(v) == 2 and all(isinstance(t, str) and t.strip() for t in v)
                                            and v[0] != v[1]))

@dataclass
class EpisodeConfig(Section):
    n_samples: int = knob(2, "Turn-1 samples per problem (the group for group-relative advantages).", min=1)
    rounds: int = knob(1, "K: feedback + refine rounds after turn 1 (0 = single-turn baseline).", min=0)
    strategies: list = knob(dataclasses.MISSING, "Strategy set: list of {name, instruction[, prefix]} (non-empty "
                                                 "strings, unique names). A prefix_only strategy's prefix may hold "
                                                 "{tool_hint}: the hint of the task's own check on the attempt "
                                                 "('Recheck 7 + 10.'; needs writer_sees=tool).",
                            default_factory=lambda: [dict(s) for s in DEFAULT_STRATEGIES])
    strategy_selection: str = knob("auto", "auto = uniform without Q-values, epsilon_softmax with them (epsilon of "
                                           "uniform exploration mixed into softmax(Q / T)).",
                                   choices=SELECTION_MODES)
    strategy_temperature: float = knob(1.0, "Softmax temperature over the writer's Q-values.",
                                       min=0.0, min_exclusive=True)
    epsilon: float = knob(0.3, "Uniform exploration share for auto / epsilon_softmax / epsilon_greedy (0.3 while the "
                               "writer's data is small).", min=0.0, max=1.0)
    min_q_decisions: int = knob(200, "The writer's Q-values steer strategy selection only once they were fitted on at "
                                     "least this many logged decisions; below it selection stays uniform (a Q fitted "
                                     "on a handful of decisions is noise). 0 = always use Q.", min=0)
    max_feedback_tokens: int = knob(64, "Longest feedback text, in tokens (for no feedback use episode.rounds=0; "
                                        "for a fixed text, episode.feedback=static).", min=1)
    feedback: str = knob("generate", "generate = the writer model writes feedback; static = the chosen strategy's "
                                     "instruction is the feedback verbatim (SCoRe's fixed self-correction prompt); "
                                     "verdict = 'Your answer is right/wrong.' from the verifier (a privileged control); "
                                     "tool = the task's own check's hint on the attempt ('Recheck 7 + 10.': a fixed "
                                     "rule, honest; the task needs check_attempt).",
                         choices=("generate", "static", "verdict", "tool"))
    writer_sees: str = knob("none", "Extra signal in the writer's state per attempt: none; confidence = the solver's "
                                    "mean token log-prob bucketed low/medium/high (honest); verdict = the verifier's "
                                    "right/wrong (privileged: labelled in every summary); tool = what the task's own "
                                    "check of the attempt found (arith/gsm8k/math500: the step checker; mbpp: its "
                                    "public test; honest, labelled honest:tool; the task needs check_attempt).",
                            choices=tuple(WRITER_SIGNALS))
    confidence_edges: list = knob(dataclasses.MISSING, "writer_sees=confidence: mean log-prob edges [low|medium, "
                                                       "medium|high], ascending.",
                                  default_factory=lambda: [-0.6, -0.25], rule=CONFIDENCE_EDGES)
    strategy_prefix: bool = knob(False, "Open the feedback the solver reads with the chosen strategy's fixed "
                                        "sentence (its 'prefix'), so the decision reaches the solver.")
    prefix_only: list = knob(dataclasses.MISSING, "Strategies (by name) whose feedback is their fixed sentence "
                                                  "('prefix') alone: the writer model writes nothing for them, the "
                                                  "decision is all they carry (feedback=generate only; static and "
                                                  "verdict feedback are fixed for every strategy). E.g. [confirm]: "
                                                  "what the writer adds after 'looks right' makes the solver re-derive "
                                                  "a right answer. [] = the writer writes for every strategy.",
                             default_factory=list)
    max_prompt_tokens: int = knob(1536, "Prompts longer than this are left-truncated (counted in metrics). A writer "
                                      "prompt is cut as far as its longest strategy text would need, before Q reads "
                                      "the state, so the state Q chose from is the one the recorded prompt holds.",
                                      min=1)
    counterfactual: bool = knob(False, "Also sample each refine with the feedback cut out of its context and score it "
                                       "(one more solver turn per round), for upper.reward=counterfactual.")
    gold_prob: bool = knob(False, "Also score every solver turn by the solver's teacher-forced probability of the gold "
                                  "answer where the turn put its own (after its reasoning, at its 'The answer is:' "
                                  "line; one batched prefill per batch; arith and gsm8k), logged as gold_prob, for "
                                  "upper.reward=gold_prob. Dense where 0/1 outcomes of greedy refines hardly move.")
    leak_penalty: float = knob(0.0, "Subtracted from the writer's reward for a decision whose feedback gives the gold "
                                    "answer away ('The answer is 15.'; see tosca_mlmt/leak.py); collect logs the "
                                    "share of such feedback as leak_rate. 0 = measure only.", min=0.0)
    stop_at_answer: bool = knob(True, "End each solver turn at its first complete 'The answer is: N' line (tasks with "
                                      "an answer line: arith, gsm8k); finish_reason 'answer'.")
    reasoning_tags: list = knob(dataclasses.MISSING, "A reasoning model's thinking block, as [open, close] (e.g. "
                                                     "['<think>', '</think>'] for Qwen3 thinking and the R1 distills), "
                                                     "for a model that thinks before every answer: the verifier reads "
                                                     "only what follows the close tag (nothing if the block never "
                                                     "closed) and stop_at_answer ends a turn only at an answer line "
                                                     "after it. [] = no thinking block.",
                                default_factory=list, rule=REASONING_TAGS)
    writer_reads_thinking: bool = knob(True, "With reasoning_tags: the writer reads each attempt whole, thinking "
                                       "included (where the calculations are), or, false, only what follows its last "
                                       "close tag, as the verifier does: shorter writer prompts for long thinking; an "
                                       "attempt whose thinking never closed reaches the writer empty.")

    def q_steers(self, decisions: int) -> bool:
        """Whether a Q head fitted on ``decisions`` logged decisions picks strategies (min_q_decisions);
        below it selection is uniform. Collect acts on it; train-upper's report says which holds."""
        return decisions >= self.min_q_decisions

    def check(self, prefix: str) -> None:
        need(not (self.reasoning_tags and self.gold_prob), f"{prefix}gold_prob",
             "cannot be combined with episode.reasoning_tags (the answer slot it scores may sit in the thinking)")
        need(self.writer_reads_thinking or bool(self.reasoning_tags), f"{prefix}writer_reads_thinking",
             "false needs episode.reasoning_tags: without a thinking block there is nothing to leave out")
        # A strategy's name is its action id in snapshots and the Q head, so names must be unique.
        need(len(self.strategies) >= 1, f"{prefix}strategies", "needs at least one strategy")
        names = set()
        for i, s in enumerate(self.strategies):
            at = f"{prefix}strategies[{i}]"
            need(isinstance(s, dict) and {"name", "instruction"} <= set(s) <= {"name", "instruction", "prefix"},
                 at, "each strategy needs the keys 'name' and 'instruction' (and may have 'prefix', the sentence "
                     "that opens its feedback)")
            for key in ("name", "instruction", "prefix"):
                need(key not in s or (isinstance(s[key], str) and bool(s[key].strip())), f"{at}.{key}",
                     "must be a non-empty string")
            need(s["name"] not in names, f"{at}.name", f"duplicate name {show(s['name'])}")
            names.add(s["name"])
        for i, name in enumerate(self.prefix_only):
            at = f"{prefix}prefix_only[{i}]"
            byname = {s["name"]: s for s in self.strategies if isinstance(s, dict)}
            need(isinstance(name, str), at, f"must be a strategy's name, not {show(name)}")
            need(name in byname, at, f"{show(name)} is not a strategy (have: {', '.join(byname)})")
            need("prefix" in byname[name], at, f"strategy {show(name)} has no 'prefix' to send alone")
        only = set(self.prefix_only)
        for i, s in enumerate(self.strategies):
            if TOOL_HINT not in str(s.get("prefix", "")):
                continue
            # the hint is rendered where the fixed feedback is written, from the check writer_sees runs
            need(s["name"] in only and self.feedback == "generate", f"{prefix}strategies[{i}].prefix",
                 f"{TOOL_HINT} is filled in only for a strategy in episode.prefix_only with feedback=generate")
            need(self.writer_sees == "tool", f"{prefix}strategies[{i}].prefix",
                 f"{TOOL_HINT} quotes the task's own check of the attempt: it needs episode.writer_sees=tool")
