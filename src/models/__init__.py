"""Where model weights come from: offline resolution of model ids and the embedded default model."""
