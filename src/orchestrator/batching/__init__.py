"""From scored groups to the trainer's batch: advantages (and per-turn credit), filters and the groups
the trainer would refuse, packing into rows with shared prefixes."""
