"""The same GRPO task on TRL's GRPOTrainer, for a side-by-side with benchmarks/e2e_bench.py.

    .venv/bin/python benchmarks/trl_bench.py [--env short-answer|long-brief] [--steps 8] [--prompts 4]
        [--group 8] [--max-tokens 16] [--lr 5e-4] [--precision default|auto|bf16|fp32]
        [--gradient-checkpointing off|on] [--micro-batch 8] [--model PATH] [--tag NAME]

Needs the `bench` extra (`pip install trl==1.16.0 matplotlib`). Matches the grpo run: the
embedded SmolLM2-135M-Instruct, the prompts of the same grpo environment (--env: same system
prompt, same examples) scored by that environment's own reward functions, prompts x group
completions per optimizer step (generated at once, trained in micro-batches of --micro-batch
sequences with gradient accumulation: without them, 64 long-brief sequences of ~400 tokens need
more than 24 GiB of activations), max completion tokens, learning rate (constant), grad-norm clip
1.0, no weight decay, LoRA r16 alpha 32 dropout 0 on the same linear layers, temperature 1.0, no
KL term, TRL's own loss and advantage scaling (1.16: token-level `dapo`, rewards scaled by the
group's std; --loss-type / --scale-rewards name others: run_all.py's speed comparison passes
`--scale-rewards none`, grpo's default advantage), no gradient checkpointing (as grpo's bench
configs; TRL's default is on). Precision: `auto` (the default here) is the transformers
CPU-training guide's set-up: fp32 master weights, bf16 autocast where the CPU has AMX /
AVX512-BF16 (matmuls in bf16, like grpo's bf16 default), else fp32; `default` leaves it to TRL
(trl 1.16: float32 weights, as it loads a model without a dtype in float32, and `bf16=True`; the
result file records the weights' dtype). `use_cpu=True`; generation is HF `generate` (`use_vllm=False`: TRL's vLLM paths need CUDA).

Wall clock per optimizer step (generation + scoring + forward/backward + update) comes from a
callback, and the generation and scoring part of each step from a timer around TRL's
_generate_and_score_completions (train_step_s = the rest: TRL's trainer cost); model loading is
excluded from loop_wall_s and included in process_wall_s.
Writes benchmarks/results/trl_<machine>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from e2e_bench import RESULTS, ROOT, TASKS, load_average, machine_info, machine_label, versions

sys.path.insert(0, str(TASKS))  # the bench's own tasks (env ids like "three_words:load_environment")


def cpu_has_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return "amx_bf16" in flags or "avx512_bf16" in flags


def load_env(env_id: str, num_examples: int, seed: int) -> Any:
    from grpo.config.orchestrator import EnvConfig
    from grpo.envs import load_environment

    return load_environment(EnvConfig(id=env_id, args={"num_examples": num_examples, "seed": seed}))


def grpo_prompt_order(env_id: str, seed: int, num_prompts: int) -> tuple[Any, list[int]]:
    """The environment as grpo's run loads it (its default arguments) and the indices of the first
    `num_prompts` examples grpo's buffer draws with `seed`. TRL given these rows in this order,
    unshuffled, trains each step on the prompts grpo's run with the same seed trains on, so the two
    reward curves differ by what each side learned, not by which prompts (of unequal difficulty) a
    step happened to draw."""
    from grpo.config.orchestrator import BufferConfig, EnvConfig
    from grpo.envs import load_environment
    from grpo.orchestrator.buffer import Buffer

    env = load_environment(EnvConfig(id=env_id))
    buffer = Buffer([env], BufferConfig(), seed)
    return env, [buffer.sample()[1] for _ in range(num_prompts)]


def build_dataset(env: Any, indices: list[int] | None = None) -> Any:
    """The env's prompts (those at `indices`, in that order, where given) as chat messages;
    `example_index` lets the reward find the example."""
    from datasets import Dataset

    order = range(len(env.examples)) if indices is None else indices
    rows = [{"prompt": env.prompt_messages(env.examples[i]), "example_index": i} for i in order]
    return Dataset.from_list(rows)


def env_reward(env: Any) -> Any:
    """TRL's reward signature around the grpo env's own scoring (the same reward as grpo's run)."""
    import asyncio

    async def score_all(completions: list[Any], indices: list[int]) -> list[float]:
        scores = []
        for completion, index in zip(completions, indices, strict=True):
            # conversational completions are lists of chat messages, plain ones strings
            messages = (
                completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            )
            scores.append((await env.score(env.examples[index], messages, {})).reward)
        return scores

    def reward(completions: list[Any], example_index: list[int], **_: Any) -> list[float]:
        return asyncio.run(score_all(completions, example_index))

    reward.__name__ = f"{env.name}_reward"  # TRL logs each reward function under its name
    return reward


def step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        """Monotonic stamps at each optimizer step's start and end, and every logged record."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.starts.append(time.monotonic())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.monotonic())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "reward" in logs:
                self.logs.append({k: float(v) for k, v in logs.items() if isinstance(v, int | float)})

    return StepTimer()


def time_generation(trainer: Any) -> list[tuple[float, float]]:
    """Monotonic (start, end) of every call of TRL's generation and scoring, so a step's training
    time is the step less them (the method GRPOTrainer 1.16 calls from _prepare_inputs)."""
    spans: list[tuple[float, float]] = []
    generate = trainer._generate_and_score_completions

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        out = generate(*args, **kwargs)
        spans.append((started, time.monotonic()))
        return out

    trainer._generate_and_score_completions = timed
    return spans


def generation_seconds(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(min(e, end) - max(s, start) for s, e in spans if s < end and e > start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="max completion tokens")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--env", default="short-answer", help="grpo environment id (short-answer, long-brief)"
    )
    parser.add_argument("--precision", choices=["default", "auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--gradient-checkpointing", choices=["off", "on"], default="off")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    parser.add_argument("--tag", default="", help="suffix for the result file name (e.g. smoke)")
    parser.add_argument("--seed", type=int, default=42, help="TRL's seed (LoRA init, prompt order, sampling)")
    parser.add_argument(
        "--prompt-order",
        choices=["shuffled", "grpo"],
        default="shuffled",
        help="shuffled: TRL's own (its dataset sampler, seeded); grpo: the prompts grpo's run with "
        "the same --seed draws, step by step (learning_bench.py)",
    )
    parser.add_argument("--loss-type", default=None, help="GRPOConfig.loss_type (default: TRL's, dapo)")
    parser.add_argument(
        "--scale-rewards",
        default=None,
        help="GRPOConfig.scale_rewards: group, batch, none (default: TRL's, group)",
    )
    args = parser.parse_args()

    started = time.monotonic()
    load_before = load_average()
    import torch
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from grpo.config.trainer import DEFAULT_LORA_TARGETS
    from grpo.models import embedded

    model = args.model or str(embedded.build())
    # "default": leave dtype and bf16 to TRL (checkpoint dtype, bf16=True); else fp32 master weights
    precision: dict[str, Any] = {}
    if args.precision != "default":
        bf16 = args.precision == "bf16" or (args.precision == "auto" and cpu_has_bf16())
        precision = {"bf16": bf16, "model_init_kwargs": {"dtype": torch.float32}}
    batch = args.prompts * args.group
    micro_batch = min(args.micro_batch, batch)
    if batch % micro_batch:
        raise ValueError(f"--micro-batch {micro_batch} must divide prompts x group = {batch}")
    out_dir = Path("/tmp") / f"trl-bench-{int(time.time())}"
    config = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        **precision,
        use_vllm=False,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        # one generation of `batch` completions and one optimizer step per `batch` (TRL's default
        # steps_per_generation = gradient_accumulation_steps); "dapo" normalises over all of it
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=batch // micro_batch,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        beta=0.0,
        # TRL's own defaults (1.16: "dapo", "group") unless a flag names one
        **({"loss_type": args.loss_type} if args.loss_type else {}),
        **({"scale_rewards": args.scale_rewards} if args.scale_rewards else {}),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        shuffle_dataset=args.prompt_order == "shuffled",
    )
    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=list(DEFAULT_LORA_TARGETS),
        task_type="CAUSAL_LM",
    )
    timer = step_timer()
    if args.prompt_order == "grpo":
        env, indices = grpo_prompt_order(args.env, args.seed, args.steps * args.prompts)
        dataset = build_dataset(env, indices)
    else:
        env = load_env(args.env, num_examples=1000, seed=42)
        dataset = build_dataset(env)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=env_reward(env),
        args=config,
        train_dataset=dataset,
        peft_config=lora,
        callbacks=[timer],
    )
    weight_dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    generation_spans = time_generation(trainer)
    trainer.train()
    process_wall = time.monotonic() - started

    step_s = [end - start for start, end in zip(timer.starts, timer.ends, strict=True)]
    generation_s = [
        generation_seconds(generation_spans, s, e) for s, e in zip(timer.starts, timer.ends, strict=True)
    ]
    completion_tokens = [log["completions/mean_length"] * batch for log in timer.logs]
    loop_wall = timer.ends[-1] - timer.starts[0]
    result: dict[str, Any] = {
        "kind": "trl",
        "mode": "trl",
        "tag": args.tag,
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": load_average()},
        "versions": versions("torch", "transformers", "peft", "trl", "accelerate", "datasets"),
        "config": {
            "model": model,
            "env": args.env,
            "precision": f"{weight_dtype} weights" + (", bf16 autocast" if config.bf16 else ""),
            "precision_flag": args.precision,
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "completions_per_prompt": args.group,
            "micro_batch": micro_batch,
            "max_completion_tokens": args.max_tokens,
            "learning_rate": args.lr,
            "prompt_order": args.prompt_order,
            "seed": args.seed,
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "targets": list(DEFAULT_LORA_TARGETS)},
            "grpo_config": {
                k: getattr(config, k)
                for k in (
                    *("use_vllm", "use_cpu", "bf16", "gradient_checkpointing", "loss_type", "scale_rewards"),
                    *("beta", "temperature"),
                )
            },
            "torch_threads": torch.get_num_threads(),
        },
        "command": " ".join(["python", "benchmarks/trl_bench.py", *sys.argv[1:]]),
        "env": args.env,
        "dtype": {"configured": args.precision, "weights": weight_dtype, "bf16_autocast": bool(config.bf16)},
        "process_wall_s": process_wall,
        "num_steps": len(step_s),
        "loop_wall_s": loop_wall,
        "step_time_s": step_s,
        "generation_s": generation_s,
        "train_step_s": [step - gen for step, gen in zip(step_s, generation_s, strict=True)],
        "completion_tokens": sum(completion_tokens),
        "completion_tokens_per_s": sum(completion_tokens) / loop_wall,
        "reward_curve": [log["reward"] for log in timer.logs],
        "completion_len_curve": [log["completions/mean_length"] for log in timer.logs],
        "step_end_s": [end - timer.starts[0] for end in timer.ends],
    }
    if len(step_s) > 1:
        steady_wall = timer.ends[-1] - timer.ends[0]
        result["steady_step_s"] = steady_wall / (len(step_s) - 1)
        result["steady_completion_tokens_per_s"] = sum(completion_tokens[1:]) / steady_wall
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    out = RESULTS / f"trl_{machine_label()}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("loop_wall_s", "steady_step_s", "completion_tokens_per_s")
    print(json.dumps({"file": str(out.relative_to(ROOT)), **{k: result.get(k) for k in keys}}))
    print("reward:", [round(r, 3) for r in result["reward_curve"]], flush=True)


if __name__ == "__main__":
    main()
