"""`grpo doctor`'s checks (grpo.cli.doctor is the command): a short co-located run of the embedded
model (selfcheck_run) and what it shows (checks)."""
