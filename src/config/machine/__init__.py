"""What this machine changes about a config: the CPU defaults of a co-located run, the engine dtype,
the FP8 methods it can serve."""
