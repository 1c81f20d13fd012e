"""train (with train.overlong), eval and sft: the objective, optimizer and evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from looprl.config.base import Section


class OverlongConfig(Section):
    """What happens to samples that run long (DAPO, Yu et al., 2025). A sample's length
    is the sampled tokens of its longest model call (each call is bounded on its own)."""

    soft_penalty_buffer_tokens: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment: a sample longer than max_tokens - "
        "this gets (max_tokens - buffer - length) / buffer (down to -1 at max_tokens, -1 "
        "beyond) x soft_penalty_factor added to its reward before advantages; 0 is off.",
    )
    soft_penalty_factor: float = Field(
        1.0, ge=0, description="Scale of the soft overlong penalty (at most this much off)."
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: a sample cut off by the token limit "
        "(finish_reason length, in any of its calls) is left out of the loss; its reward "
        "still counts in its group's baseline.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="L_max of the soft penalty, in tokens; None: sampling.max_new_tokens.",
    )


# Each objective's paper clip range (eps_low, eps_high): PPO's usual 0.2; GSPO v2
# section 5.1; CISPO: no lower bound (MiniMax-M1), a cap of 5 (ScaleRL).
OBJECTIVE_CLIP = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 4.0)}


class TrainConfig(Section):
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "distill"] = Field(
        "grpo",
        description="Advantage estimator; 'distill' is on-policy distillation instead: each "
        "sampled token's advantage is log pi_teacher - log pi_student (the per-token "
        "reverse KL to train.teacher_path's model, on the student's own samples).",
    )
    credit: Literal["per_call", "per_turn", "episode", "gae"] = Field(
        "per_turn",
        description="How a multi-turn rollout's calls share its reward: 'per_call' (each "
        "call's own reward, for an env episode its return-to-go, baselined against every "
        "call of its group), 'per_turn' (baselined only against the group's calls at the "
        "same turn), 'episode' (the episode return's advantage against the group's other "
        "rollouts, given to each of its calls), 'gae' (GAE over the calls' step rewards "
        "with train.gamma and train.gae_lambda, the baseline each turn's mean return in "
        "the group). Single-turn rollouts train the same under all four. per_turn is the "
        "default: on FrozenLake (bench/credit.py) it learned as fast as per_call or "
        "faster, and episode fell behind where steps have their own rewards.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="train.credit=gae: the discount per turn.")
    gae_lambda: float = Field(
        0.95,
        ge=0,
        le=1,
        description="train.credit=gae: lambda (1: discounted return minus the turn's "
        "baseline; 0: one-step TD error).",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus: loss - entropy_coef x the sampled tokens' entropy "
        "(aggregated as the loss), against collapse onto one reply; 0 is off.",
    )
    entropy_floor: float = Field(
        0.0,
        ge=0,
        description="With entropy_coef > 0: the bonus applies only in steps whose batch "
        "entropy, estimated as the mean -log pi of the sampled tokens, is below this (nats "
        "per token); 0 applies it in every step.",
    )
    teacher_path: str | None = Field(
        None,
        description="The teacher of train.algorithm=distill: a Hugging Face folder, GGUF or "
        "looprl output with the policy's tokenizer, loaded frozen beside the trainer.",
    )
    objective: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo",
        description="Policy loss: 'ppo' (clipped token ratio, clip-higher), 'gspo' (GSPO: "
        "length-normalized sequence ratio, clipped per sequence), 'cispo' (CISPO: the "
        "clipped token ratio as a stop-gradient weight on a REINFORCE term, no token "
        "dropped). Formulas and papers in the docs' algorithm table (docs/algorithms.md).",
    )
    lr: float = Field(2e-5, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Schedule after warmup."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    eps_clip: float | None = Field(
        None,
        gt=0,
        description="Lower clip of the objective's ratio: >= 1 - eps_clip. None: the "
        "objective's paper value (ppo 0.2, gspo 3e-4, cispo 1, i.e. no lower bound).",
    )
    eps_clip_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip (clip-higher): ratio <= 1 + eps_clip_high. None: eps_clip "
        "when that is set, else the objective's paper value (ppo 0.2, gspo 4e-4, cispo 4).",
    )
    mismatch_correction: Literal["none", "tis", "mis"] = Field(
        "mis",
        description="What the behavior weight pi_prox/pi_behav (the engine-vs-trainer and "
        "staleness importance weight of decoupled PPO) does to each token's loss: 'none' "
        "(not applied; needs rollout.max_head_offpolicyness=0), 'tis' (multiplied by "
        "min(w, mismatch_cap)), 'mis' (multiplied by w, tokens or sequences with w outside "
        "[mismatch_floor, mismatch_cap] left out of the loss).",
    )
    mismatch_cap: float = Field(
        5.0, gt=0, description="tis: the weight's truncation C; mis: its upper threshold."
    )
    mismatch_floor: float = Field(
        0.0,
        ge=0,
        description="mis only: weights below this are left out too (e.g. 0.5, as IcePop); "
        "0 leaves none out.",
    )
    mismatch_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="The weight per token, or one per sequence on all its tokens: "
        "'sequence' the product of its tokens' weights, 'geometric' their geometric mean.",
    )
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    loss_agg: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "turn_token_mean"
    ] = Field(
        "token_mean",
        description="How per-token losses are reduced over the batch: 'token_mean' (every "
        "sampled token weighs the same), 'seq_mean_token_mean' (each sample's mean), "
        "'seq_mean_token_sum_norm' (Dr. GRPO: token sums over a constant), "
        "'turn_token_mean' (token_mean within each call position of multi-turn rollouts, "
        "each position weighted by its share of the calls: a short last reply weighs as "
        "much as a long first one; token_mean for one-call rollouts).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty to the frozen reference model; 0 loads no reference model.",
    )
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per epoch.")
    max_tokens_per_mb: int | None = Field(
        None,
        ge=16,
        description="Token budget of one micro-batch (first-fit-decreasing packing). None: "
        "4096 on a CPU; on a GPU, derived at start from its free memory and the model's "
        "size (logged as 'Memory: ...').",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="What the trainer's forward and backward compute in: bfloat16 is "
        "autocast over float32 master weights (model.dtype). auto: bfloat16 where bf16 "
        "autocast measured faster than float32 on this machine, else float32; the decision "
        "is logged at start.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass "
        "instead of keeping them: less trainer memory for ~1.3x the step time.",
    )
    total_steps: int = Field(12, ge=0, description="Training steps to run.")

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the objective's ratio clip, the None fields resolved."""
        low, high = OBJECTIVE_CLIP[self.objective]
        if self.eps_clip is not None:
            low = high = self.eps_clip
        return low, high if self.eps_clip_high is None else self.eps_clip_high

    @model_validator(mode="after")
    def _teacher_for_distill(self) -> TrainConfig:
        if self.algorithm == "distill" and not self.teacher_path:
            raise ValueError(
                "algorithm=distill needs train.teacher_path: the model whose per-token "
                "logprobs the student learns to match"
            )
        if self.teacher_path and self.algorithm != "distill":
            raise ValueError(
                f"teacher_path={self.teacher_path!r} is used by algorithm=distill only, "
                f"not {self.algorithm}; remove it or set train.algorithm=distill"
            )
        return self

    @model_validator(mode="after")
    def _entropy_floor_needs_the_bonus(self) -> TrainConfig:
        if self.entropy_floor > 0 and self.entropy_coef == 0:
            raise ValueError(
                f"entropy_floor={self.entropy_floor:g} switches the entropy bonus on below "
                "it, but train.entropy_coef is 0: set entropy_coef (e.g. 0.01) or the "
                "floor to 0"
            )
        return self

    @model_validator(mode="after")
    def _mismatch_thresholds_apply(self) -> TrainConfig:
        if self.mismatch_floor > 0 and self.mismatch_correction != "mis":
            raise ValueError(
                f"mismatch_floor={self.mismatch_floor:g} applies to mismatch_correction=mis "
                f"only, not {self.mismatch_correction}; set it to 0 or use mis"
            )
        if self.mismatch_floor >= self.mismatch_cap:
            raise ValueError(
                f"mismatch_floor={self.mismatch_floor:g} must be below mismatch_cap="
                f"{self.mismatch_cap:g}, or every token is left out of the loss"
            )
        return self


class EvalConfig(Section):
    every_steps: int = Field(4, ge=0, description="Evaluate every N steps (0: start/end only).")
    max_new_tokens: int = Field(48, ge=1, description="Tokens per greedy eval answer.")
    size: int | None = Field(None, ge=1, description="Held-out rows to use; None uses all.")
    temperature: float = Field(
        0.0,
        ge=0.0,
        description="0: greedy held-out rollouts (the default). Above 0 they are sampled at "
        "this temperature (top_p and top_k from sampling): the success of the policy as it "
        "acts when trained, where its most likely reply is not (a multi-turn env agent).",
    )
    save_best: bool = Field(
        True,
        description="Where the run evaluates every eval.every_steps (> 0): save the policy at "
        "its best held-out evaluation to the run's best/ folder beside model/ (with "
        "model.lora the adapter, and its merged copy under model.lora.save_merged), "
        "rewritten whenever a later evaluation beats every earlier one (a tie keeps the "
        "earlier). The evaluation before training counts: when no trained step beats it, "
        "best/ is not written (the untrained policy is model.path itself).",
    )


class SftConfig(Section):
    data_path: str | None = Field(
        None,
        description='`looprl sft`\'s training chats: a JSONL file, one {"messages": [...]} '
        "(OpenAI chat format) per line; the loss is on the assistant messages' tokens.",
    )
    eval_path: str | None = Field(
        None, description="Held-out chats in the same format, scored by their loss."
    )
    epochs: int = Field(1, ge=1, description="Passes over the training chats.")
    batch_size: int = Field(8, ge=1, description="Chats per optimizer step.")
    max_tokens: int = Field(
        2048, ge=8, description="Longest chat in tokens; longer ones are skipped and counted."
    )
