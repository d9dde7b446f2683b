"""How users name keys and values: the key tables grpo config show prints, renamed keys, paths relative
to their file, functions by name."""
