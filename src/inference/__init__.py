"""The vLLM inference service: server launcher (process or background thread), worker extension
for weight updates and weight export, and the async HTTP client the orchestrator uses."""
