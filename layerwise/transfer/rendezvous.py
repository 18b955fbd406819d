"""Forming a weight-transfer group once, within ``timeout_seconds``: who may join, and until when.

torch's own rendezvous has two gaps a trainer next to an engine runs into. A ``TCPStore`` client retries its
connection with a back-off that overshoots the timeout (1 s took 2.3 s here, 2 s took 3.2 s), and the
process-group constructor then waits a whole timeout of its own; and a group's keys stay in the store after
it formed, so a second engine started with the same init info could read them and join a group that was
complete. Here every rank works against one deadline:

    trainer (rank 0)                                   engine rank r
    host the store; publish "<group id> <world size>"  wait until the port accepts connections (polled
                                                       every 20 ms), connect; read the group id; refuse a
                                                       group id or world size other than the init info's
    claim rank 0                                       claim rank r: a rank claimed before is refused
    count in; the last rank in marks the group formed; every rank waits for that mark until the deadline;
    a rank that gives up marks the group abandoned first, so no rank builds a group around a missing one

and only then is the process group built, on a store prefix of the group id, so it finds every rank
present. A rank that does not come in time makes every waiting rank raise
:class:`WeightTransferTimeoutError` with the true elapsed time and how many ranks had joined.
"""

from __future__ import annotations

import datetime
import re
import secrets
import socket
import time

import torch.distributed as dist

from layerwise.errors import WeightTransferError, WeightTransferTimeoutError

STORE_PREFIX = "layerwise/weight_transfer"
_POLL_SECONDS = 0.02


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _wait_for_listener(address: str, port: int, deadline: float, timeout_seconds: float, started: float) -> None:
    """Return once ``address:port`` accepts a TCP connection; WeightTransferTimeoutError at the deadline."""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((address, port), timeout=max(min(left, 1.0), 0.001)):
                return
        except OSError as e:
            if time.monotonic() + _POLL_SECONDS >= deadline:
                raise WeightTransferTimeoutError(
                    f"weight transfer: no trainer listening at {address}:{port} after "
                    f"{time.monotonic() - started:.1f} s (timeout_seconds {timeout_seconds:g}): {e}; start the "
                    f"trainer's trainer_init first, or check master_address / master_port"
                ) from e
            time.sleep(_POLL_SECONDS)


def join(
    address: str, port: int, rank: int, world_size: int, timeout_seconds: float, group_id: str | None
) -> tuple[dist.TCPStore, str]:
    """Join (rank 0: host) the group at ``address:port`` within ``timeout_seconds``.

    Args:
        rank / world_size: this process's rank (0 = the trainer, which hosts the store) and the group's size.
        group_id: the init info's token; None: rank 0 draws a fresh one, and the engines accept the
            trainer's. Given, an engine refuses a trainer that hosts another group.
    Returns:
        (the store, with ``timeout_seconds`` as its timeout again; the group's key prefix in it).
    Raises:
        WeightTransferTimeoutError: the trainer or another rank did not come within ``timeout_seconds``
            (the message gives the elapsed seconds and the ranks that joined).
        WeightTransferError: the rank was taken (a second engine, or one late after the group formed), the
            trainer hosts another group id or world size, or rank 0 cannot listen on the port.
    """
    started = time.monotonic()
    deadline = started + timeout_seconds
    where = f"{address}:{port}"
    current = f"{STORE_PREFIX}/current"
    try:
        if rank == 0:
            store = dist.TCPStore(
                address, port, world_size, True, timeout=_timedelta(timeout_seconds), wait_for_workers=False
            )
            token = group_id or secrets.token_hex(8)
            store.set(current, f"{token} {world_size}")
        else:
            _wait_for_listener(address, port, deadline, timeout_seconds, started)
            left = deadline - time.monotonic()
            store = dist.TCPStore(address, port, world_size, False, timeout=_timedelta(left), wait_for_workers=False)
            store.wait([current], _timedelta(deadline - time.monotonic()))
            token, hosted_size = store.get(current).decode().split()
            if group_id is not None and token != group_id:
                raise WeightTransferError(
                    f"weight transfer: the trainer at {where} hosts group {token!r}, the init info names "
                    f"{group_id!r}: a stale init info, or another trainer on this port"
                )
            if int(hosted_size) != world_size:
                raise WeightTransferError(
                    f"weight transfer: the trainer at {where} formed its group for world_size {hosted_size}, "
                    f"this init info says {world_size}"
                )
        namespace = f"{STORE_PREFIX}/{token}"
        formed = f"{namespace}/formed"  # "1" once every rank is in; "abandoned" once a rank gave up waiting
        abandoned = (
            f"weight transfer: group {token!r} at {where} was abandoned by a rank that gave up waiting; a new "
            f"group needs a new trainer_init"
        )
        if store.check([formed]) and store.get(formed) != b"1":
            raise WeightTransferError(abandoned)
        if store.add(f"{namespace}/rank/{rank}", 1) > 1:
            raise WeightTransferError(
                f"weight transfer: rank {rank} of group {token!r} at {where} has joined already: a second engine "
                f"with the same rank_offset + worker_rank, or one that came after the group formed; a new "
                f"group needs a new trainer_init"
            )
        if store.add(f"{namespace}/joined", 1) == world_size and store.compare_set(formed, "", "1") != b"1":
            raise WeightTransferError(abandoned)
        try:
            store.wait([formed], _timedelta(deadline - time.monotonic()))
        except dist.DistStoreError as e:
            if store.compare_set(formed, "", "abandoned") != b"1":  # no rank may form it later
                joined = store.add(f"{namespace}/joined", 0)
                raise WeightTransferTimeoutError(
                    f"weight transfer: {joined} of {world_size} ranks joined group {token!r} at {where} in "
                    f"{time.monotonic() - started:.1f} s (timeout_seconds {timeout_seconds:g}); "
                    f"{'the engines' if rank == 0 else 'the other ranks'} did not come"
                ) from e
        if store.get(formed) != b"1":
            raise WeightTransferError(abandoned)
    except WeightTransferError:
        raise
    except (RuntimeError, ValueError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        cls = (
            WeightTransferError
            if rank == 0 and "address already in use" in str(e).lower()
            else WeightTransferTimeoutError
        )
        raise cls(
            f"weight transfer: rank {rank} of {world_size} could not form the group at {where} in "
            f"{time.monotonic() - started:.1f} s (timeout_seconds {timeout_seconds:g}): {first_line(e)}"
        ) from e
    store.set_timeout(_timedelta(timeout_seconds))
    return store, namespace


def first_line(e: BaseException) -> str:
    """A torch.distributed error's message without its C++ source location, cut at its first line / hint."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(" This is typically")[0]
    return line[:200]
