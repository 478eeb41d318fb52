"""Running one function on N ranks in fresh processes (gloo on CPU, NCCL on GPUs) and collecting what each returned.

The tests launch their own processes, so a plain ``pytest`` run needs no torchrun. Every rank's return value
must be JSON-serialisable; a rank that raises fails the whole launch with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def _rank_main(rank: int, world_size: int, port: int, device_type: str, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    result = {"ok": False}
    try:
        dist.init_process_group(backend_for(device_type), rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _cuda_hidden(hide: bool):
    """CPU ranks must not see a GPU: gloo collectives would otherwise be handed CUDA buffers (torch picks the
    current accelerator for a barrier's tensor), which its TCP transport cannot send."""
    if not hide:
        yield
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def run_ranks(fn: Callable, world_size: int, *args, device_type: str = "cpu", timeout_s: float = 600) -> list:
    """fn(rank, world_size, *args) on every rank (importable by name: the processes are spawned); returns
    the ranks' results in rank order."""
    with tempfile.TemporaryDirectory() as out_dir, _cuda_hidden(device_type == "cpu"):
        context = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), device_type, fn, args, out_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout_s:.0f} s")
        except Exception as error:
            errors = [_read(out_dir, rank).get("error") for rank in range(world_size)]
            details = "\n".join(f"--- rank {r}:\n{e}" for r, e in enumerate(errors) if e)
            raise RuntimeError(f"{fn.__name__} failed on {world_size} ranks: {error}\n{details}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [_read(out_dir, rank)["value"] for rank in range(world_size)]


def _read(out_dir: str, rank: int) -> dict:
    path = Path(out_dir, f"rank{rank}.json")
    return json.loads(path.read_text()) if path.exists() else {}
