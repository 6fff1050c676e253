"""Tensor-parallel processes: one engine per rank, driven by rank 0's.

The engine the user holds is rank 0 (the driver). It starts one worker process per other
rank; each worker builds the same engine over its own shard of the model
(`layers/parallel.py`) and its own KV pool, and then replays, in the driver's order, every
call that changes engine state (`replicated`): requests added or aborted, steps, pruning,
chain persistence. The host side of the engine (scheduler, KV pool, slot tables, caches
and tiers) is deterministic given those calls, so every rank takes the same decisions and
holds identical slot tables without shipping them; the device work meets in the model's
collectives, and the driver's sampled tokens are broadcast so that unseeded sampling
agrees too. Only the driver's outputs are returned to the user.

A rank that dies or fails makes the driver raise `RankFailure` naming it: before each
replicated call the driver checks its workers, a collective with a dead peer fails
instead of waiting, and every collective has a timeout as the last resort.
"""

from __future__ import annotations

import datetime
import functools
import logging
import multiprocessing
import socket
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, TypeVar

import torch

from sparsevllm.config import EngineConfig
from sparsevllm.layers.parallel import HeadShard, TensorParallel
from sparsevllm.sparse.spec import MethodSpec

logger = logging.getLogger(__name__)

# Collectives wait at most this long for a peer (a rank stuck, not dead: dead ones fail
# at once). Steps run in lockstep, so no healthy rank waits for long inside one.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
_EXIT = "__exit__"


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot go on."""


RankMain = Callable[[EngineConfig, int, int, Connection], None]


def init_rank(rank: int, size: int, port: int, device_type: str) -> TensorParallel:
    """Join the group on this process (NCCL on CUDA with GPU `rank`, gloo on CPU)."""
    if torch.distributed.is_initialized():
        raise RuntimeError(
            "this process already runs a tensor-parallel engine: close it (LLM.close() or "
            "LLMEngine.close()) before starting another"
        )
    backend = "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    torch.distributed.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return TensorParallel(rank, size, torch.distributed.group.WORLD)


def check_replicated_heads(
    shard: HeadShard | None, tp: TensorParallel, specs: list[MethodSpec]
) -> None:
    """Refuse selecting methods when ranks share KV heads: a rank then holds only part
    of a KV head's query heads, and scores over that group would differ from one rank's."""
    if shard is None or shard.num_kv_heads >= tp.size:
        return
    selecting = [s.name for s in specs if s.budget_knob is not None]
    if selecting:
        raise ValueError(
            f"tensor_parallel_size {tp.size} exceeds the model's {shard.num_kv_heads} KV "
            f"heads, so ranks replicate KV heads and split their query heads; "
            f"{', '.join(selecting)} select tokens from whole query groups: use at most "
            f"{shard.num_kv_heads} ranks, or methods that keep the full context"
        )


def leave_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ranks:
    """The driver's handle on its worker ranks: starts them, forwards calls, watches."""

    def __init__(self, config: EngineConfig, size: int, device_type: str, main: RankMain) -> None:
        if device_type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs; this machine shows "
                f"{torch.cuda.device_count()}"
            )
        ctx = multiprocessing.get_context("spawn")
        self.port = free_port()
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(1, size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=main,
                args=(config, rank, self.port, theirs),
                name=f"sparsevllm-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        self.failure: RankFailure | None = None

    def check(self) -> None:
        """Raise `RankFailure` if a worker has died or reported an error."""
        if self.failure is not None:
            raise self.failure
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            error = _reported(conn)
            if error is not None or not proc.is_alive():
                code = proc.exitcode
                how = f"exited with code {code}" if code is not None else "failed"
                detail = f":\n{error}" if error else ""
                self.failure = RankFailure(f"tensor-parallel rank {rank} {how}{detail}")
                self.close()
                raise self.failure

    def send(self, name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self.check()
        for conn in self.conns:
            try:
                conn.send((name, args, kwargs))
            except (BrokenPipeError, EOFError, OSError):
                self.check()
                raise

    def fail(self, error: BaseException) -> RankFailure:
        """The failure a collective's `error` means: a worker's, when one died or reported
        one, else the driver's own (the workers are stopped: they cannot go on alone)."""
        try:
            self.check()
        except RankFailure as failure:
            return failure
        self.failure = RankFailure(f"tensor-parallel rank 0 failed: {error}")
        self.close()
        return self.failure

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send((_EXIT, (), {}))
            except (BrokenPipeError, EOFError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def _reported(conn: Connection) -> str | None:
    """The error text a worker sent before exiting, if any."""
    try:
        if conn.closed or not conn.poll():
            return None
        kind, text = conn.recv()
    except (EOFError, OSError):
        return None
    return str(text) if kind == "error" else None


class _Replicating(Protocol):
    ranks: Ranks | None
    _replaying: bool


F = TypeVar("F", bound=Callable[..., Any])


def replicated(before: bool) -> Callable[[F], F]:
    """Replay a state-changing engine call on every worker rank, in the driver's order.
    `before`: forward it before running it here (calls that meet in collectives); else
    after it succeeded here (host-only calls, which then cannot fail on a worker)."""

    def wrap(method: F) -> F:
        name = method.__name__

        @functools.wraps(method)
        def call(self: _Replicating, *args: Any, **kwargs: Any) -> Any:
            ranks = self.ranks
            if ranks is None or self._replaying:
                return method(self, *args, **kwargs)
            if before:
                ranks.send(name, args, kwargs)
            else:
                ranks.check()  # a failed engine takes nothing more, not even here
            self._replaying = True
            try:
                result = method(self, *args, **kwargs)
            except RankFailure:
                raise
            except RuntimeError as e:
                if before:  # a collective may have met a dead peer
                    raise ranks.fail(e) from e
                raise
            finally:
                self._replaying = False
            if not before:
                ranks.send(name, args, kwargs)
            return result

        return call  # type: ignore[return-value]

    return wrap


def serve_rank(engine: object, conn: Connection) -> None:
    """A worker's loop: run the driver's calls on `engine` until told to exit. An error in
    a call that meets in collectives ends the worker (reported to the driver); a host-only
    call failed on the driver first, so it cannot fail here."""
    while True:
        try:
            name, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return  # the driver is gone
        if name == _EXIT:
            return
        try:
            getattr(engine, name)(*args, **kwargs)
        except BaseException:
            text = traceback.format_exc()
            logger.error("tensor-parallel worker failed in %s:\n%s", name, text)
            try:
                conn.send(("error", text))
            finally:
                raise
