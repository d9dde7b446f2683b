"""Training batches, orchestrator -> trainer: the batch type, its wire format and checks, and the
memory, filesystem and zmq transports behind one factory."""
