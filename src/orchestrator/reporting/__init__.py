"""What a run reports: step metrics (metrics.jsonl, W&B, terminal), the rollouts of each step on disk,
and grpo-report's plots."""
