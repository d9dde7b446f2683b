"""How data crosses component boundaries: training batches (orchestrator -> trainer) and policy
weights (trainer -> inference).

Batches: `factory.batch_sender_for` / `factory.batch_receiver_for` pick `batch_filesystem` or
`batch_zmq` from the config; both cross process boundaries as one safetensors blob (`wire`).
Co-located runs pass batches in memory (`batch_memory`). Weights: `weights_filesystem`
(broadcast folders + STABLE) and `weights_collective` (torch.distributed, NCCL or gloo). Nothing
here imports torch at import time.
"""
