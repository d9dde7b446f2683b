"""Making rollouts: prompts rendered to tokens, sampling settings, one group generated and scored (tool
calls, partial rollouts across policy updates)."""
