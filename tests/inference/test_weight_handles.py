"""Weight records rebuild the exporter's own memory in another process (CPU shared memory, CUDA IPC)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from grpo.inference.weight_handles import SHM_PREFIX, export_record, release_shared_names

# The receiver runs in a fresh interpreter: it reads the record as JSON, checks the values it
# sees, then writes into the tensor so the exporter can check the write landed in its memory.
RECEIVER = """
import json, sys, torch
from grpo.inference.weight_handles import rebuild_tensor
record = json.loads(sys.stdin.read())
tensor = rebuild_tensor(record)
print(json.dumps({"shape": list(tensor.shape), "sum": float(tensor.float().sum()), "device": str(tensor.device)}))
tensor.fill_(7.0)
if tensor.is_cuda:
    torch.cuda.synchronize()
"""


def exchange(param: torch.Tensor) -> dict[str, object]:
    record = export_record("layer.weight", param)
    json.dumps(record)  # plain data only
    result = subprocess.run(
        [sys.executable, "-c", RECEIVER],
        input=json.dumps(record),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    release_shared_names([record])  # the receiver is done; only the name would outlive this test
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_cpu_record_gives_another_process_a_view_of_the_same_memory() -> None:
    weight = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)
    view = weight[1:]  # non-zero storage offset
    seen = exchange(view)
    assert seen == {"shape": [3, 3], "sum": float(view.float().sum()), "device": "cpu"}
    assert torch.all(view == 7.0) and torch.all(weight[0] == torch.tensor([0.0, 1.0, 2.0]))


def test_a_cpu_export_moves_the_storage_into_one_grpo_file_in_place_without_torchs_shm_manager() -> None:
    import psutil

    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    tied = weight.view(3, 4)  # another tensor on the same storage, as a tied output layer is
    records = [export_record("embed.weight", weight), export_record("lm_head.weight", tied)]

    filename = records[0]["filename"]
    assert isinstance(filename, str) and filename.startswith(f"/{SHM_PREFIX}")
    assert records[1]["filename"] == filename  # one storage, one file
    # Moved in place: both tensors read and write the file's pages, with their values kept.
    assert weight.untyped_storage().filename == f"/dev/shm{filename}"
    assert tied.data_ptr() == weight.data_ptr() and weight.sum().item() == 66.0
    # torch's own CPU sharing would have started a torch_shm_manager child, whose one-second
    # answers ended co-located runs on a busy machine.
    assert "torch_shm_manager" not in {child.name() for child in psutil.Process().children()}
    assert release_shared_names(records) == 1


# Maps the record, says so, waits until the exporter has released the name, then reads the view.
MAP_THEN_READ = """
import json, sys
from grpo.inference.weight_handles import rebuild_tensor
tensor = rebuild_tensor(json.loads(sys.stdin.readline()))
print("mapped", flush=True)
sys.stdin.readline()
print(float(tensor.float().sum()), flush=True)
"""


def test_a_mapped_view_stays_valid_after_its_shared_memory_name_is_released() -> None:
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    record = export_record("layer.weight", weight)
    receiver = subprocess.Popen(
        [sys.executable, "-c", MAP_THEN_READ], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert receiver.stdin is not None and receiver.stdout is not None
    receiver.stdin.write(json.dumps(record) + "\n")
    receiver.stdin.flush()
    assert receiver.stdout.readline().strip() == "mapped"
    assert release_shared_names([record]) > 0  # the name leaves /dev/shm ...
    receiver.stdin.write("go\n")
    receiver.stdin.flush()
    assert float(receiver.stdout.readline()) == float(weight.sum())  # ... the mapping stays
    assert receiver.wait(timeout=60) == 0


@pytest.mark.gpu
def test_cuda_record_gives_another_process_a_view_of_the_same_memory() -> None:
    weight = torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(4, 3)
    view = weight[1:]
    seen = exchange(view)
    assert seen == {"shape": [3, 3], "sum": float(view.float().sum()), "device": "cuda:0"}
    torch.cuda.synchronize()
    assert torch.all(view == 7.0) and torch.all(weight[0].float().cpu() == torch.tensor([0.0, 1.0, 2.0]))
