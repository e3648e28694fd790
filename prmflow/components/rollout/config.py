"""The rollout stage's config: what to sample from, how, how to score it, and where to write."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from ..models import modeling
from ... import tasks, tracking
from ...errors import ConfigError
from ..sampling.config import SamplingConfig
from ...tasks.arithmetic import ArithmeticConfig
from . import outcome_rewards as rewards_lib
from ..sampling.vllm_engine import VLLMSettings, check_vllm_sampling
from ..sampling.environment import EnvironmentConfig


@dataclass
class Config:
    policy: str = "tiny-llama"
    """Policy to sample from: HF model directory (the sft or ppo output) or a tiny preset."""
    output: str = "outputs/rollouts"
    """Rollouts directory to create; with num_shards > 1 this shard's own directory (e.g. ITER/shard-3)."""
    prm: str = ""
    """PRM directory for step_rewards (its own tokenizer re-reads the text), or `oracle`: the task's checker (arithmetic:
    1 up to the first wrong step, 0 from it; an environment: its weighted per-action rewards). Empty: no step_rewards
    (an environment's own)."""
    ref: str = ""
    """Reference model for ref_logprobs (the KL term), sharing the policy's tokenizer. Empty: no ref_logprobs."""
    critic: str = ""
    """Critic (scalar-head model) for per-token values, needed by GAE. Empty: no values."""
    task: str = "arithmetic"
    """Prompts: 'arithmetic' or 'visual' (built-in tasks; visual needs a vision-language policy) or a .jsonl/.parquet
    dataset (prompt/messages, answer, source, images)."""
    split: str = "train"
    """Split of the arithmetic task (a dataset file is one split)."""
    num_prompts: int = 64
    """Prompts per iteration over all shards; 0 = every row of a dataset file."""
    n_samples: int = 4
    """Responses sampled per prompt (a group, for GRPO/RLOO baselines)."""
    sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64))
    """How a response is drawn: temperature (0 = greedy: then n_samples > 1 repeats the same response; every log-prob
    column is taken at it, as the ppo stage's), max_new_tokens (EOS included; longer responses end with finish_reason
    'length'). top_p < 1 and top_k > 0 are refused: the trainer cannot take its log-probs under the sampler's
    truncation."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a response ends once its text contains one (kept in the response)."""
    seed: int = 0
    """Seed of prompt selection and sampling; with iteration and shard it fixes every sample."""
    iteration: int = 0
    """RL iteration k (the policy version): written to every row; picks this iteration's prompts."""
    batch_sequences: int = 64
    """Sequences (prompts x samples) per generation batch of the HF sampler."""
    score_batch_sequences: int = 32
    """Sequences per forward pass when scoring (old/ref logprobs, values, PRM)."""
    old_logprobs: Literal["auto", "forward", "sampler"] = "auto"
    """Where old_logprobs (the PPO ratio's denominator) come from. forward: a full forward of the policy over every
    response (one more pass). sampler: the sampler's own log-probs (behavior_logprobs; with vLLM fit only if ppo
    recomputes). auto: sampler for hf in float32, else forward."""
    sampler: Literal["hf", "vllm"] = "hf"
    """Sampling engine: hf (CPU or GPU, transformers) or vllm (GPU node pools, the gpu extra)."""
    device: str = ""
    """Torch device for the HF sampler and the scoring models; empty = cuda when available, else cpu."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Model dtype for sampling and scoring; auto = bfloat16 with vLLM or on a GPU (half the memory of float32; a
    float32 vLLM engine is slow and large), float32 on CPU (exact)."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one (as SFT did)."""
    max_prompt_len: int = 0
    """Longest prompt in tokens; 0 = the model's window minus sampling.max_new_tokens."""
    on_long_prompt: Literal["truncate", "fail"] = "truncate"
    """A longer prompt keeps its last max_prompt_len tokens (counted, logged) or fails the stage."""
    step_separator: str = "\n"
    """Text between reasoning steps (step_ends and the PRM's steps); the shared default is a newline."""
    rewards: list = field(default_factory=lambda: [dict(e) for e in rewards_lib.DEFAULT_RECIPES])
    """Outcome reward table: entries {source, component, weight, name, ...params}; a row's recipe is its source's
    entries (else source 'default'). YAML text on the command line."""
    shard: int = 0
    """This pod's shard: it samples the prompts with index % num_shards == shard."""
    num_shards: int = 1
    """Pods sampling this iteration in parallel, each into its own output; their parent reads as one dataset."""
    rank: int = -1
    """This process's rank among world_size processes splitting the shard's prompts (one engine per GPU): it samples and
    scores generation batches rank, rank + world_size, ... and writes OUTPUT/rank-<rank>; the ranks' directories read as
    one dataset. -1: $RANK (torchrun sets it), else 0."""
    world_size: int = 0
    """Processes splitting this shard's prompts, e.g. `torchrun --nproc-per-node 8 prmflow rollout ...`; the samples are
    the same as on one process. 0: $WORLD_SIZE (torchrun sets it), else 1."""
    log_samples: int = 16
    """Responses (with per-step PRM scores) logged as an MLflow table artifact."""
    overwrite: bool = False
    """Replace an existing output written by a different config (otherwise that is an error)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Difficulty of the built-in arithmetic task."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    """vLLM engine settings (sampler=vllm only)."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes: the environment answering the policy's turns (tool calls), its limits and reward weights
    (docs/agents.md). Empty factory: one response per sample."""
    tracking: tracking.TrackingConfig = field(default_factory=tracking.TrackingConfig)
    """MLflow tracking."""

    def __post_init__(self):
        for key in ("n_samples", "batch_sequences", "score_batch_sequences", "num_shards"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be at least 1.")
        for key in ("num_prompts", "max_prompt_len", "log_samples", "iteration"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} is {getattr(self, key)}; it must be 0 or more.")
        rank, world = self.ranks()
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"rank is {rank} with world_size={world} (from the keys rank/world_size or $RANK/$WORLD_SIZE); "
                              f"use 0 <= rank < world_size.")
        if not 0 <= self.shard < self.num_shards:
            raise ConfigError(f"shard is {self.shard} with num_shards={self.num_shards}; use 0 <= shard < num_shards.")
        if self.task in tasks.TASKS and self.num_prompts == 0:
            raise ConfigError(f"num_prompts=0 (every row) needs a dataset file; the {self.task} task needs a count.")
        if not self.step_separator:
            raise ConfigError("step_separator is empty; steps need a separator (the shared default is a newline).")
        if self.sampler == "vllm" and modeling.is_tiny(self.policy):
            raise ConfigError(f"sampler=vllm needs a model directory; '{self.policy}' is a tiny preset. "
                              f"Write it with `prmflow make-tiny-model DIR` or use sampler=hf.")
        if not self.policy:
            raise ConfigError("policy is empty; point it at the policy's model directory.")
        # the PPO ratio and rollout_correction compare the trainer's log-probs with the sampler's: both are taken at the
        # temperature (logits / T, as TRL and veRL do), but a truncated distribution the trainer cannot reproduce (the
        # nucleus of a bf16 sampler is not the trainer's; a token outside the trainer's has log-prob -inf)
        for key, value, off in (("top_p", self.sampling.top_p, 1.0), ("top_k", self.sampling.top_k, 0)):
            if value != off:
                raise ConfigError(f"sampling.{key}={value}: rollouts train the policy, and the trainer takes its "
                                  f"log-probs of the whole distribution at sampling.temperature, not of a top-p/top-k "
                                  f"truncated one, so the PPO ratio would compare two distributions. Set sampling.{key}="
                                  f"{off} (lower sampling.temperature to sharpen); evaluate may still use {key}.")
        if self.sampler == "vllm":  # what vLLM's SamplingParams would refuse after the engine had loaded
            check_vllm_sampling(self.n_samples, self.sampling.temperature)
            if self.vllm.max_model_len < 0 or self.vllm.tensor_parallel_size < 1:
                raise ConfigError(f"vllm.max_model_len={self.vllm.max_model_len}, vllm.tensor_parallel_size="
                                  f"{self.vllm.tensor_parallel_size}: use max_model_len >= 0 (0 = the model's) and "
                                  f"tensor_parallel_size >= 1.")
        if self.environment.enabled:
            if world > 1:
                raise ConfigError(f"environment.factory is set with world_size={world}: multi-turn episodes run in one "
                                  f"process per shard so far; split the prompts with num_shards (one pod each) instead.")
            if self.task == "visual":
                raise ConfigError("environment.factory is set with task=visual: episodes are text-only so far. Unset task "
                                  "or environment.factory.")
        self.rewards = rewards_lib.parse_table(self.rewards)  # YAML text from the command line -> entries
        # a malformed recipe fails here; user functions are imported when the stage runs (the machine
        # that compiles a pipeline may not have them)
        rewards_lib.build_recipes(self.rewards, import_functions=False)

    def ranks(self) -> tuple[int, int]:
        """(rank, world size) of this process: the keys when set, else torchrun's $RANK / $WORLD_SIZE."""
        world = self.world_size or int(os.environ.get("WORLD_SIZE", "1") or 1)
        rank = self.rank if self.rank >= 0 else int(os.environ.get("RANK", "0") or 0)
        return rank, world
