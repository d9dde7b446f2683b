"""One co-located replica's engine: start vLLM in this process and borrow its base weights.

Shared by the main process (replica 0) and every extra replica process (grpo.colocate.replica_process):
each process pairs one engine with one trainer rank on the same device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from grpo.colocate.guards import check_borrowable_model, check_borrowing_safe
from grpo.colocate.openmp_waits import engine_waits_passively
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    from grpo.colocate.borrow import BorrowedBase
    from grpo.config.inference import InferenceConfig
    from grpo.inference.server import ServerThread

SERVER_READY_TIMEOUT_S = 600.0


def start_engine(infer: InferenceConfig, model_path: str) -> ServerThread:
    """Start vLLM's server thread (engine in its subprocess) and wait until it answers. The caller
    stops the returned server on every exit path; a failed or interrupted start stops it here."""
    from grpo.inference.server import ServerThread
    from grpo.inference.server_args import build_server_args

    check_borrowable_model(model_path)
    check_borrowing_safe(build_server_args(infer, model_path))
    # The engine subprocess inherits this: on CPU it keeps the dense linear weights the trainer borrows.
    os.environ["GRPO_KEEP_DENSE_WEIGHTS"] = "1"
    engine_waits_passively()
    from grpo.colocate.console import engine_logs_to_file

    server = ServerThread(infer, model_path, quiet=engine_logs_to_file())
    server.start()
    try:
        server.wait_ready(SERVER_READY_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise
    return server


def borrow_base_weights(server: ServerThread, model_path: str) -> tuple[BorrowedBase, list[str]]:
    """The engine's base weights as views in this process, and the shared-memory names they came
    from (CPU; empty on GPU). The names are removed here: both sides have mapped the memory, and a
    name left in /dev/shm would outlive a crash."""
    from grpo.colocate.borrow import borrow_from_records
    from grpo.inference.weight_handles import release_shared_names

    records_per_worker = server.collective_rpc("export_weight_handles")
    if len(records_per_worker) != 1:
        raise UserError(
            f"a co-located trainer rank borrows from one engine worker, got {len(records_per_worker)}; "
            "use infer tp: 1 (dp: N runs N engines, one per trainer rank)"
        )
    records = records_per_worker[0]
    try:
        borrowed = borrow_from_records(records, model_path)
    finally:
        # Also when borrowing fails (a layout check, a missing tensor): the names were created for
        # this process alone, and nothing else would remove them from /dev/shm.
        release_shared_names(records)
    shared_files = sorted({r["filename"] for r in records if r["kind"] == "cpu_shm"})
    return borrowed, shared_files
