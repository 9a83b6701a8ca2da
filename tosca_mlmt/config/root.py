"""``Config``: the whole config, one section per field, and the rules between sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from tosca_mlmt.config.engine import EngineConfig, SamplingConfig
from tosca_mlmt.config.episode import EpisodeConfig
from tosca_mlmt.config.joint import JointConfig
from tosca_mlmt.config.knobs import knob
from tosca_mlmt.config.lower import LowerConfig, warn_kl_reward_collapse
from tosca_mlmt.config.model import ModelConfig
from tosca_mlmt.config.run import CollectConfig, DistributedConfig, LoggingConfig
from tosca_mlmt.config.section import Section, need
from tosca_mlmt.config.task import TaskConfig
from tosca_mlmt.config.upper import UpperConfig


@dataclass
class Config(Section):
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

    def check(self, prefix: str) -> None:
        if self.engine.name == "vllm":
            max_len = self.engine.vllm.max_model_len
            need(self.episode.max_prompt_tokens < max_len, f"{prefix}episode.max_prompt_tokens",
                 f"must be below {prefix}engine.vllm.max_model_len ({max_len}) with engine.name=vllm: "
                 "vLLM refuses longer prompts and needs room for the response")
        need(self.lower.logprob_temperature == "raw" or self.solver_sampling.temperature > 0,
             f"{prefix}lower.logprob_temperature", "sampling needs solver_sampling.temperature > 0: greedy PPO batches "
             "have no sampling distribution to score")
        refines = self.lower.refine_samples
        need(refines == 1 or self.episode.rounds == 1, f"{prefix}lower.refine_samples",
             f"{refines} refines of one attempt need episode.rounds=1 (the refine groups branch the last turn)")
        need(refines == 1 or self.solver_sampling.temperature > 0, f"{prefix}lower.refine_samples",
             f"{refines} refines of one attempt need solver_sampling.temperature > 0: greedy refines are all alike")
        need(refines == 1 or self.lower.train_refine, f"{prefix}lower.refine_samples",
             "refine groups train the refines; lower.train_refine=false leaves them out of the loss")
        need(self.upper.reward != "counterfactual" or self.episode.counterfactual, f"{prefix}upper.reward",
             "counterfactual needs episode.counterfactual=true (refines scored without their feedback)")
        need(self.upper.reward != "gold_prob" or self.episode.gold_prob, f"{prefix}upper.reward",
             "gold_prob needs episode.gold_prob=true (solver turns scored by their gold-answer probability)")
        # joint.writer_warmup=update restarts the Q-only warm-up in every writer update: with no fewer warm-up
        # steps than the update has, the feedback text never trains (train-joint refuses the whole-run case too)
        jc, uc = self.joint, self.upper
        need(jc.writer_warmup != "update" or jc.freeze_writer or uc.text_loss == "none"
             or uc.warmup_steps < jc.upper_steps, f"{prefix}upper.warmup_steps",
             f"{uc.warmup_steps} Q-only warm-up steps with joint.writer_warmup=update, whose writer takes "
             f"{jc.upper_steps} steps per update (joint.upper_steps), all of them warm-up, so its feedback text "
             "never trains; needs upper.warmup_steps < joint.upper_steps (or joint.writer_warmup=run)")
        # Warnings last, once every rule has passed: a config that is refused is not warned about too.
        # A warning, not an error: configs/score.yaml reproduces SCoRe as specified with it.
        warn_kl_reward_collapse(self.lower, f"{prefix}lower.")
