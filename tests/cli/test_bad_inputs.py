"""Every user mistake gets one clear line naming the key, exit code 2, and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo"
BIN = Path(sys.executable).parent


def _demo_grpo(*overrides: str) -> list[str]:
    """The one-shot command on the demo configs, then `overrides`."""
    configs = [
        arg for name in ("train", "infer", "orch") for arg in (f"--{name}", str(DEMO / f"{name}.yaml"))
    ]
    return ["grpo", *configs, *overrides]


# (name, command, files {name: content}, text the error line must contain)
CASES = [
    (
        "unknown top-level key",
        ["grpo-train", "t.yaml"],
        {"t.yaml": "model: m\nlearning_rat: 1e-5\n"},
        "did you mean 'learning_rate'",
    ),
    (
        "unknown nested key",
        ["grpo-train", "t.yaml"],
        {"t.yaml": "model: m\nloss:\n  kl_ta: 1\n"},
        "'loss.kl_ta'; did you mean 'loss.kl_tau'",
    ),
    (
        "wrong type",
        ["grpo-train", "t.yaml"],
        {"t.yaml": "model: m\nlearning_rate: fast\n"},
        "'learning_rate'",
    ),
    ("out of range", ["grpo-infer", "i.yaml"], {"i.yaml": "model: m\nport: 99999\n"}, "'port'"),
    ("bad enum", ["grpo-train", "t.yaml"], {"t.yaml": "model: m\nrecipe: fp16\n"}, "'recipe'"),
    ("invalid YAML", ["grpo-train", "t.yaml"], {"t.yaml": "model: m\n  bad: [\n"}, "invalid YAML"),
    ("empty file", ["grpo-train", "t.yaml"], {"t.yaml": ""}, "empty"),
    ("missing file", ["grpo-train", "missing.yaml"], {}, "no such file"),
    ("top level is a list", ["grpo-infer", "i.yaml"], {"i.yaml": "- a\n- b\n"}, "expected a mapping"),
    (
        "missing required key",
        ["grpo-infer", "i.yaml"],
        {"i.yaml": "port: 8000\n"},
        "missing required key 'model'",
    ),
    (
        "unknown key in tagged union",
        ["grpo-orch", "o.yaml"],
        {"o.yaml": "rollout_transport:\n  type: zmq\n  prt: 5\n"},
        "did you mean 'rollout_transport.port'",
    ),
    (
        "unknown key in list item",
        ["grpo-orch", "o.yaml"],
        {"o.yaml": "filters:\n  - type: gibberish\n    windw: 3\n"},
        "filters[0].windw",
    ),
    (
        "unknown discriminator",
        ["grpo-orch", "o.yaml"],
        {"o.yaml": "rollout_transport:\n  type: pigeon\n"},
        "rollout_transport",
    ),
    (
        "batch not divisible by group",
        ["grpo-orch", "o.yaml"],
        {"o.yaml": "batch_size: 10\nrollouts_per_example: 3\n"},
        "divisible",
    ),
    (
        "temperature and scheduler both",
        ["grpo-orch", "o.yaml"],
        {
            "o.yaml": "sampling:\n  temperature: 1\n  temp_scheduler: {type: linear, start_temperature: 1, end_temperature: 0.5}\n"
        },
        "not both",
    ),
    (
        "temperature below vLLM's minimum",
        ["grpo-orch", "o.yaml"],
        {"o.yaml": "sampling:\n  temperature: 0.005\n"},
        "'sampling.temperature': temperature must be >= 0.01",
    ),
    (
        "a sampling filter the trainer does not model",
        ["grpo-orch", "o.yaml", "--sampling.repetition_penalty", "1.2"],
        {"o.yaml": "seed: 1\n"},
        "'sampling.repetition_penalty': 1.2 is not supported in training",
    ),
    (
        "lora rank too large",
        ["grpo-infer", "i.yaml"],
        {"i.yaml": "model: m\nmax_lora_rank: 1000\n"},
        "max_lora_rank",
    ),
    ("mistyped flag", ["grpo-orch", "o.yaml", "--dryrun"], {"o.yaml": "seed: 1\n"}, "did you mean --dry-run"),
    (
        "override of unknown key",
        ["grpo-orch", "o.yaml", "--sampling.temprature", "3"],
        {"o.yaml": "seed: 1\n"},
        "did you mean 'sampling.temperature'",
    ),
    (
        "override without value",
        ["grpo-orch", "o.yaml", "--sampling.temperature"],
        {"o.yaml": "seed: 1\n"},
        "needs a value",
    ),
    (
        "override of wrong type",
        ["grpo-train", "t.yaml", "--learning_rate", "abc"],
        {"t.yaml": "model: m\n"},
        "'learning_rate'",
    ),
    (
        "missing --infer",
        ["grpo", "--train", "t.yaml", "--orch", "o.yaml"],
        {"t.yaml": "model: m\n", "o.yaml": "seed: 1\n"},
        "--infer",
    ),
    (
        "one-shot override prefix typo",
        _demo_grpo("--orc.seed", "3"),
        {},
        "did you mean --orch.seed",
    ),
    (
        "fp8 engine in float32",
        ["grpo-infer", "i.yaml"],
        {"i.yaml": "model: m\nquantization: fp8_per_block\ndtype: float32\n"},
        "set dtype to bfloat16",
    ),
    (
        "precision recipe not implemented",
        ["grpo-train", "t.yaml"],
        {"t.yaml": "model: m\nrecipe: nvfp4\n"},
        "set recipe: bf16",
    ),
    (
        "FP8 training without an FP8 GPU, refused before the model is looked up",
        ["grpo-train", "t.yaml"],
        {"t.yaml": "model: m\nrecipe: fp8-hybrid\n"},
        "recipe fp8_hybrid needs a CUDA GPU with compute capability SM89+",
    ),
    (
        "co-located engine quantization the trainer cannot borrow",
        _demo_grpo("--infer.quantization", "awq", "--infer.dtype", "bfloat16"),
        {},
        "can borrow unquantized or FP8 weights only",
    ),
    (
        "cross-file: max_tokens exceeds context",
        _demo_grpo("--orch.sampling.max_tokens", "600"),
        {},
        "max_tokens",
    ),
    (
        "cross-file: async levels differ",
        _demo_grpo("--train.max_async_level", "2", "--orch.max_async_level", "1"),
        {},
        "max_async_level differs",
    ),
    (
        "cross-file: server rank too small",
        _demo_grpo("--train.lora_rank", "32", "--orch.model.lora_rank", "32", "--infer.max_lora_rank", "16"),
        {},
        "max_lora_rank",
    ),
    (
        "co-located: full fine-tuning on borrowed weights, refused before the engine starts",
        _demo_grpo("--train.lora", "false", "--orch.model.lora_adapter", "null"),
        {},
        "set lora: true",
    ),
    (
        "co-located: a trainer quantizing the base it borrows",
        _demo_grpo("--train.qlora_bnb", "true"),
        {},
        "set qlora_bnb and qlora_fp8 to false",
    ),
    (
        "rl.yaml: a top-level key that is no section or shared key",
        ["grpo", "--config", "rl.yaml"],
        {"rl.yaml": "modle: m\norch: {env: [{id: short-answer}]}\n"},
        "did you mean 'model'",
    ),
    (
        "rl.yaml and a separate file at once",
        ["grpo", "--config", "rl.yaml", "--train", "t.yaml"],
        {"rl.yaml": "model: m\n", "t.yaml": "model: m\n"},
        "drop --train",
    ),
    (
        "rl.yaml section of a process: unknown key named with the section",
        ["grpo-train", "--config", "rl.yaml"],
        {"rl.yaml": "model: m\ntrain: {learning_rat: 1}\n"},
        "rl.yaml [train]: unknown key 'learning_rat'; did you mean 'learning_rate'",
    ),
    (
        "an index past the end of a list",
        _demo_grpo("--orch.env.2.id", "math"),
        {},
        "name an item by its index",
    ),
    (
        "cross-file: output dirs disagree",
        _demo_grpo("--train.output_dir", "elsewhere", "--orch.output_dir", "outputs/run"),
        {},
        "output_dir",
    ),
    (
        "cross-file: different models",
        _demo_grpo("--infer.model", "other/model", "--train.model", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        {},
        "model differs",
    ),
    (
        "cross-file: batch transports differ",
        _demo_grpo("--train.transport_type", "zmq", "--orch.rollout_transport.type", "filesystem"),
        {},
        "train.yaml transport_type",
    ),
    (
        "co-located: per-tensor FP8 on a machine without CUDA",
        _demo_grpo("--infer.quantization", "fp8", "--infer.dtype", "bfloat16"),
        {},
        "set infer quantization: fp8_per_block",
    ),
    (
        "co-located: tensor parallel engine",
        _demo_grpo("--infer.tp", "2"),
        {},
        "infer tp 2",
    ),
    (
        "co-located: dp with full fine-tuning",
        _demo_grpo(
            "--infer.dp",
            "2",
            "--train.lora",
            "false",
            "--train.backend",
            "megatron",
            "--orch.model.lora_adapter",
            "null",
        ),
        {},
        "infer dp 2 with train lora false",
    ),
    (
        "co-located: elastic client",
        _demo_grpo("--orch.client.elastic.hostname", "pool.local"),
        {},
        "remove client.elastic",
    ),
    (
        "unknown env arg",
        _demo_grpo("--orch.env", '[{"id": "math", "args": {"num_exampels": 3}}]'),
        {},
        "did you mean 'num_examples'",
    ),
    (
        "env loader raises",
        ["grpo-orch", "o.yaml"],
        {"o.yaml": "env:\n  - id: uuid:UUID\n"},
        "env uuid:UUID: its loader uuid:UUID raised TypeError",
    ),
    (
        "env loader returns no environment",
        ["grpo-orch", "o.yaml"],
        {"o.yaml": "env:\n  - id: builtins:dict\n"},
        "the loader returned dict, which is not an environment",
    ),
    (
        "dataset env: missing prompt column",
        ["grpo-orch", "o.yaml"],
        {
            "o.yaml": "env:\n  - dataset: d.jsonl\n    prompt_column: question\n    reward_funcs: [json:loads]\n",
            "d.jsonl": '{"prompt": "2+2?", "answer": "4"}\n',
        },
        "d.jsonl has no column 'question' (prompt_column); its columns: prompt, answer",
    ),
    (
        "dataset env: reward function of the wrong signature",
        _demo_grpo("--orch.env", '[{"dataset": "d.jsonl", "reward_funcs": ["json:loads"]}]'),
        {"d.jsonl": '{"prompt": "2+2?", "answer": "4"}\n'},
        "reward_funcs[0] 'json:loads': cannot be called as fn(prompts, completions, completion_ids, answer)",
    ),
    (
        "dataset env: reward function not importable",
        ["grpo-orch", "o.yaml"],
        {
            "o.yaml": "env:\n  - dataset: d.jsonl\n    reward_funcs: [my_rewards:correct]\n",
            "d.jsonl": '{"prompt": "2+2?", "answer": "4"}\n',
        },
        "no module named 'my_rewards'",
    ),
    (
        "empty eval env list",
        ["grpo-orch", str(DEMO / "orch.yaml"), "--eval.env", "[]"],
        {},
        "to turn evaluation off, remove eval",
    ),
    (
        "co-located: checkpoint intervals differ",
        _demo_grpo("--train.ckpt.interval", "2", "--orch.ckpt.interval", "3"),
        {},
        "ckpt.interval differs",
    ),
    (
        "co-located: orchestrator keeps too few checkpoints",
        _demo_grpo("--train.ckpt.interval", "1", "--orch.ckpt.keep_last", "1"),
        {},
        "set keep_last >= 2",
    ),
    (
        "unknown model path",
        ["grpo-train", "t.yaml"],
        {"t.yaml": "model: ./no/such/model\n"},
        "does not exist",
    ),
]


@pytest.mark.parametrize(("name", "command", "files", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_and_exit_2(
    name: str, command: list[str], files: dict[str, str], expected: str, tmp_path: Path
) -> None:
    for file_name, content in files.items():
        (tmp_path / file_name).write_text(content)
    args = [str(BIN / command[0]), *command[1:]]
    if "--dryrun" not in args:
        args.append("--dry-run")
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert expected in result.stderr, result.stderr
    assert all(line.startswith(f"{command[0]}: error: ") for line in result.stderr.strip().splitlines()), (
        result.stderr
    )


def test_memory_planned_for_a_gpu_is_refused_outside_a_dry_run(tmp_path: Path) -> None:
    command = _demo_grpo("--plan-gpu-gib", "79.6")
    result = subprocess.run(
        [str(BIN / command[0]), *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("grpo: error: ") and "use it with --dry-run" in line


def test_verbose_shows_the_traceback(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("model: m\nlearning_rat: 1\n")
    result = subprocess.run(
        [str(BIN / "grpo-train"), "t.yaml", "--dry-run", "--verbose"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_grpo_env_refuses_an_empty_session_store_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(BIN / "grpo-env"), "reverse-text", "--port", "0", "--max-sessions", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-env: error: --max-sessions 0"), lines
