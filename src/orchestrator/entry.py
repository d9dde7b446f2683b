"""The orchestrator's entry point: build environments and the tokenizer, then run the loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs.loading import load_environment
from grpo.envs.rewards import REWARD_POOL
from grpo.inference.types import RolloutClient
from grpo.orchestrator.images.prompts import image_prompter_for
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.transport.batches.interfaces import BatchSender


async def run(
    cfg: OrchestratorConfig,
    client: RolloutClient,
    sender: BatchSender,
    run_dir: Path,
    tokenizer_path: str,
    stop: asyncio.Event | None = None,
    teacher_client: RolloutClient | None = None,
) -> None:
    """Run until cfg.max_steps batches are sent or `stop` is set. The caller owns client and sender;
    a teacher client is built here from teacher_model.client unless one is given."""
    tokenizer = await asyncio.to_thread(ChatTokenizer.from_path, tokenizer_path, cfg.chat_template_kwargs)
    configure_rewards(cfg, client)
    envs = await asyncio.to_thread(lambda: [load_environment(e) for e in cfg.env])
    eval_cfg = cfg.eval
    eval_envs = (
        await asyncio.to_thread(lambda: [load_environment(e) for e in eval_cfg.env]) if eval_cfg else []
    )
    image_prompter = await asyncio.to_thread(
        image_prompter_for,
        [*envs, *eval_envs],
        tokenizer_path,
        cfg.partial_rollouts,
        cfg.teacher_model is not None,
    )
    own_teacher = (
        teacher_client is None and cfg.teacher_model is not None and cfg.teacher_model.client is not None
    )
    if own_teacher:
        from grpo.inference.client import InferenceClient

        assert cfg.teacher_model is not None and cfg.teacher_model.client is not None
        teacher_client = InferenceClient(cfg.teacher_model.client)
    orchestrator = Orchestrator(
        cfg,
        client,
        sender,
        Path(run_dir),
        tokenizer,
        envs,
        eval_envs=eval_envs,
        stop=stop,
        teacher_client=teacher_client,
        image_prompter=image_prompter,
    )
    try:
        await orchestrator.run()
    finally:
        if own_teacher and teacher_client is not None:
            await teacher_client.close()


def configure_rewards(cfg: OrchestratorConfig, client: RolloutClient) -> None:
    """Size the sync-reward thread pool, and tell `judge: {base_url: self}` where the run's own
    inference server is: the client's first server (in co-located mode known only now), the policy's
    base model name, the API key the client sends."""
    from grpo.envs.judge import Endpoint, use_own_server
    from grpo.utils.auth import secret_from_env

    REWARD_POOL.resize(cfg.reward_threads)
    base_urls: list[str] = list(getattr(client, "base_urls", None) or [])
    if not base_urls or not cfg.model.name:
        use_own_server(None)
        return
    key = secret_from_env(cfg.client.api_key_var)
    use_own_server(Endpoint(base_urls[0], cfg.model.name, None if key is None else key.decode()))
