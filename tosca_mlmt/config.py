"""The one typed config: dataclasses with help text, defaults and load-time validation.

Every knob a stage reads lives here. YAML files and CLI options are merged onto these
defaults through :func:`load_config`; an unknown key, a value of the wrong type or outside
its knob's range raises :class:`ConfigError` naming the dotted field and what is allowed,
before anything heavy (models, data) is touched.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tosca_mlmt.errors import ConfigError
from tosca_mlmt.joint.config import JointConfig
from tosca_mlmt.knobs import (EXISTING_DIR_OR_EMPTY, EXISTING_FILE_OR_EMPTY, ID_LIST, INT_MAX, NON_EMPTY, Rule, knob,
                              range_error, range_text)
from tosca_mlmt.lower.config import LowerConfig
from tosca_mlmt.upper.config import UpperConfig

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

# Below ~1e-3 sampling is greedy in all but name, and far below it logits / T overflow to inf
# (NaN probabilities in the hf sampler); 0 is the explicit greedy switch.
TEMPERATURE = Rule("0 (greedy) or >= 0.001", lambda v: v == 0 or v >= 1e-3)
TARGET_MODULES = Rule("a non-empty string or a non-empty list of non-empty strings",
                      lambda v: bool(v.strip()) if isinstance(v, str)
                      else bool(v) and all(isinstance(s, str) and s.strip() for s in v))
MAX_CONFIG_BYTES = 1 << 20
CONFIDENCE_EDGES = Rule("two ascending finite numbers", lambda v: isinstance(v, list) and len(v) == 2 and all(
    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v) and v[0] < v[1])


@dataclass
class LoraConfig:
    r: int = knob(16, "LoRA rank of each adapter (solver and writer).", min=1)
    alpha: int = knob(32, "LoRA alpha (scale = alpha / r).", min=1)
    dropout: float = knob(0.0, "LoRA dropout; 0 keeps rollouts and training logprobs identical.",
                          min=0.0, max=1.0, max_exclusive=True)
    target_modules: str | list = knob("all-linear", "peft target_modules: 'all-linear' adapts every linear layer; "
                                                    "another string is a regex over module names; a list names "
                                                    "modules (e.g. [q_proj, v_proj]).", rule=TARGET_MODULES)


@dataclass
class ModelConfig:
    solver: str = knob("smollm2-135m", "Solver (LL) base model: 'smollm2-135m' (embedded) or a local HF model folder.",
                       rule=NON_EMPTY)
    writer: str = knob("", "Feedback-writer (HL) base model; empty = same base as the solver (two adapters, one base).")
    solver_adapter: str = knob("", "Folder of a trained solver adapter to load (empty = fresh, identity adapter).",
                               rule=EXISTING_DIR_OR_EMPTY)
    writer_adapter: str = knob("", "Folder of a trained writer (adapter + Q head + strategies) to load.",
                               rule=EXISTING_DIR_OR_EMPTY)
    dtype: str = knob("auto", "Inference dtype: auto (bf16 if the CPU/GPU supports it), float32 or bfloat16.",
                      choices=("auto", "float32", "bfloat16"))
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = knob(0.5, "Share of GPU memory vLLM may take (GPU only; leaves room for training).",
                                         min=0.0, max=1.0, min_exclusive=True)
    max_model_len: int = knob(2048, "Longest prompt+response vLLM must hold (more than episode.max_prompt_tokens).",
                              min=2)
    enforce_eager: bool = knob(True, "Skip CUDA graphs / torch.compile (fast start; turn off for long GPU runs).")
    kv_cache_gb: int = knob(2, "CPU only: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE).", min=1)
    enable_prefix_caching: bool = knob(True, "Reuse KV of shared prefixes (turn-3 prompts extend turn-1 prompts).")


@dataclass
class EngineConfig:
    name: str = knob("hf", "Rollout engine.", choices=("hf", "vllm"))
    batch_size: int = knob(32, "Prompts per generate call (hf); vllm schedules the whole turn itself.", min=1)
    threads: int = knob(0, "torch CPU threads (0 = all cores).", min=0)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class SamplingConfig:
    temperature: float = knob(0.7, "Sampling temperature; 0 = greedy.", rule=TEMPERATURE)
    top_p: float = knob(1.0, "Nucleus sampling mass (1 = off).", min=0.0, max=1.0, min_exclusive=True)
    top_k: int = knob(0, "Top-k (0 = off).", min=0)
    max_new_tokens: int = knob(128, "Longest response of one turn, in tokens.", min=1)


@dataclass
class TaskConfig:
    name: str = knob("arith", "Verifiable task.", choices=("arith", "gsm8k", "math500", "mbpp"))
    data_path: str = knob("", "Data root for gsm8k/math500/mbpp (default: $TOSCA_MLMT_DATA or ../shared/data).",
                          rule=EXISTING_DIR_OR_EMPTY)
    split: str = knob("train", "Which split to draw problems from.", choices=("train", "test"))
    limit: int = knob(16, "Number of problems (0 = the whole split).", min=0)
    level: int = knob(1, "arith difficulty level (README: levels and measured base rates).", min=1, max=6)
    skip_bad_rows: bool = knob(False, "Drop malformed data rows (counted in the manifest) instead of failing.")


@dataclass
class EpisodeConfig:
    n_samples: int = knob(2, "Turn-1 samples per problem (the group for group-relative advantages).", min=1)
    rounds: int = knob(1, "K: feedback + refine rounds after turn 1 (0 = single-turn baseline).", min=0)
    strategies: list = knob(dataclasses.MISSING, "Strategy set: list of {name, instruction[, prefix]} (non-empty "
                                                 "strings, unique names).",
                            default_factory=lambda: [dict(s) for s in DEFAULT_STRATEGIES])
    strategy_selection: str = knob("auto", "auto = uniform without Q-values, epsilon_softmax with them (epsilon of "
                                           "uniform exploration mixed into softmax(Q / T)).",
                                   choices=("auto", "uniform", "softmax", "epsilon_softmax", "epsilon_greedy",
                                            "greedy"))
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
                                     "verdict = 'Your answer is right/wrong.' from the verifier (a privileged control).",
                         choices=("generate", "static", "verdict"))
    writer_sees: str = knob("none", "Extra signal in the writer's state per attempt: none; confidence = the solver's "
                                    "mean token log-prob bucketed low/medium/high (honest); verdict = the verifier's "
                                    "right/wrong (privileged: labelled in every summary).",
                            choices=("none", "confidence", "verdict"))
    confidence_edges: list = knob(dataclasses.MISSING, "writer_sees=confidence: mean log-prob edges [low|medium, "
                                                       "medium|high], ascending.",
                                  default_factory=lambda: [-0.6, -0.25], rule=CONFIDENCE_EDGES)
    strategy_prefix: bool = knob(False, "Open the feedback the solver reads with the chosen strategy's fixed "
                                        "sentence (its 'prefix'), so the decision reaches the solver.")
    max_prompt_tokens: int = knob(1536, "Prompts longer than this are left-truncated (counted in metrics).", min=1)
    counterfactual: bool = knob(False, "Also sample each refine with the feedback cut out of its context and score it "
                                       "(one more solver turn per round), for upper.reward=counterfactual.")
    stop_at_answer: bool = knob(True, "End each solver turn at its first complete 'The answer is: N' line (tasks with "
                                      "an answer line: arith, gsm8k); finish_reason 'answer'.")


@dataclass
class LoggingConfig:
    wandb: bool = knob(True, "Log to Weights & Biases.")
    wandb_mode: str = knob("offline", "offline needs no account; sync later with `wandb sync`.",
                           choices=("offline", "online", "disabled"))
    project: str = knob("tosca-mlmt", "wandb project name.", rule=NON_EMPTY)
    progress: bool = knob(True, "Show progress bars.")


@dataclass
class CollectConfig:
    out: str = knob("snapshots", "Snapshot root folder.", rule=NON_EMPTY)
    parents: list = knob(dataclasses.MISSING, "Parent snapshot ids recorded in provenance.", default_factory=list,
                         rule=ID_LIST)


@dataclass
class DistributedConfig:
    deepspeed: str = knob("", "DeepSpeed JSON config (e.g. configs/deepspeed/zero2.json); empty = plain DDP when "
                              "launched with several processes. Its \"auto\" batch/clip fields are filled from "
                              "lower.*/upper.*.", rule=EXISTING_FILE_OR_EMPTY)
    backend: str = knob("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU.",
                        choices=("auto", "gloo", "nccl"))
    timeout_minutes: int = knob(30, "Collective timeout; a rank that waits longer fails instead of hanging.", min=1)


@dataclass
class Config:
    seed: int = knob(0, "Master seed: problems, strategy choice and sampling derive from it.", min=0)
    deterministic: bool = knob(False, "Determinism mode: deterministic torch algorithms, fixed thread count.")
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    solver_sampling: SamplingConfig = field(default_factory=SamplingConfig)
    writer_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=64))
    task: TaskConfig = field(default_factory=TaskConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    lower: LowerConfig = field(default_factory=LowerConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    upper: UpperConfig = field(default_factory=UpperConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading / validation


def _show(value: Any) -> str:
    """``repr`` short enough for a one-line error (a 5000-digit number stays readable)."""
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _text_problem(value: Any) -> str | None:
    """Why a string somewhere in ``value`` cannot be used (NUL, lone surrogate), or None.

    A NUL breaks every path and subprocess call; a lone surrogate (from ``\\udXXX`` escapes
    or undecodable argv bytes) cannot be encoded, so the tokenizer or a file write would
    crash long after load."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return "contains a NUL character"
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"contains a lone surrogate ({v[e.start]!r}), which is not valid Unicode"
        elif isinstance(v, dict):
            stack += list(v.keys()) + list(v.values())
        elif isinstance(v, list):
            stack += v
    return None


def _type_of(tp: Any, value: Any) -> Any:
    """The concrete type to coerce ``value`` to: a union (``str | list``) takes the list
    alternative for lists and the first one otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        alts = typing.get_args(tp)
        return list if isinstance(value, list) and list in alts else alts[0]
    return tp


def _coerce(path: str, value: Any, tp: Any, md: typing.Mapping, default: Any = None) -> Any:
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"field '{path}' must be a mapping, got {_show(value)}")
        # A partial section merges onto that section's own defaults (which may differ from
        # the section type's defaults, e.g. writer_sampling.max_new_tokens).
        return _build(tp, _deep_merge(dataclasses.asdict(default), value), path + ".")
    tp = _type_of(tp, value)
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            value = value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"field '{path}' must be true or false, got {_show(value)}")
    elif tp is int:
        # bool is an int subclass, but `true` for a count is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"field '{path}' must be an integer, got {_show(value)}")
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"field '{path}' must be an integer, got {_show(value)}") from None
        if not -INT_MAX - 1 <= value <= INT_MAX:
            raise ConfigError(f"invalid value {_show(value)} for field '{path}': must fit in 32 bits "
                              f"(at most {INT_MAX})")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"field '{path}' must be a number, got {_show(value)}")
        try:
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        except (ValueError, OverflowError):
            raise ConfigError(f"field '{path}' must be a finite number, got {_show(value)}") from None
        if not math.isfinite(value):
            raise ConfigError(f"invalid value {_show(value)} for field '{path}': must be a finite number")
    elif tp is str:
        if value is None:
            value = ""
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"field '{path}' must be a string, got {_show(value)}")
        value = str(value)
    elif tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"field '{path}' must be a list, got {_show(value)}")
    problem = _text_problem(value)
    if problem:
        raise ConfigError(f"invalid value {_show(value)} for field '{path}': {problem}")
    choices = md.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"invalid value {_show(value)} for field '{path}'; allowed: {', '.join(map(str, choices))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        reason = range_error(md, value)
        if reason:
            raise ConfigError(f"invalid value {_show(value)} for field '{path}': {reason}")
    rule: Rule | None = md.get("rule")
    if rule is not None and not rule.ok(value):
        raise ConfigError(f"invalid value {_show(value)} for field '{path}': must be {rule.text}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"unknown config field '{prefix}{_plain(unknown[0])}'; allowed fields here: {', '.join(fields)}"
        )
    types_ = typing.get_type_hints(cls)
    defaults = cls()
    kwargs = {}
    # Defaults go through the same checks as given values: a default outside its own range
    # (or a section default such as writer_sampling's) fails here, in every test run.
    for name, f in fields.items():
        default = getattr(defaults, name)
        value = data.get(name, {} if dataclasses.is_dataclass(default) else default)
        kwargs[name] = _coerce(prefix + name, value, types_[name], f.metadata, default)
    return cls(**kwargs)


def _plain(key: Any) -> str:
    """A mapping key for an error message: strings as they are, anything else as its repr."""
    return key if isinstance(key, str) and not _text_problem(key) and key.isprintable() else _show(key)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Apply ``a.b.c=value`` onto a nested dict (CLI overrides)."""
    keys = dotted.split(".")
    if not all(k.strip() for k in keys):
        raise ConfigError(f"bad field name {_show(dotted)}: expected dotted names such as lower.lr")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"field '{dotted}': '{k}' is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- YAML file (may ``include:`` another preset) <- dotted overrides; validated."""
    tree: dict = {}
    if path is not None:
        tree = _read_yaml(Path(path))
    for dotted, value in (overrides or {}).items():
        set_dotted(tree, dotted, value)
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` without aliases and without duplicate keys.

    Aliases: a few hundred bytes of nested ``*refs`` expand into billions of nodes (the
    "billion laughs"), and no preset needs them. Duplicate keys: YAML keeps the last one
    silently, which hides a typo'd or pasted-twice section."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not supported in "
                                                          "configs; write the value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first
                except TypeError:
                    raise yaml.constructor.ConstructorError(None, None, f"unhashable key {_show(key)}",
                                                            key_node.start_mark) from None
                if seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {_show(key)} (first at line {first[key]})", key_node.start_mark)
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def parse_yaml(text: str, where: str, lines: bool = True) -> Any:
    """``text`` parsed by the strict loader; any failure is a one-line ConfigError naming
    ``where`` (and ``where:line`` when ``lines``)."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if lines and mark is not None else where
        raise ConfigError(f"{at}: not valid YAML: {_one_line(getattr(e, 'problem', None) or e)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid YAML: nested too deeply") from None
    except (ValueError, OverflowError, TypeError) as e:
        # PyYAML's scalar constructors raise plain errors: a 2020-13-45 timestamp, an
        # integer past Python's 4300-digit conversion limit.
        raise ConfigError(f"{where}: not valid YAML: {_one_line(e)}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """``--set FIELD=VALUE`` -> (field, value), the value read as YAML (``[a, b]`` is a list)."""
    if "=" not in text:
        raise ConfigError(f"--set expects FIELD=VALUE, got {_show(text)}")
    key, value = text.split("=", 1)
    key = key.strip()
    problem = _text_problem(text)
    if problem:  # YAML would only say "special characters are not allowed"
        raise ConfigError(f"--set {_show(text)}: {problem}")
    return key, parse_yaml(value, f"--set {_plain(key)}", lines=False) if value.strip() else ""


def _read_yaml(path: Path, depth: int = 0) -> dict:
    try:
        if path.is_dir():
            raise ConfigError(f"{path}: is a folder, not a config file")
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        # A FIFO or /dev/zero would block or never end; no real config is near the cap.
        if not path.is_file():
            raise ConfigError(f"{path}: not a regular file")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size} bytes is too large for a config "
                              f"(at most {MAX_CONFIG_BYTES})")
        raw = path.read_bytes()
    except ValueError:  # a NUL in the path
        raise ConfigError(f"invalid config path {_show(str(path))}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
    data = parse_yaml(text, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    inc = data.pop("include", None)
    if inc is not None:
        if not isinstance(inc, str) or not inc.strip():
            raise ConfigError(f"{path}: 'include' must name one YAML file (a path relative to this file), "
                              f"got {_show(inc)}")
        if depth >= 4:
            raise ConfigError(f"{path}: include chain too deep (more than 4 levels, or a cycle)")
        data = _deep_merge(_read_yaml(path.parent / inc, depth + 1), data)
    return data


def validate(cfg: Config) -> None:
    """Cross-field checks that a single knob's range cannot express."""
    def need(cond: bool, field_: str, msg: str):
        if not cond:
            raise ConfigError(f"invalid value for field '{field_}': {msg}")

    lo, up = cfg.lower, cfg.upper
    need(lo.minibatch_size % lo.grad_accum == 0, "lower.grad_accum",
         f"must divide lower.minibatch_size ({lo.minibatch_size})")
    need(up.micro_batch_size <= up.batch_size, "upper.micro_batch_size",
         f"must be at most upper.batch_size ({up.batch_size}); 0 = the whole batch")
    if cfg.engine.name == "vllm":
        need(cfg.episode.max_prompt_tokens < cfg.engine.vllm.max_model_len, "episode.max_prompt_tokens",
             f"must be below engine.vllm.max_model_len ({cfg.engine.vllm.max_model_len}) with engine.name=vllm: "
             "vLLM refuses longer prompts and needs room for the response")
    need(up.reward != "counterfactual" or cfg.episode.counterfactual, "upper.reward",
         "counterfactual needs episode.counterfactual=true (refines scored without their feedback)")
    strategies = cfg.episode.strategies
    need(len(strategies) >= 1, "episode.strategies", "needs at least one strategy")
    names = set()
    for i, s in enumerate(strategies):
        need(isinstance(s, dict) and {"name", "instruction"} <= set(s) <= {"name", "instruction", "prefix"},
             f"episode.strategies[{i}]", "each strategy needs the keys 'name' and 'instruction' (and may have "
                                         "'prefix', the sentence that opens its feedback)")
        for key in ("name", "instruction", "prefix"):
            need(key not in s or (isinstance(s[key], str) and bool(s[key].strip())),
                 f"episode.strategies[{i}].{key}", "must be a non-empty string")
        need(s["name"] not in names, f"episode.strategies[{i}].name", f"duplicate name {_show(s['name'])}")
        names.add(s["name"])


# ---------------------------------------------------------------- documentation


def field_help(md: typing.Mapping) -> str:
    """A knob's help text followed by its allowed values (choices, range, rule)."""
    out = md.get("help", "")
    if md.get("choices"):
        out += f" One of: {', '.join(map(str, md['choices']))}."
    valid = [t for t in (range_text(md), md["rule"].text if md.get("rule") else "") if t]
    if valid:
        out += f" Valid: {'; '.join(valid)}."
    return out


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def describe_fields(cls=Config, prefix: str = "", inst: Any = None) -> list[tuple[str, str, Any, str]]:
    """(dotted name, type, default, help with the valid range) for every knob, for docs and
    ``mlmt config --explain``. Defaults are read from the enclosing section's instance, so a
    section default (writer_sampling.max_new_tokens = 64) shows as the config holds it."""
    rows = []
    inst = cls() if inst is None else inst
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe_fields(type(value), prefix + f.name + ".", value)
        else:
            rows.append((prefix + f.name, _type_name(hints[f.name]), value, field_help(f.metadata)))
    return rows


def markdown_reference() -> str:
    """The README's config reference table, generated from the knobs."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| field | default | meaning |", "|---|---|---|"]
    for name, _, default, help_ in describe_fields():
        shown = "[...]" if isinstance(default, list) and default else repr(default)
        lines.append(f"| `{name}` | `{cell(shown)}` | {cell(help_)} |")
    return "\n".join(lines)
