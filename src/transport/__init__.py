"""How data crosses component boundaries, one folder per concern.

batches/ (orchestrator -> trainer): `batches.factory.batch_sender_for` / `batch_receiver_for` pick the
filesystem or zmq transport from the config; both cross process boundaries as one safetensors blob
(`batches.wire`). Co-located runs pass batches in memory (`batches.memory`).
weights/ (trainer -> inference): broadcast folders + STABLE (`weights.filesystem`) or a
torch.distributed collective, NCCL or gloo (`weights.collective`, announced by `weights.announce`).
run_dir.py: the trainer's part of the run directory the orchestrator reads. Nothing here imports
torch at import time.
"""
