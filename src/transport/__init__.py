"""How data crosses component boundaries: training batches (orchestrator -> trainer) and policy
weights (trainer -> inference). Each direction has one small interface and one factory that
picks the implementation from the config's `type` field."""
