"""Recovery time of a supervised inference server: from the moment its vLLM server process is
SIGKILLed (a crash, the OOM killer) or SIGSTOPped (a hang) to the moment the orchestrator's client
routes to it again with the current LoRA policy loaded.

One `grpo-infer` with supervisor.enabled (health every 1 s, hung after 5 s) and one
InferenceClient with client.recovery (same intervals) that loaded a LoRA adapter as policy "policy".
Each round signals the server process the supervisor runs, starts a request for the policy at
once (it waits for the server to return), and records: the client's recovery time (signal ->
routed again with the policy), the supervisor's restart time (its noticing the failure -> the new
server answering /health), and the waiting request's latency. Results go to
benchmarks/results/recovery_<machine>.json.
"""

from __future__ import annotations

import argparse
import asyncio
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
from pathlib import Path

import psutil
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HEALTH = {"health_interval_s": 1.0, "health_timeout_s": 5.0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_process(supervisor: subprocess.Popen[bytes]) -> psutil.Process:
    (child,) = psutil.Process(supervisor.pid).children()
    return child


async def _measure(
    url: str, supervisor: subprocess.Popen[bytes], adapter: Path, kinds: list[str], launched: float
) -> tuple[float, list[dict]]:
    """(seconds from launch to the first start answering, one entry per round)."""
    from grpo.config.orchestrator import ClientConfig
    from grpo.inference.client import InferenceClient
    from grpo.inference.types import GenerateRequest, SamplingParams

    cfg = ClientConfig.model_validate(
        {"base_url": [url], "timeout": 600, "recovery": {**HEALTH, "deadline_s": 900}}
    )
    client = InferenceClient(cfg)
    params = SamplingParams(
        temperature=1.0, max_tokens=16, min_tokens=16, repetition_penalty=1.0, top_p=1.0, seed=0
    )
    request = GenerateRequest(prompt_token_ids=list(range(10, 42)), params=params, n=4, model="policy")
    rounds = []
    try:
        await client.wait_until_ready(600)
        first_start = time.monotonic() - launched
        await client.load_lora_adapter("policy", str(adapter))
        await client.generate(request)
        for kind in kinds:
            recoveries = client.pool_metrics()["pool/num_recoveries"]
            server = _server_process(supervisor)
            signalled = time.monotonic()
            server.send_signal(signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
            waiting = asyncio.create_task(client.generate(request))
            while client.pool_metrics()["pool/num_recoveries"] == recoveries:
                await asyncio.sleep(0.05)
            routed = time.monotonic()
            completions = await waiting
            answered = time.monotonic()
            assert len(completions) == 4 and all(len(c.token_ids) == 16 for c in completions)
            rounds.append(
                {
                    "kind": kind,
                    "recovery_seconds": round(routed - signalled, 2),
                    "waiting_request_seconds": round(answered - signalled, 2),
                }
            )
            print(rounds[-1], flush=True)
    finally:
        await client.close()
    return first_start, rounds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--embedded", action="store_true", help="SmolLM2-135M-Instruct instead of the tiny model"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per failure kind")
    parser.add_argument(
        "--machine", default=f"cpu-{os.cpu_count()}core", help="label in the results file name"
    )
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from inference_bench import _make_adapter

    from grpo.models import embedded
    from grpo.models.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    model_path = embedded.build() if args.embedded else build_tiny_model(work / "tiny")
    adapter = _make_adapter(model_path, work / "adapter", seed=0, rank=8)
    port = _free_port()
    infer = {
        "model": str(model_path), "port": port, "weight_dirs": [str(work)], "max_model_len": 256,
        "kv_cache_space_gb": 0.5, "max_lora_rank": 8, "max_num_seqs": 16,
        "supervisor": {"enabled": True, **HEALTH},
    }  # fmt: skip
    (work / "infer.yaml").write_text(yaml.safe_dump(infer))
    log_path = work / "infer.log"
    load_before = os.getloadavg()
    launched = time.monotonic()
    with log_path.open("wb") as log:
        supervisor = subprocess.Popen(
            [str(Path(sys.executable).parent / "grpo-infer"), str(work / "infer.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        )
    kinds = ["sigkill", "sigstop"] * args.rounds
    try:
        first_start, rounds = asyncio.run(
            _measure(f"http://127.0.0.1:{port}/v1", supervisor, adapter, kinds, launched)
        )
    finally:
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(120)
    restarts = [float(s) for s in re.findall(r"answers /health again, ([0-9.]+) s", log_path.read_text())]
    for entry, restart in zip(rounds, restarts, strict=True):
        entry["supervisor_restart_seconds"] = restart

    result = {
        "machine": args.machine,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "config": {
            "model": "SmolLM2-135M-Instruct (embedded)" if args.embedded else "tiny random llama",
            "lora_serving": "auto (merged on CPU)",
            "supervisor": HEALTH,
            "client.recovery": HEALTH,
        },
        "command": "python benchmarks/recovery_bench.py " + " ".join(sys.argv[1:]),
        "first_start_seconds": round(first_start, 1),
        "rounds": rounds,
    }
    suffix = "_embedded" if args.embedded else "_tiny"
    out = Path(__file__).parent / "results" / f"recovery_{args.machine}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
