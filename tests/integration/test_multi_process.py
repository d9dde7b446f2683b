"""grpo-infer, grpo-orch and grpo-train as three processes on the tiny model (docs/multi_node.md).

One LoRA inference server (grpo-infer) is shared by the filesystem tests; the full-weight
collective test starts its own server last, after the trainer and the orchestrator.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from mp_harness import (
    Launcher,
    assert_no_survivors,
    batch_transport,
    free_port,
    infer_config,
    orch_config,
    train_config,
    trainer_steps,
    wait_for_path,
    wait_for_server,
    wait_for_trainer_step,
    write_yaml,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

RUN_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def lora_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A grpo-infer process serving the tiny model with LoRA; yields its base URL."""
    folder = tmp_path_factory.mktemp("lora_server")
    port = free_port()
    launcher = Launcher(folder)
    launcher.start(
        "infer",
        "grpo-infer",
        write_yaml(
            folder / "infer.yaml",
            infer_config(tiny_model_path, port, lora=True, weight_dir=tmp_path_factory.getbasetemp()),
        ),
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_for_server(url, launcher.processes["infer"], folder / "infer.log")
        yield url
        assert launcher.stop("infer") == 0
        assert_no_survivors(launcher.tag)
    finally:
        launcher.kill_everything()


def test_filesystem_transports_train_three_steps_with_lora(
    lora_server: str, launcher: Launcher, tiny_model_path: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    orch = write_yaml(tmp_path / "orch.yaml", orch_config(tiny_model_path, run_dir, lora_server, lora=True))
    train = write_yaml(tmp_path / "train.yaml", train_config(tiny_model_path, run_dir, lora=True))
    launcher.start("orch", "grpo-orch", orch)
    launcher.start("train", "grpo-train", train)
    launcher.wait_all(["orch", "train"], RUN_TIMEOUT_S)
    assert trainer_steps(run_dir) == [0, 1, 2]
    assert (run_dir / "broadcasts" / "step_3" / "adapter_model.safetensors").exists()


def test_zmq_and_collective_full_weights_reach_two_servers_started_last(
    launcher: Launcher, tiny_model_path: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    infer_ports, zmq_port, weights_port = [free_port(), free_port()], free_port(), free_port()
    urls = [f"http://127.0.0.1:{port}/v1" for port in infer_ports]
    collective = {"type": "nccl", "host": "localhost", "port": weights_port, "timeout": 180, "num_servers": 2}
    orch = orch_config(
        tiny_model_path,
        run_dir,
        urls[0],
        lora=False,
        rollout_transport={"type": "zmq", "port": zmq_port},
        weight_broadcast=collective,
    )
    orch["client"]["base_url"] = urls
    train = train_config(
        tiny_model_path,
        run_dir,
        lora=False,
        transport_type="zmq",
        zmq_port=zmq_port,
        weight_broadcast=collective,
    )
    launcher.start("train", "grpo-train", write_yaml(tmp_path / "train.yaml", train))
    launcher.start("orch", "grpo-orch", write_yaml(tmp_path / "orch.yaml", orch))
    for i, port in enumerate(infer_ports):
        # Server 0 compiled (vLLM's default for full weights on CPU), server 1 eager: the policies
        # reach both kinds of engine, and the two do not compile side by side (~25 s each here).
        cfg = {
            **infer_config(tiny_model_path, port, lora=False, weight_dir=tmp_path),
            "enforce_eager": i == 1,
        }
        launcher.start(f"infer{i}", "grpo-infer", write_yaml(tmp_path / f"infer{i}.yaml", cfg))
    launcher.wait_all(["orch", "train"], RUN_TIMEOUT_S + 240)
    assert trainer_steps(run_dir) == [0, 1, 2]
    # Policies 1 and 2 went over one collective with both servers (trainer rank 0, servers ranks 1
    # and 2; the orchestrator fails the run if either did not receive); the final policy is on disk.
    assert (run_dir / "broadcasts" / "step_2" / "collective.json").exists()
    assert (run_dir / "broadcasts" / "step_3" / "model.safetensors").exists()
    # SIGTERM ends each server with 0 and says so last; the launcher fixture then finds no process
    # of theirs (vLLM's engine cores included) left.
    for name in ("infer0", "infer1"):
        assert launcher.stop(name, timeout=30) == 0
        grpo_lines = [line for line in launcher.log(name).splitlines() if "[grpo." in line]
        assert "inference server stopped (exit code 0)" in grpo_lines[-1], grpo_lines[-3:]


@pytest.mark.parametrize(
    ("transport", "groups_per_part"),
    [("filesystem", None), ("zmq", None), ("filesystem", 1), ("zmq", 1)],
    ids=["filesystem", "zmq", "filesystem-streamed", "zmq-streamed"],
)
def test_orchestrator_killed_mid_run_resumes_without_losing_or_repeating_a_step(
    lora_server: str,
    launcher: Launcher,
    tiny_model_path: Path,
    tmp_path: Path,
    transport: str,
    groups_per_part: int | None,
) -> None:
    run_dir = tmp_path / "run"
    orch_transport, train_transport = batch_transport(transport)
    cfg = orch_config(
        tiny_model_path,
        run_dir,
        lora_server,
        lora=True,
        ckpt={"interval": 1},
        streaming={"groups_per_part": groups_per_part},
        **orch_transport,
    )
    orch = write_yaml(tmp_path / "orch.yaml", cfg)
    train_cfg = train_config(tiny_model_path, run_dir, lora=True, **train_transport)
    train = write_yaml(tmp_path / "train.yaml", train_cfg)
    launcher.start("train", "grpo-train", train)
    launcher.start("orch", "grpo-orch", orch)
    wait_for_path(run_dir / "checkpoints" / "orchestrator" / "step_1" / "STABLE", RUN_TIMEOUT_S, launcher)
    launcher.processes["orch"].send_signal(signal.SIGKILL)
    launcher.wait("orch", 10)
    launcher.start("orch", "grpo-orch", orch, "--ckpt.resume_step", "-1")
    launcher.wait_all(["orch", "train"], RUN_TIMEOUT_S)
    assert trainer_steps(run_dir) == [0, 1, 2]
    assert "resumed from orchestrator checkpoint" in launcher.log("orch")


def test_zmq_trainer_killed_after_its_checkpoint_resumes_from_it_without_skipping_or_repeating_a_step(
    lora_server: str, launcher: Launcher, tiny_model_path: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    orch_transport, train_transport = batch_transport("zmq")
    # Strictly on-policy: batch 3 waits for policy 3, so the trainer is killed after training
    # batch 2 (its checkpoint holds steps 0 and 1 only) and before it gets batch 3.
    orch_cfg = orch_config(
        tiny_model_path, run_dir, lora_server, lora=True, max_steps=4, max_async_level=0, **orch_transport
    )
    train_cfg = train_config(
        tiny_model_path, run_dir, lora=True, max_steps=4, ckpt={"interval": 2}, **train_transport
    )
    train = write_yaml(tmp_path / "train.yaml", train_cfg)
    launcher.start("train", "grpo-train", train)
    launcher.start("orch", "grpo-orch", write_yaml(tmp_path / "orch.yaml", orch_cfg))
    wait_for_trainer_step(run_dir, 2, RUN_TIMEOUT_S, launcher)
    launcher.processes["train"].send_signal(signal.SIGKILL)
    launcher.wait("train", 10)
    assert trainer_steps(run_dir) == [0, 1, 2]
    launcher.start("train", "grpo-train", train, "--ckpt.resume_step", "-1")
    launcher.wait_all(["orch", "train"], RUN_TIMEOUT_S)
    # Batch 2, taken before the kill but in no checkpoint, came again from the orchestrator's spool;
    # its first row was cut on resume, so every step has one row.
    assert trainer_steps(run_dir) == [0, 1, 2, 3]
    assert "next batch is step 2" in launcher.log("train")
