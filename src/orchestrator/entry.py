"""The orchestrator's entry point: build environments and the tokenizer, then run the loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs.loading import load_environment
from grpo.inference.types import RolloutClient
from grpo.orchestrator.loop import Orchestrator
from grpo.orchestrator.tokenizer import ChatTokenizer
from grpo.transport.interfaces import BatchSender


async def run(
    cfg: OrchestratorConfig,
    client: RolloutClient,
    sender: BatchSender,
    run_dir: Path,
    tokenizer_path: str,
    stop: asyncio.Event | None = None,
    teacher_client: RolloutClient | None = None,
) -> None:
    """Run until cfg.max_steps batches are sent or `stop` is set. The caller owns client and sender."""
    tokenizer = await asyncio.to_thread(ChatTokenizer.from_path, tokenizer_path)
    envs = await asyncio.to_thread(lambda: [load_environment(e) for e in cfg.env])
    eval_envs = (
        await asyncio.to_thread(lambda: [load_environment(e) for e in cfg.eval.env]) if cfg.eval else []
    )
    orchestrator = Orchestrator(
        cfg, client, sender, Path(run_dir), tokenizer, envs, eval_envs, stop, teacher_client
    )
    await orchestrator.run()
