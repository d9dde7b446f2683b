"""Who may read what a grpo process writes: the process's umask, set once for the whole process.

A run directory holds the prompts and completions of every rollout, checkpoints, published
policies, the batch spool and the engine's log; on a machine other people log into, the default
umask (022) lets all of them read it. grpo's commands start with 077 (files 0600, folders 0700),
and `share_with_group: true` (any config file; it reaches the others) relaxes it to 027 so the
owner's group can read but not write. The umask is inherited by every child process (vLLM's engine
and workers, torchrun ranks), so their files follow it too.
"""

from __future__ import annotations

import os

PRIVATE_UMASK = 0o077
"""Files 0600, folders 0700."""

GROUP_UMASK = 0o027
"""Files 0640, folders 0750: the group reads, nobody else does."""


def restrict_new_files(share_with_group: bool = False) -> int:
    """Set the umask for the files this process creates from now on; returns the one before."""
    return os.umask(GROUP_UMASK if share_with_group else PRIVATE_UMASK)
