# Settings shared by every LPO recipe (the paper's Section 5 / Appendix D.3 settings).
# Sourced by examples/scripts/*.sh; each task file adds model/data/batch sizes, each method
# file adds the estimator. Flags are OpenRLHF 0.11.2's dotted flags plus ours (--lpo.*).
COMMON_ARGS=(
  --rollout.n_samples_per_prompt 8          # K = 8 responses per prompt
  --rollout.temperature 1.0 --rollout.top_p 1.0
  --actor.adam.lr 1e-6 --actor.adam.betas 0.9 0.999 --actor.adam.weight_decay 0.1
  --actor.lr_scheduler constant --actor.lr_warmup_ratio 0
  --actor.eps_clip 0.2
  --algo.kl.init_coef 0                     # no KL penalty, no reference model
  --train.max_epochs 1
  --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2
  --actor.gradient_checkpointing_enable
  --train.seed 42
)
