"""The batch: the advantages hand-off as rows, cut into minibatches (one optimizer update each) and
micro-batches (one forward/backward each).

A micro-batch puts prompts left-padded and responses right-padded, so the logits of the response
positions are one slice of the sequence (the LM head never runs on prompt positions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..runtime import distributed
from ..models import modeling, vision
from ..data import schema
from ...errors import ConfigError, DataError
from .config import Config

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "returns", "values")


@dataclass
class Sample:
    """One response of the advantages hand-off; per-token lists have one entry per response token.

    `load_batch` fills the hand-off's columns; the passes before the first update (prepass.py) fill
    what the hand-off lacks or the config recomputes (old_logprobs, values, pg_mask) and the prompt's
    images (pixels, image_mismatch). Nothing changes a sample once training starts."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantages: list[float]
    old_logprobs: list[float] | None = None   # the ratio's denominator (hand-off, or recomputed)
    ref_logprobs: list[float] | None = None   # reference policy, for the KL loss
    returns: list[float] | None = None        # GAE returns, the critic's target
    values: list[float] | None = None         # V_old (hand-off, or the new critic's first pass)
    kl: list[float] | None = None             # the hand-off's per-token KL, for the KL controller
    images: list[bytes] | None = None         # encoded images of a vision-language prompt
    pg_mask: list[float] | None = None        # 1 for the top-entropy tokens the policy loss keeps
    behavior_logprobs: list[float] | None = None  # the sampler's log-probs (rollout_correction)
    logprob_temperature: float | None = None  # T of the hand-off's log-probs: the policy's are of logits / T (None: 1)
    is_weight: list[float] | None = None      # rollout_correction's weight of each token's policy loss
    pixels: dict | None = None                # the images as the policy's processor gives them
    image_mismatch: str | None = None         # why the image tokens do not match the images, if they do not
    policy_mask: list[int] | None = None      # 1 at the policy's tokens, 0 at an environment's (None: all the policy's)

    def trained(self) -> torch.Tensor:
        """(R,) bool: the response tokens the update trains on (loss, KL, entropy): the policy's, never an
        environment's (a tool observation of a multi-turn episode only conditions the tokens after it)."""
        if self.policy_mask is None:
            return torch.ones(len(self.response_ids), dtype=torch.bool)
        return torch.as_tensor(self.policy_mask, dtype=torch.bool)

    @classmethod
    def of(cls, row: dict) -> "Sample":
        """The sample of a row that has (at least) the hand-off's columns; other keys are ignored."""
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row})


def _needed_columns(cfg: Config) -> list[str]:
    """The columns this config reads, which must not be null in any row."""
    need = ["prompt_ids", "response_ids", "advantages"]
    need += [] if cfg.recomputes_old_logprobs() else ["old_logprobs"]
    need += ["returns"] if cfg.train_critic else []
    need += ["ref_logprobs"] if cfg.kl_loss_coef else []
    need += ["behavior_logprobs"] if cfg.rollout_correction != "none" else []
    return need


def load_batch(cfg: Config) -> list[Sample]:
    """The advantages hand-off as one Sample per response."""
    table = schema.open_dataset(cfg.input, "advantages").read()
    if table.num_rows == 0:
        raise DataError(f"'{cfg.input}' holds no rows; the ppo stage needs at least "
                        f"minibatch_size={cfg.minibatch_size}.")
    for name in _needed_columns(cfg):
        col = table.column(name)
        if col.null_count:
            first = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
            why = {"returns": " (train_critic=true needs GAE returns)", "ref_logprobs": " (kl_loss_coef > 0 needs them)",
                   "old_logprobs": " (or set recompute_old_logprobs=true)",
                   "behavior_logprobs": " (rollout_correction needs the sampler's log-probs; set rollout_correction=none)",
                   }.get(name, "")
            raise DataError(f"'{cfg.input}': column '{name}' is null in row {first} (prompt_id="
                            f"{table.column('prompt_id')[first].as_py()!r}){why}.")
    read = ("prompt_ids", "response_ids", *TOKEN_FIELDS, "kl", "images", "logprob_temperature", "policy_mask")
    read += ("behavior_logprobs",) if cfg.rollout_correction != "none" else ()  # read only when used
    cols = {name: table.column(name).to_pylist() for name in read}
    rows = [Sample(**{name: cols[name][i] for name in cols}) for i in range(table.num_rows)]
    for i, r in enumerate(rows):
        if not r.prompt_ids:
            raise DataError(f"'{cfg.input}': row {i} has empty prompt_ids; the first response token needs a prompt.")
    temps = [temperature_of(r) for r in rows]
    if len(set(temps)) > 1:
        other = next(i for i, t in enumerate(temps) if t != temps[0])
        raise DataError(f"'{cfg.input}': column 'logprob_temperature' is {temps[0]:g} in row 0 and {temps[other]:g} in row "
                        f"{other}; one update takes its log-probs at one temperature. Train on rollouts sampled at one "
                        f"sampling.temperature.")
    return rows


def dr_grpo_length(cfg: Config) -> int:
    """Dr. GRPO's constant length (loss_agg=seq-mean-token-sum-norm): drgrpo_max_len, else the generation budget
    the advantages' manifest records (the rollout's sampling.max_new_tokens, passed on by the advantage stage),
    the same every iteration; 0 for the other aggregations, which do not read it. A budget that is not
    recorded is a ConfigError naming drgrpo_max_len: the batch's longest response changes every iteration."""
    if cfg.loss_agg != "seq-mean-token-sum-norm":
        return 0
    if cfg.drgrpo_max_len:
        return cfg.drgrpo_max_len
    ds = schema.open_dataset(cfg.input, "advantages", verify_checksums=False)
    budgets = [(m or {}).get("max_new_tokens") for m in ds.manifests]
    if budgets and all(isinstance(b, int) and b > 0 for b in budgets):
        return max(budgets)
    raise ConfigError(f"loss_agg=seq-mean-token-sum-norm (Dr. GRPO) divides by a constant length, the generation "
                      f"budget, but the advantages '{cfg.input}' do not record the rollout's sampling.max_new_tokens "
                      f"(written from plain Parquet, or by an older advantage stage); set drgrpo_max_len to it.")


def temperature_of(sample: Sample) -> float:
    """The temperature the policy's log-probs of `sample` are taken at (the hand-off's log-probs are of logits / T):
    its logprob_temperature, 1 where the hand-off has none (written before the column)."""
    return 1.0 if sample.logprob_temperature is None else float(sample.logprob_temperature)


@dataclass
class MicroBatch:
    """Prompts left-padded, responses right-padded: response token t of every row sits at column P + t."""

    input_ids: torch.Tensor      # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    position_ids: torch.Tensor   # (B, P + R), following the attention mask
    response_ids: torch.Tensor   # (B, R)
    mask: torch.Tensor           # (B, R) bool: the response tokens trained on (not padding, not an environment's)
    fields: dict[str, torch.Tensor]  # (B, R) float per-token columns, 0 where masked
    rows: list[int]
    pixels: dict[str, torch.Tensor] = field(default_factory=dict)  # the prompts' images (vision-language)
    temperature: float = 1.0     # the policy's log-probs are of softmax(logits / temperature), as the sampler's

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device) -> "MicroBatch":
        move = lambda t: t.to(device)  # noqa: E731
        return MicroBatch(move(self.input_ids), move(self.attention_mask), move(self.position_ids),
                          move(self.response_ids), move(self.mask), {k: move(v) for k, v in self.fields.items()}, self.rows,
                          {k: move(v) for k, v in self.pixels.items()}, self.temperature)

    def model_kwargs(self, model) -> dict:
        """What the forward pass takes besides ids and mask: 1-D positions (unless the model places
        its tokens itself, Qwen2-VL's multimodal rope) and the pixel inputs."""
        pos = {} if modeling.own_positions(model) else {"position_ids": self.position_ids}
        return {**pos, **self.pixels}


def collate(samples: list[Sample], rows: list[int], pad_id: int, fields=TOKEN_FIELDS + ("pg_mask", "is_weight")) -> MicroBatch:
    """The `rows` of `samples` as one micro-batch; a per-token field is included when every row has it. Its
    temperature is the rows' (`temperature_of`; `load_batch` lets a batch hold one)."""
    P = max(len(samples[i].prompt_ids) for i in rows)
    R = max(max(len(samples[i].response_ids) for i in rows), 1)
    B = len(rows)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.bool)
    out = {k: torch.zeros((B, R), dtype=torch.float32) for k in fields
           if all(getattr(samples[i], k) is not None for i in rows)}
    for b, i in enumerate(rows):
        s = samples[i]
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[b, P - p:P] = torch.tensor(s.prompt_ids)
        ids[b, P:P + r] = torch.tensor(s.response_ids, dtype=torch.long)
        attn[b, P - p:P + r] = 1  # an environment's tokens are context: attended to, never trained on
        mask[b, :r] = s.trained()
        for k in out:
            out[k][b, :r] = torch.as_tensor(getattr(s, k), dtype=torch.float32)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    pixels = vision.batch_pixels([samples[i].pixels or {} for i in rows])
    temps = {temperature_of(samples[i]) for i in rows}
    if len(temps) != 1:
        raise DataError(f"a micro-batch mixes rows sampled at temperatures {sorted(temps)}; one update takes its "
                        f"log-probs at one temperature.")
    return MicroBatch(ids, attn, position_ids, ids[:, P:], mask, out, list(rows), pixels, temps.pop())


def minibatch_plan(n: int, cfg: Config) -> list[list[int]]:
    """Row indices of every update: `epochs` shuffles (fixed by seed and iteration), each cut into minibatches."""
    per_epoch = n // cfg.minibatch_size
    plan = []
    for epoch in range(cfg.epochs):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + cfg.iteration * 1_009 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        plan += [perm[k * cfg.minibatch_size:(k + 1) * cfg.minibatch_size] for k in range(per_epoch)]
    return plan


def micro_split(rows: list[int], size: int) -> list[list[int]]:
    """The rows of one minibatch in micro-batches of `size` (the last may be smaller)."""
    return [rows[j:j + size] for j in range(0, len(rows), size)]



def shard_ptx(ptx):
    """This rank's rows of every ptx micro-batch (`ptx.ptx_batch`'s (micro-batches, tokens)); the token
    count stays that of the whole update, so the ranks' shares add up to one process's ptx loss."""
    if ptx is None or distributed.world_size() == 1:
        return ptx
    micro, tokens = ptx
    out = []
    for mb in micro:
        n = mb["input_ids"].shape[0]
        if n < distributed.world_size():
            raise DataError(f"a ptx micro-batch has {n} examples, fewer than the {distributed.world_size()} ranks "
                            f"that share it; raise ptx_batch_size to at least {distributed.world_size()} x "
                            f"minibatch_size / micro_batch_size.")
        rows = distributed.shard(range(n))
        out.append({k: v[rows[0]:rows[-1] + 1] if v.shape[:1] == (n,) else v for k, v in mb.items()})
    return out, tokens
