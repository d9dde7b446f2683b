"""Backend megatron's mixture-of-experts layers: what megatron-core's MoELayer needs around it.

The layers themselves are megatron-core's (grpo.trainer.megatron.layer_spec: MoELayer, TopKRouter,
SequentialMLP experts; grpo.trainer.megatron.model.moe_fields: routing that matches the HF
family's).
"""

from __future__ import annotations

import functools


@functools.cache
def define_missing_te_gemm() -> None:
    """megatron-core 0.16's router gating reads `te_general_gemm` (None meaning "use torch"), but
    its module binds that name only when Transformer Engine imports: without TE every router
    forward raises NameError. Bind it to None there, as megatron-core means it to be."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
