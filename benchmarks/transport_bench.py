"""Batch transport speed: wire encode/decode throughput and per-batch latency, filesystem vs zmq.

    .venv/bin/python benchmarks/transport_bench.py [--rows 128] [--tokens 2048] [--repeats 10]

Latency is measured from `send()` start until a receiver thread, already waiting in
`receive(n)`, returns batch n (the same process, so the clocks agree). Results go to
benchmarks/results/transport_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import safetensors
import zmq

from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.filesystem import FilesystemBatchReceiver, FilesystemBatchSender
from grpo.transport.batches.interfaces import BatchReceiver, BatchSender
from grpo.transport.batches.synthetic import synthetic_batch
from grpo.transport.batches.wire import decode_batch, encode_batch
from grpo.transport.batches.zmq_transport import ZmqBatchReceiver, ZmqBatchSender


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _latencies(sender: BatchSender, receiver: BatchReceiver, batches: list[TrainingBatch]) -> list[float]:
    latencies = []
    for batch in batches:
        done = threading.Event()
        received_at: list[float] = []

        def receive(
            step: int = batch.step, done: threading.Event = done, received_at: list[float] = received_at
        ) -> None:
            receiver.receive(step, timeout=60)
            received_at.append(time.perf_counter())
            done.set()

        thread = threading.Thread(target=receive)
        thread.start()
        time.sleep(0.02)  # let the receiver block first, as a trainer waiting for its next batch does
        start = time.perf_counter()
        sender.send(batch)
        assert done.wait(60)
        thread.join()
        latencies.append(received_at[0] - start)
    return latencies


def _summary(seconds: list[float]) -> dict[str, float]:
    return {
        "median_ms": 1000 * statistics.median(seconds),
        "min_ms": 1000 * min(seconds),
        "max_ms": 1000 * max(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=128, help="packed rows (one sample each) per batch")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per row")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--machine", default=f"cpu-{os.cpu_count()}core", help="label in the results file name"
    )
    args = parser.parse_args()

    batch = synthetic_batch(0, num_rows=args.rows, num_tokens=args.tokens, with_teacher=False)
    blob = encode_batch(batch)
    megabytes = len(blob) / 1e6
    encode_s = _best_seconds(lambda: encode_batch(batch), args.repeats)
    decode_s = _best_seconds(lambda: decode_batch(blob), args.repeats)

    batches = [synthetic_batch(n, num_rows=args.rows, num_tokens=args.tokens) for n in range(args.repeats)]
    with tempfile.TemporaryDirectory() as run_dir:
        filesystem = _latencies(
            FilesystemBatchSender(run_dir, max_buffered=2), FilesystemBatchReceiver(run_dir), batches
        )
    zmq_receiver = ZmqBatchReceiver("localhost", 0)
    zmq_sender = ZmqBatchSender("localhost", zmq_receiver.port, close_linger=1)
    zmq_latencies = _latencies(zmq_sender, zmq_receiver, batches)
    zmq_sender.close()
    zmq_receiver.close()

    result = {
        "machine": args.machine,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "safetensors": safetensors.__version__,
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
        },
        "config": {"rows": args.rows, "tokens_per_row": args.tokens, "repeats": args.repeats},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "blob_mb": megabytes,
        "encode_mb_per_s": megabytes / encode_s,
        "decode_mb_per_s": megabytes / decode_s,
        "filesystem_latency": _summary(filesystem),
        "zmq_latency": _summary(zmq_latencies),
        "filesystem_dir": tempfile.gettempdir(),
    }
    out = Path(__file__).parent / "results" / f"transport_{args.machine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
