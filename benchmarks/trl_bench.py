"""The same GRPO task on TRL's GRPOTrainer, for a side-by-side with benchmarks/e2e_bench.py.

    .venv/bin/python benchmarks/trl_bench.py [--steps 8] [--prompts 4] [--group 8] [--max-tokens 16]
        [--lr 5e-4] [--precision auto|bf16|fp32] [--model PATH]

Needs the `bench` extra (`pip install trl==1.16.0 matplotlib`). Matches the grpo run: the
embedded SmolLM2-135M-Instruct, short-answer prompts (same system prompt, same examples) and the
same reward function (grpo.envs.short_answer.short_answer_reward), prompts x group completions per
optimizer step, max completion tokens, learning rate (constant), grad-norm clip 1.0, no weight
decay, LoRA r16 alpha 32 dropout 0 on the same linear layers, temperature 1.0, no KL term, token-
level loss over the step (TRL's `dapo`), advantages = reward - group mean (`scale_rewards="none"`,
grpo's default advantage). CPU set-up as the transformers CPU-training guide says: `use_cpu=True`,
bf16 autocast (`bf16=True`, fp32 master weights) where the CPU has bf16 instructions (AMX /
AVX512-BF16), else fp32. Generation is HF `generate` (`use_vllm=False`): TRL's vLLM paths need CUDA.

Wall clock per optimizer step (generation + scoring + forward/backward + update) comes from a
callback; model loading is excluded from loop_wall_s and included in process_wall_s.
Writes benchmarks/results/trl_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from e2e_bench import RESULTS, ROOT, load_average, machine_info, machine_label, versions


def cpu_has_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return "amx_bf16" in flags or "avx512_bf16" in flags


def build_dataset(num_examples: int, seed: int) -> Any:
    from datasets import Dataset

    from grpo.envs.short_answer import load_environment

    env = load_environment(num_examples=num_examples, seed=seed)
    rows = [{"prompt": env.prompt_messages(example), "answer": example["answer"]} for example in env.examples]
    return Dataset.from_list(rows)


def short_answer_reward_batch(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """TRL's reward signature: conversational completions are lists of chat messages."""
    from grpo.envs.short_answer import short_answer_reward

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [short_answer_reward(text, a) for text, a in zip(texts, answer, strict=True)]


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
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--tag", default="", help="suffix for the result file name (e.g. smoke)")
    args = parser.parse_args()

    started = time.monotonic()
    load_before = load_average()
    import torch
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from grpo.config.trainer import DEFAULT_LORA_TARGETS
    from grpo.models import embedded

    model = args.model or str(embedded.build())
    bf16 = args.precision == "bf16" or (args.precision == "auto" and cpu_has_bf16())
    batch = args.prompts * args.group
    out_dir = Path("/tmp") / f"trl-bench-{int(time.time())}"
    config = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=bf16,
        model_init_kwargs={"dtype": torch.float32},
        use_vllm=False,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
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
        loss_type="dapo",
        scale_rewards="none",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=42,
    )
    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=list(DEFAULT_LORA_TARGETS),
        task_type="CAUSAL_LM",
    )
    timer = step_timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=short_answer_reward_batch,
        args=config,
        train_dataset=build_dataset(num_examples=1000, seed=42),
        peft_config=lora,
        callbacks=[timer],
    )
    trainer.train()
    process_wall = time.monotonic() - started

    step_s = [end - start for start, end in zip(timer.starts, timer.ends, strict=True)]
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
            "precision": "bf16 autocast (fp32 master weights)" if bf16 else "fp32",
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "completions_per_prompt": args.group,
            "max_completion_tokens": args.max_tokens,
            "learning_rate": args.lr,
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "targets": list(DEFAULT_LORA_TARGETS)},
            "grpo_config": {
                k: getattr(config, k)
                for k in ("use_vllm", "use_cpu", "bf16", "loss_type", "scale_rewards", "beta", "temperature")
            },
            "torch_threads": torch.get_num_threads(),
        },
        "command": " ".join(["python", "benchmarks/trl_bench.py", *sys.argv[1:]]),
        "process_wall_s": process_wall,
        "num_steps": len(step_s),
        "loop_wall_s": loop_wall,
        "step_time_s": step_s,
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
