"""The one typed config: a package of sections, each a dataclass of knobs that validates itself.

Every knob a stage reads lives here, with its help text, default and valid values. YAML files
and CLI options are merged onto these defaults by :func:`load_config`; an unknown key, a value
of the wrong type, outside its knob's range or breaking a rule between fields raises
:class:`~tosca_mlmt.errors.ConfigError` naming the dotted field and what is allowed, before
anything heavy (models, data) is touched.

Layout: ``knobs`` (the ``knob()`` field and its rules), ``section`` (the self-validating base),
one module per section (``model``, ``engine``, ``task``, ``episode``, ``run``, ``lower``,
``upper``, ``joint``) and ``root`` (:class:`Config`); ``load`` and ``yamlfile`` read and
merge, ``explain`` documents. Of the package it imports only ``tosca_mlmt.errors`` (a
ground-floor module), and no torch, so a bad value is reported at once.
"""

from tosca_mlmt.config.engine import EngineConfig, SamplingConfig, VLLMConfig
from tosca_mlmt.config.episode import DEFAULT_STRATEGIES, SELECTION_MODES, EpisodeConfig
from tosca_mlmt.config.explain import describe_fields, explain_lines, markdown_reference
from tosca_mlmt.config.joint import JointConfig
from tosca_mlmt.config.knobs import INT_MAX, knob
from tosca_mlmt.config.load import load_config, parse_override
from tosca_mlmt.config.lower import (ADVANTAGE_ESTIMATORS, BONUS_GATES, POLICY_LOSSES, ContextBonus, LowerConfig,
                                     ScoreShaping)
from tosca_mlmt.config.model import LoraConfig, ModelConfig
from tosca_mlmt.config.root import Config
from tosca_mlmt.config.run import TRACKERS, CollectConfig, DistributedConfig, LoggingConfig
from tosca_mlmt.config.section import ConfigWarning, Section
from tosca_mlmt.config.task import ANSWER_FORMATS, BUILTIN_TASKS, ENTRY_POINT_GROUP, TaskConfig, task_names
from tosca_mlmt.config.upper import UpperConfig

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ANSWER_FORMATS", "BONUS_GATES", "BUILTIN_TASKS", "DEFAULT_STRATEGIES",
    "ENTRY_POINT_GROUP", "INT_MAX", "POLICY_LOSSES", "SELECTION_MODES", "TRACKERS",
    "CollectConfig", "Config", "ConfigWarning", "ContextBonus", "DistributedConfig", "EngineConfig", "EpisodeConfig",
    "JointConfig", "LoggingConfig", "LoraConfig", "LowerConfig", "ModelConfig", "SamplingConfig", "ScoreShaping",
    "Section", "TaskConfig", "UpperConfig", "VLLMConfig", "describe_fields", "explain_lines", "knob", "load_config",
    "markdown_reference", "parse_override", "task_names",
]
