"""How data crosses component boundaries: training batches (orchestrator -> trainer) and policy
weights (trainer -> inference).

Batches: `factory.batch_sender_for` / `factory.batch_receiver_for` pick `batch_filesystem`,
`batch_zmq` or `batch_memory` from the config; all cross process boundaries as one safetensors
blob (`wire`). Weights: `weights_filesystem` (broadcast folders + STABLE) and
`weights_collective` (torch.distributed, NCCL or gloo). Nothing here imports torch at import
time.
"""
