"""The blocks inside a config file (orch.yaml sampling, advantage, client, env; train.yaml loss,
megatron; infer.yaml supervisor; ...), one model each."""
