from __future__ import annotations

from pathlib import Path

from grpo.config.orchestrator import OrchestratorConfig, ZmqRolloutTransport
from grpo.config.trainer import TrainerConfig
from grpo.transport.batches.factory import batch_receiver_for, batch_sender_for, make_batch_receiver
from grpo.transport.batches.filesystem import FilesystemBatchReceiver, FilesystemBatchSender
from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.batches.zmq_transport import ZmqBatchReceiver, ZmqBatchSender


def test_default_configs_use_the_filesystem_with_async_level_buffering(tmp_path: Path) -> None:
    sender = batch_sender_for(OrchestratorConfig(max_async_level=2), tmp_path)
    assert isinstance(sender, FilesystemBatchSender) and sender.max_buffered == 3
    assert isinstance(batch_receiver_for(TrainerConfig(model="tiny"), tmp_path), FilesystemBatchReceiver)


def test_zmq_configs_connect_orchestrator_to_trainer(tmp_path: Path) -> None:
    trainer_receiver = make_batch_receiver("zmq", tmp_path, host="localhost", port=0)
    assert isinstance(trainer_receiver, ZmqBatchReceiver)
    port = trainer_receiver.port
    orch = OrchestratorConfig(rollout_transport=ZmqRolloutTransport(type="zmq", port=port, hwm=2))
    sender = batch_sender_for(orch, tmp_path)
    assert isinstance(sender, ZmqBatchSender)
    try:
        sender.send(synthetic_batch(0))
        assert_batches_equal(trainer_receiver.receive(0, timeout=10), synthetic_batch(0))
    finally:
        sender.close()
        trainer_receiver.close()


def test_trainer_zmq_config_binds_its_port(tmp_path: Path) -> None:
    probe = make_batch_receiver("zmq", tmp_path, port=0)
    assert isinstance(probe, ZmqBatchReceiver)
    free_port = probe.port
    probe.close()
    receiver = batch_receiver_for(
        TrainerConfig(model="tiny", transport_type="zmq", zmq_port=free_port), tmp_path
    )
    try:
        assert isinstance(receiver, ZmqBatchReceiver) and receiver.port == free_port
    finally:
        receiver.close()
