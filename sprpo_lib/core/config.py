"""The update's two configurations, apart: :class:`UpdateConfig` holds what App. B names (the
paper's knobs; verl's actor where the paper is silent), :class:`SpeedConfig` the levers that
change how fast an update runs, never what it computes (the same steps up to float rounding;
each lever's ``False`` or ``0`` is the reference path, verl's way).  The actor
(:class:`sprpo_lib.core.actor.Actor`) takes both."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from annotated_types import Ge, Gt, Interval

from sprpo_lib.core.advantages import AdvantageConfig
from sprpo_lib.core.losses import KL_ESTIMATORS, PPOLossConfig
from sprpo_lib.infra.io import OMIT_AT_DEFAULT
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.model.layers import QUERY_CHUNK, check_attention_chunk, check_attention_kernel


@dataclass
class UpdateConfig:
    """The PPO update (App. B, Table 2; verl's actor where the paper is silent).

    Attributes:
        lr, betas, weight_decay: Adam's (Table 2's learning rate in the paper profile).
        grad_clip: global-norm clip before each optimizer step.
        micro_batch: step rows per forward/backward (gradients accumulate: exact for the token-mean).
        ppo_mini_batch_size: step rows per optimizer step (None: the whole batch, Alg. 1 line 6's one step).
        ppo_epochs: passes over the batch; old log-probs are taken once, at theta_k.
        kl_coef, kl_type: KL loss to the starting policy (verl's ``use_kl_loss``; the paper states none).
        estimator: the advantage estimator (``gigpo``).
        adv: GiGPO's options (:class:`sprpo_lib.core.advantages.AdvantageConfig`).
        loss_name, loss: the policy loss and its clip ratios and entropy coefficient.
    """

    lr: Annotated[float, Gt(0)] = 3e-6
    betas: tuple[Annotated[float, Interval(ge=0, lt=1)], Annotated[float, Interval(ge=0, lt=1)]] = (0.9, 0.999)
    weight_decay: Annotated[float, Ge(0)] = 0.0
    grad_clip: Annotated[float, Ge(0)] = 1.0
    micro_batch: Annotated[int, Ge(1)] = 8
    ppo_mini_batch_size: Annotated[int, Ge(1)] | None = None
    ppo_epochs: Annotated[int, Ge(1)] = 1
    kl_coef: Annotated[float, Ge(0)] = 0.0
    kl_type: str = "low_var_kl"
    estimator: str = "gigpo"
    adv: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss_name: str = "ppo_dual_clip"
    loss: PPOLossConfig = field(default_factory=PPOLossConfig)

    def __post_init__(self):
        check_ranges(self)
        if self.kl_type not in KL_ESTIMATORS:
            raise ValueError(f"update.kl_type must be one of {KL_ESTIMATORS}, got {self.kl_type!r}")


@dataclass
class SpeedConfig:
    """How fast the update runs, not what it computes: each lever gives the same steps up to
    float rounding, and its ``False`` / ``0`` is the reference path (verl's).  The warm start's
    SFT takes ``fused_lora``, ``native_gqa``, ``attention`` and ``attention_chunk``.

    Attributes:
        skip_zero_adv: passes over the surrogate alone skip rows with advantage 0 (their gradient is 0).
        prefix_min: a token prefix several rows share (at least this long) is computed once per pass (0: every row whole).
        micro_batch_tokens: a micro-batch also keeps rows x longest row within this many tokens (None: rows decide).
        grad_checkpointing: each decoder layer keeps only its input and is recomputed in the backward.
        reuse_frozen: optimizer steps start from the hidden states below the lowest LoRA layer, kept from the old-log-prob pass.
        fused_kernels: RMSNorm, SwiGLU and the rotary embedding as compiled kernels (eager where no compiler builds them).
        fused_lora: an adapted linear as one function, the adapter's output accumulated into the base's.
        fused_entropy: log-probs and entropy from one softmax.
        native_gqa: masked grouped-query attention on a CPU reads each key/value head for its query heads.
        first_step_logp: the first step's rows take their old log-probs from that step's own forward at theta_k.
        attention: ``auto`` (16-bit attention as float32-accumulated matmuls on a CPU, SDPA otherwise), ``sdpa``, ``matmul``.
        attention_chunk: the matmuls split a causal call into query chunks of this many queries (0: one product).
        replay_graph_gb: SPrPO's replay reuses the update's graph below the LoRA layers, up to this many GiB (0: none).
    """

    skip_zero_adv: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    prefix_min: Annotated[int, Ge(0)] = field(default=16, metadata=OMIT_AT_DEFAULT)
    micro_batch_tokens: Annotated[int, Ge(1)] | None = field(default=None, metadata=OMIT_AT_DEFAULT)
    grad_checkpointing: bool = field(default=False, metadata=OMIT_AT_DEFAULT)
    reuse_frozen: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    fused_kernels: bool = field(default=False, metadata=OMIT_AT_DEFAULT)
    fused_lora: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    fused_entropy: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    native_gqa: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    first_step_logp: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    attention: str = field(default="auto", metadata=OMIT_AT_DEFAULT)
    attention_chunk: Annotated[int, Ge(0)] = field(default=QUERY_CHUNK, metadata=OMIT_AT_DEFAULT)
    replay_graph_gb: Annotated[float, Ge(0)] = field(default=0.0, metadata=OMIT_AT_DEFAULT)

    def __post_init__(self):
        check_ranges(self)
        check_attention_kernel(self.attention)
        check_attention_chunk(self.attention_chunk)

