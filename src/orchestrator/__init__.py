"""The orchestrator: rollouts in flight, scoring, advantages, packing, batches to the trainer."""
