"""A peer without the run's secret cannot make the trainer buffer its messages: with a secret the
zmq link is CURVE, whose handshake such a peer never completes, so not one of its bytes reaches
the trainer's queue (ZMQ buffers a whole multipart message before anyone can read or check it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from grpo.transport.batches.synthetic import assert_batches_equal, synthetic_batch
from grpo.transport.batches.zmq_transport import ZmqBatchReceiver, ZmqBatchSender

SECRET = b"the run's secret"
NUM_MESSAGES, NUM_FRAMES, FRAME_BYTES = 4, 100, 1 << 20
"""The flood: 400 MiB in four messages, each frame far below the receiver's size limit."""
BOUND_BYTES = 64 << 20
"""What the receiver may grow by during the flood (allocator noise; the flood itself is 400 MiB)."""

_FLOODER = """
import sys, time
import zmq
context = zmq.Context()
dealer = context.socket(zmq.DEALER)
dealer.setsockopt(zmq.SNDHWM, 0)
dealer.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
frame = b"x" * int(sys.argv[4])
num_sent, deadline = 0, time.monotonic() + 3
while num_sent < int(sys.argv[2]) and time.monotonic() < deadline:
    try:  # a send blocks while no connection is up (one that fails its handshake never is)
        dealer.send_multipart([frame] * int(sys.argv[3]), flags=zmq.NOBLOCK)
        num_sent += 1
    except zmq.Again:
        time.sleep(0.01)
print("sent", flush=True)
time.sleep(600)
"""


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_flood_of_unsigned_many_frame_messages_is_not_buffered_by_the_trainer() -> None:
    receiver = ZmqBatchReceiver("localhost", 0, secret=SECRET)
    before = _rss_bytes()
    flooder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _FLOODER,
            str(receiver.port),
            str(NUM_MESSAGES),
            str(NUM_FRAMES),
            str(FRAME_BYTES),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flooder.stdout is not None and flooder.stdout.readline().strip() == "sent"
        deadline, grown = time.monotonic() + 5, 0
        while time.monotonic() < deadline and grown <= BOUND_BYTES:
            time.sleep(0.1)
            grown = _rss_bytes() - before
        assert grown <= BOUND_BYTES, f"the trainer grew by {grown / 2**20:.0f} MiB under the flood"

        # The run's own orchestrator still gets through.
        sender = ZmqBatchSender("localhost", receiver.port, close_linger=5, secret=SECRET)
        try:
            sender.send(synthetic_batch(0))
            assert_batches_equal(receiver.receive(0, timeout=10), synthetic_batch(0))
        finally:
            sender.close()
    finally:
        flooder.kill()
        flooder.wait(timeout=30)
        receiver.close()
