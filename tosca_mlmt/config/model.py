"""``model:`` section: which bases and adapters the solver and the writer load, and LoRA."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tosca_mlmt.config.knobs import EXISTING_DIR_OR_EMPTY, NON_EMPTY, Rule, knob, path_is
from tosca_mlmt.config.section import Section, show
from tosca_mlmt.errors import ConfigError

# peft accepts either form; an empty name would silently adapt nothing.
TARGET_MODULES = Rule("a non-empty string or a non-empty list of non-empty strings",
                      lambda v: bool(v.strip()) if isinstance(v, str)
                      else bool(v) and all(isinstance(s, str) and s.strip() for s in v))

TEMPLATE_SOURCE = Rule("empty, 'chatml' or an existing file",
                       lambda v: v in ("", "chatml") or path_is("file", v))
# names a Jinja template can read
TEMPLATE_KWARGS = Rule("a mapping of identifier names to values",
                       lambda v: all(isinstance(k, str) and k.isidentifier() for k in v))


@dataclass
class LoraConfig(Section):
    r: int = knob(16, "LoRA rank of each adapter (solver and writer).", min=1)
    alpha: int = knob(32, "LoRA alpha (scale = alpha / r).", min=1)
    dropout: float = knob(0.0, "LoRA dropout; 0 keeps rollouts and training logprobs identical.",
                          min=0.0, max=1.0, max_exclusive=True)
    target_modules: str | list = knob("all-linear", "peft target_modules: 'all-linear' adapts every linear layer; "
                                                    "another string is a regex over module names; a list names "
                                                    "modules (e.g. [q_proj, v_proj]).", rule=TARGET_MODULES)

    def check(self, prefix: str) -> None:
        # peft matches a string with re.fullmatch once the model has loaded: a bad pattern must fail here
        tm = self.target_modules
        if isinstance(tm, str) and tm != "all-linear":
            try:
                re.compile(tm)
            except re.error as e:
                raise ConfigError(f"invalid value {show(tm)} for field '{prefix}target_modules': not a regular "
                                  f"expression ({e}); a list names modules literally") from None


@dataclass
class ModelConfig(Section):
    solver: str = knob("smollm2-135m", "Solver (LL) base model: 'smollm2-135m' (embedded), 'tiny-random' (random "
                                       "2-layer debug base), a local HF model folder, or a hub id 'org/name' or "
                                       "'org/name@revision' already in the local HF cache (HF_HUB_CACHE / HF_HOME; "
                                       "nothing is downloaded).", rule=NON_EMPTY)
    writer: str = knob("", "Feedback-writer (HL) base model, same forms as model.solver; empty = same base as the "
                           "solver (two adapters, one base).")
    solver_adapter: str = knob("", "Folder of a trained solver adapter to load, e.g. RUN/solver (empty = fresh, "
                                   "identity adapter); it must belong to model.solver's base.",
                               rule=EXISTING_DIR_OR_EMPTY)
    writer_adapter: str = knob("", "Folder of a trained writer (adapter + Q head + strategies) to load.",
                               rule=EXISTING_DIR_OR_EMPTY)
    dtype: str = knob("auto", "Inference dtype: auto (bf16 if the CPU/GPU supports it), float32 or bfloat16.",
                      choices=("auto", "float32", "bfloat16"))
    chat_template: str = knob("", "Chat template for both roles' tokenizers instead of their own: a Jinja file, or "
                                  "'chatml' (<|im_start|>role turns, each ended by the model's own eos token). "
                                  "Empty = each tokenizer's own; a base (not instruct) model usually has none and "
                                  "needs this.", rule=TEMPLATE_SOURCE)
    chat_template_kwargs: dict = knob(
        help="Variables for every rendering of the chat templates (solver and writer), as transformers' "
             "apply_chat_template takes them, e.g. --set model.chat_template_kwargs.enable_thinking=false "
             "(Qwen3: no thinking block). date_string defaults to '26 Jul 2024' so that a dated template "
             "(Llama 3.2) renders the same prompt on any day.", rule=TEMPLATE_KWARGS, default_factory=dict)
    lora: LoraConfig = field(default_factory=LoraConfig)
