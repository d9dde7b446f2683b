"""Every touch point of vLLM internals, in one folder, for the tested version range.

vLLM moves its internals between releases (the OpenAI server moved from
`vllm.entrypoints.openai` to `vllm.entrypoints.launchers` in 0.32). Everything grpo needs from
below vLLM's public API lives here, so a new release means reviewing this folder: the supported
version and vLLM's own argument parser (`version.py`), building and serving the OpenAI app
(`app.py`), the engine core's and workers' process lifetime (`engine_process.py`), and the engine
worker's model access and CPU weight layout (`cpu_weights.py`), its float32 head kept rather than
cast each step (`cpu_float32_head.py`), the CPU engine's 16-token KV blocks (`cpu_block_size.py`)
and queue readers that block rather than spin (`cpu_message_queue.py`, applied in vLLM's own
processes by grpo's vLLM plugin, `plugin.py`), and the CPU engine's routing
capture with vLLM's naming of engine requests (`routing_capture.py`). The server is reached at its 0.32
places only: serving also needs 0.32's app_state and models modules, so falling back to the older
places would only move the ImportError.

Nothing here imports vLLM at module import time: the CLI imports these modules while parsing.
"""
