"""The one typed config: dataclasses with help text, defaults and load-time validation.

Every knob a stage reads lives here. YAML files and CLI options are merged onto these
defaults through :func:`load_config`; an unknown key or a bad value raises
:class:`ConfigError` naming the dotted field and what is allowed, before anything runs.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tosca_mlmt.errors import ConfigError
from tosca_mlmt.joint.config import JointConfig
from tosca_mlmt.knobs import knob
from tosca_mlmt.lower.config import LowerConfig
from tosca_mlmt.upper.config import UpperConfig

DEFAULT_STRATEGIES: tuple[dict[str, str], ...] = (
    {"name": "check_arithmetic", "instruction": "Point to the calculation that is most likely wrong and ask the solver to redo it carefully."},
    {"name": "reread_question", "instruction": "Remind the solver what the question actually asks and which numbers it gives."},
    {"name": "verify_substitution", "instruction": "Ask the solver to check its answer by plugging it back into the problem."},
    {"name": "start_over", "instruction": "Tell the solver to discard its attempt and solve the problem again step by step."},
    {"name": "confirm", "instruction": "Say the attempt looks right and ask the solver to state the final answer clearly."},
    {"name": "simplify", "instruction": "Suggest a simpler way to set up the computation, one step at a time."},
)


@dataclass
class LoraConfig:
    r: int = knob(16, "LoRA rank of each adapter (solver and writer).")
    alpha: int = knob(32, "LoRA alpha (scale = alpha / r).")
    dropout: float = knob(0.0, "LoRA dropout; 0 keeps rollouts and training logprobs identical.")
    target_modules: str = knob("all-linear", "peft target_modules; 'all-linear' adapts every linear layer.")


@dataclass
class ModelConfig:
    solver: str = knob("smollm2-135m", "Solver (LL) base model: 'smollm2-135m' (embedded) or a local HF model folder.")
    writer: str = knob("", "Feedback-writer (HL) base model; empty = same base as the solver (two adapters, one base).")
    solver_adapter: str = knob("", "Folder of a trained solver adapter to load (empty = fresh, identity adapter).")
    writer_adapter: str = knob("", "Folder of a trained writer (adapter + Q head + strategies) to load.")
    dtype: str = knob("auto", "Inference dtype: auto (bf16 if the CPU/GPU supports it), float32 or bfloat16.",
                      choices=("auto", "float32", "bfloat16"))
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = knob(0.5, "Share of GPU memory vLLM may take (GPU only; leaves room for training).")
    max_model_len: int = knob(2048, "Longest prompt+response vLLM must hold.")
    enforce_eager: bool = knob(True, "Skip CUDA graphs / torch.compile (fast start; turn off for long GPU runs).")
    kv_cache_gb: int = knob(2, "CPU only: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE).")
    enable_prefix_caching: bool = knob(True, "Reuse KV of shared prefixes (turn-3 prompts extend turn-1 prompts).")


@dataclass
class EngineConfig:
    name: str = knob("hf", "Rollout engine.", choices=("hf", "vllm"))
    batch_size: int = knob(32, "Prompts per generate call (hf); vllm schedules the whole turn itself.")
    threads: int = knob(0, "torch CPU threads (0 = all cores).")
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class SamplingConfig:
    temperature: float = knob(0.7, "Sampling temperature; 0 = greedy.")
    top_p: float = knob(1.0, "Nucleus sampling mass.")
    top_k: int = knob(0, "Top-k (0 = off).")
    max_new_tokens: int = knob(128, "Longest response of one turn, in tokens.")


@dataclass
class TaskConfig:
    name: str = knob("arith", "Verifiable task.", choices=("arith", "gsm8k", "math500", "mbpp"))
    data_path: str = knob("", "Data root for gsm8k/math500/mbpp (default: $TOSCA_MLMT_DATA or ../shared/data).")
    split: str = knob("train", "Which split to draw problems from.", choices=("train", "test"))
    limit: int = knob(16, "Number of problems (0 = the whole split).")
    level: int = knob(1, "arith difficulty level (1-5); 1 is calibrated for smollm2-135m (turn-1 accuracy ~33%).")
    skip_bad_rows: bool = knob(False, "Drop malformed data rows (counted in the manifest) instead of failing.")


@dataclass
class EpisodeConfig:
    n_samples: int = knob(2, "Turn-1 samples per problem (the group for group-relative advantages).")
    rounds: int = knob(1, "K: feedback + refine rounds after turn 1 (0 = single-turn baseline).")
    strategies: list = knob(dataclasses.MISSING, "Strategy set: list of {name, instruction}.",
                            default_factory=lambda: [dict(s) for s in DEFAULT_STRATEGIES])
    strategy_selection: str = knob("auto", "auto = uniform without Q-values, softmax with them.",
                                   choices=("auto", "uniform", "softmax", "epsilon_greedy", "greedy"))
    strategy_temperature: float = knob(1.0, "Softmax temperature over the writer's Q-values.")
    epsilon: float = knob(0.1, "Exploration rate for epsilon_greedy.")
    max_feedback_tokens: int = knob(64, "Longest feedback text, in tokens.")
    feedback: str = knob("generate", "generate = the writer model writes feedback; static = the chosen strategy's "
                                     "instruction is the feedback verbatim (SCoRe's fixed self-correction prompt).",
                         choices=("generate", "static"))
    max_prompt_tokens: int = knob(1536, "Prompts longer than this are left-truncated (counted in metrics).")


@dataclass
class LoggingConfig:
    wandb: bool = knob(True, "Log to Weights & Biases.")
    wandb_mode: str = knob("offline", "offline needs no account; sync later with `wandb sync`.",
                           choices=("offline", "online", "disabled"))
    project: str = knob("tosca-mlmt", "wandb project name.")
    progress: bool = knob(True, "Show progress bars.")


@dataclass
class CollectConfig:
    out: str = knob("snapshots", "Snapshot root folder.")
    parents: list = knob(dataclasses.MISSING, "Parent snapshot ids recorded in provenance.", default_factory=list)


@dataclass
class DistributedConfig:
    deepspeed: str = knob("", "DeepSpeed JSON config (e.g. configs/deepspeed/zero2.json); empty = plain DDP when "
                              "launched with several processes. Its \"auto\" batch/clip fields are filled from "
                              "lower.*/upper.*.")
    backend: str = knob("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU.",
                        choices=("auto", "gloo", "nccl"))
    timeout_minutes: int = knob(30, "Collective timeout; a rank that waits longer fails instead of hanging.")


@dataclass
class Config:
    seed: int = knob(0, "Master seed: problems, strategy choice and sampling derive from it.")
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


def _coerce(path: str, value: Any, tp: Any, choices: tuple | None, default: Any = None) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"field '{path}' must be a mapping, got {type(value).__name__}")
        # A partial section merges onto that section's own defaults (which may differ from
        # the section type's defaults, e.g. writer_sampling.max_new_tokens).
        return _build(tp, _deep_merge(dataclasses.asdict(default), value), path + ".")
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            value = value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"field '{path}' must be true or false, got {value!r}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"field '{path}' must be an integer, got {value!r}")
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"field '{path}' must be an integer, got {value!r}") from None
    elif tp is float:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"field '{path}' must be a number, got {value!r}") from None
    elif tp is str:
        if value is None:
            value = ""
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"field '{path}' must be a string, got {value!r}")
        value = str(value)
    elif tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"field '{path}' must be a list, got {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"invalid value {value!r} for field '{path}'; allowed: {', '.join(map(str, choices))}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"unknown config field '{prefix}{unknown[0]}'; allowed fields here: {', '.join(fields)}"
        )
    types_ = typing.get_type_hints(cls)
    defaults = cls()
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(prefix + name, value, types_[name], fields[name].metadata.get("choices"),
                               getattr(defaults, name))
    return cls(**kwargs)


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
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"field '{dotted}': '{k}' is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- YAML file (may ``include:`` another preset) <- dotted overrides; validated."""
    tree: dict = {}
    if path:
        tree = _read_yaml(Path(path))
    for dotted, value in (overrides or {}).items():
        set_dotted(tree, dotted, value)
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


def _read_yaml(path: Path, depth: int = 0) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    inc = data.pop("include", None)
    if inc:
        if depth > 4:
            raise ConfigError(f"{path}: include chain too deep")
        data = _deep_merge(_read_yaml((path.parent / inc).resolve(), depth + 1), data)
    return data


def validate(cfg: Config) -> None:
    """Cross-field checks that types and choices alone cannot express."""
    def need(cond: bool, field_: str, msg: str):
        if not cond:
            raise ConfigError(f"invalid value for field '{field_}': {msg}")

    need(cfg.episode.n_samples >= 1, "episode.n_samples", "must be >= 1")
    need(cfg.episode.rounds >= 0, "episode.rounds", "must be >= 0 (0 = single-turn: no feedback, no refine)")
    need(cfg.task.limit >= 0, "task.limit", "must be >= 0")
    need(1 <= cfg.task.level <= 5, "task.level", "must be in 1..5")
    need(cfg.engine.batch_size >= 1, "engine.batch_size", "must be >= 1")
    need(0.0 <= cfg.episode.epsilon <= 1.0, "episode.epsilon", "must be in [0, 1]")
    need(cfg.episode.strategy_temperature > 0, "episode.strategy_temperature", "must be > 0")
    for name in ("solver_sampling", "writer_sampling"):
        s: SamplingConfig = getattr(cfg, name)
        need(s.temperature >= 0, f"{name}.temperature", "must be >= 0")
        need(0 < s.top_p <= 1, f"{name}.top_p", "must be in (0, 1]")
        need(s.top_k >= 0, f"{name}.top_k", "must be >= 0")
        need(s.max_new_tokens >= 1, f"{name}.max_new_tokens", "must be >= 1")
    lo = cfg.lower
    need(lo.grad_accum >= 1 and lo.minibatch_size % lo.grad_accum == 0, "lower.grad_accum",
         f"must divide lower.minibatch_size ({lo.minibatch_size})")
    need(lo.iterations >= 1 and lo.epochs >= 1, "lower.iterations", "iterations and epochs must be >= 1")
    need(lo.bonus.clip > 0, "lower.bonus.clip", "must be > 0")
    need(lo.logprob_chunk >= 1, "lower.logprob_chunk", "must be >= 1")
    need(lo.score_batch >= 0, "lower.score_batch", "must be >= 0 (0 = a rank's whole share at once)")
    ds = cfg.distributed.deepspeed
    need(not ds or Path(ds).is_file(), "distributed.deepspeed", f"no such DeepSpeed config file: {ds}")
    need(cfg.distributed.timeout_minutes >= 1, "distributed.timeout_minutes", "must be >= 1")
    strategies = cfg.episode.strategies
    need(len(strategies) >= 1, "episode.strategies", "needs at least one strategy")
    names = set()
    for i, s in enumerate(strategies):
        need(isinstance(s, dict) and set(s) == {"name", "instruction"}, f"episode.strategies[{i}]",
             "each strategy needs exactly the keys 'name' and 'instruction'")
        need(bool(str(s["name"]).strip()), f"episode.strategies[{i}].name", "must not be empty")
        need(s["name"] not in names, f"episode.strategies[{i}].name", f"duplicate name {s['name']!r}")
        names.add(s["name"])


def describe_fields(cls=Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted name, type, default, help) for every knob, for docs and ``mlmt config --explain``."""
    rows = []
    inst = cls()
    for f in dataclasses.fields(cls):
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe_fields(type(value), prefix + f.name + ".")
        else:
            help_ = f.metadata.get("help", "")
            if f.metadata.get("choices"):
                help_ += f" One of: {', '.join(map(str, f.metadata['choices']))}."
            rows.append((prefix + f.name, type(value).__name__, value, help_))
    return rows
