"""Weight sync from a trainer into a live FP8 engine over the "nccl" backend, against the floor of
broadcasting the same bytes on the same group.

Two processes on one machine: a spawned trainer (rank 0) holding the checkpoint's BF16 tensors in
memory, and the engine (this process, rank 1) holding ``layerwise.load_model(path, quantization="fp8")``.
gloo on CPU; NCCL with ``--device cuda`` (the trainer on a second GPU: NCCL refuses two ranks on one
device). 127.0.0.1, a free port, and every wait bounded by ``--timeout`` seconds. Cases:

  floor: unpacked   the trainer broadcasts each tensor's bytes; the engine receives them into preallocated
                    buffers and does nothing else (two broadcasts in flight, as the backend)
  floor: packed     the same bytes as the packed buckets (packed before the clock starts)
  update: unpacked  trainer_send_weights -> layerwise.transfer.update_weights, each tensor alone
  update: packed    the same in buckets of --bucket-mib MiB, 2 buffers
  update: packed, verify   the same with verify=True: a checksum of every bucket, sender's against receiver's

The header check (issue 32): before each bucket one all-reduce of 8 int64 (bytes, tensor count, digest of
names/dtypes/shapes, verify), and one for the end of the update. check_seconds: of the best update run, the
seconds the engine waited for an agreement's result (it posts a header while it loads the bucket before,
so this is what the round trips did not overlap, waiting for the trainer to reach the bucket included).
unchecked_seconds: the best of the same update with the agreement switched off in both processes (a
benchmark-only patch); check_cost = seconds / unchecked_seconds - 1 (target <= 0.02). verify_seconds: the
checksums (CRC-32 on the CPU) and their all-reduces; over_unverified: the verified update / the plain one.

seconds: from the trainer starting to send (its ``time.monotonic()``, one system-wide clock on Linux)
until the engine's last receive returned (floor) or its ``update_weights`` returned (update); best of
``--repeats`` runs after one untimed run. wait_seconds: of the best update run, the seconds the engine
blocked waiting for a broadcast (the rest is its own work: re-quantizing). Per update case, the
untimed run (i) starts from a scrambled engine and is checked bit for bit against a fresh
``load_model`` of the trainer's weights (it fails loudly otherwise), and (ii) measures the receiver's
peak extra bytes with ``layerwise.memory.DeviceMemoryTracker`` (CPU: live torch storages allocated
during the update; CUDA: ``max_memory_allocated`` relative to the start), next to
``ReloadReport.peak_buffered_bytes``.

Each process runs ``--threads`` torch intra-op threads (default: half the cores each; with every core
each, the two processes and gloo's threads oversubscribe the CPU and the update's compute stalls).

Targets (issue 11): packed update <= 1.5x its floor; receiver extra memory <= 2 buckets + one layer
(the checkpoint's largest load group, in bytes; for unpacked a "bucket" is the largest tensor).

    python -m layerwise.benchmarks.weight_transfer [--size default|small] [--device cpu|cuda] [--out-dir DIR]

Writes DIR/<name>.json and prints the table.
"""

from __future__ import annotations

import os
import queue
import socket
import time
from collections import deque
from pathlib import Path

import torch

from layerwise.benchmarks.checkpoints import SIZES, make_checkpoint
from layerwise.benchmarks.checkpoints import shape as checkpoint_shape
from layerwise.benchmarks.machine import describe_machine, provenance
from layerwise.benchmarks.options import (
    add_output_arguments,
    benchmark_parser,
    default_cache_dir,
    positive_int,
    require,
    write_json,
)
from layerwise.benchmarks.readme import weight_transfer_table

TARGET_TIME_OVER_FLOOR = 1.5  # packed update / floor (issue 11)
TARGET_CHECK_COST = 0.02  # update with the header check / without it - 1 (issue 32)
MAX_BUCKET_BYTES = 64 * 2**20  # default bucket: 64 MiB, or less for a small checkpoint (see default_bucket_bytes)
NUM_BUFFERS = 2  # buckets in flight (the backend's default), and broadcasts in flight for unpacked and the floor
DEFAULT_TIMEOUT_SECONDS = 120.0
READY_SECONDS = 600.0  # bound on the trainer's start (imports + reading the checkpoint into memory)
MIB = 2**20


class _Agreed:
    """The wire agreement switched off: every rank takes its own values as agreed (no collective)."""

    def __init__(self, group, values, key, what):
        self.values, self.key, self.what = list(values), key, what

    def result(self):
        return self.values, self.values


def set_header_checks(on: bool) -> None:
    """Switch the wire agreement off (``on`` False) or back on in this process (the trainer's). Only for
    measuring what the check costs; both processes must switch together."""
    from layerwise.transfer import wire

    original = wire.__dict__.setdefault("_benchmark_original_agreement", wire.Agreement)
    wire.Agreement = original if on else _Agreed


def default_bucket_bytes(checkpoint_bytes: int, largest_tensor_bytes: int) -> int:
    """Bucket size in bytes: 64 MiB, halved while the checkpoint fills fewer than 8 buckets (so double
    buffering has something to overlap), but never below the largest tensor (one that does not fit
    travels alone, in a buffer of its own on top of the buckets)."""
    size = MAX_BUCKET_BYTES
    while size // 2 >= largest_tensor_bytes and checkpoint_bytes < 8 * size:
        size //= 2
    return size


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_all(group, buffers: list, keys: list[str], src: int) -> None:
    """Broadcast (or receive) each buffer in order on ``group``, at most NUM_BUFFERS in flight."""
    in_flight: deque = deque()
    for buf, key in zip(buffers, keys, strict=True):
        if len(in_flight) >= NUM_BUFFERS:
            work, k = in_flight.popleft()
            group.wait(work, k, f"floor broadcast of {k}")
        in_flight.append((group.broadcast(buf, src, key), key))
    while in_flight:
        work, k = in_flight.popleft()
        group.wait(work, k, f"floor broadcast of {k}")


def _floor_layout(sizes: list[int], capacity: int | None):
    """The buckets of the floor: one per tensor (unpacked) or the backend's packed layout."""
    from layerwise.transfer.packed_tensor import plan_buckets

    return plan_buckets(sizes, capacity)


# ----------------------------------------------------------------------------- the trainer process


def trainer_main(path: str, device: str, threads: int, commands, replies) -> None:
    """The trainer (rank 0): holds the checkpoint's BF16 tensors in memory on ``device`` (``threads``: its
    torch intra-op threads) and serves

        ("init", init_info)            -> trainer_init; ("ok", None)
        ("send", trainer_args)         -> trainer_send_weights of every tensor; ("ok", start time)
        ("floor", capacity or None)    -> broadcast the same bytes, pre-packed; ("ok", start time)
        ("exit", None)

    Start times are ``time.monotonic()`` seconds taken just before the first byte is sent. Every error
    is replied as ("error", message); a queue idle for READY_SECONDS ends the process.
    """
    from layerwise.checkpoint import Checkpoint
    from layerwise.transfer import tensor_metadata
    from layerwise.transfer.nccl import NCCLWeightTransferEngine
    from layerwise.transfer.packed_tensor import flat_bytes

    device = torch.device(device)
    torch.set_num_threads(threads)
    try:
        ckpt = Checkpoint(path)
        tensors = [(k, t.to(device, copy=True)) for k, t in ckpt]
        ckpt.close()
        replies.put(("ready", tensor_metadata(tensors)))
    except Exception as e:  # noqa: BLE001 -- reported to the engine process
        replies.put(("error", f"{type(e).__name__}: {e}"))
        return
    group, floors = None, {}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    while True:
        try:
            cmd, payload = commands.get(timeout=READY_SECONDS)
        except queue.Empty:
            break  # the engine process is gone
        if cmd == "exit":
            break
        try:
            if cmd == "init":
                group = NCCLWeightTransferEngine.trainer_init(payload, device=device)
                replies.put(("ok", None))
            elif cmd == "send":
                sync()
                start = time.monotonic()
                NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), dict(payload, group=group))
                sync()
                replies.put(("ok", start))
            elif cmd == "checks":
                set_header_checks(payload)
                replies.put(("ok", None))
            elif cmd == "floor":
                if payload not in floors:  # pack once, before any clock starts
                    flat = [flat_bytes(t) for _, t in tensors]
                    buckets = _floor_layout([f.numel() for f in flat], payload)
                    buffers = []
                    for b in buckets:
                        if len(b.entries) == 1:
                            buffers.append(flat[b.entries[0][0]])
                            continue
                        buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
                        for i, offset, nbytes in b.entries:
                            buf[offset : offset + nbytes].copy_(flat[i])
                        buffers.append(buf)
                    floors[payload] = (buffers, [tensors[b.entries[0][0]][0] for b in buckets])
                sync()
                start = time.monotonic()
                _broadcast_all(group, *floors[payload], src=0)
                sync()
                replies.put(("ok", start))
            else:
                replies.put(("error", f"unknown command {cmd!r}"))
        except Exception as e:  # noqa: BLE001 -- reported to the engine process
            replies.put(("error", f"{type(e).__name__}: {e}"))
    if group is not None:
        group.shutdown()


class TrainerProcess:
    """Handle on the spawned trainer; ``close()`` ends it within a few seconds."""

    def __init__(self, path: Path, device: str, threads: int, timeout_seconds: float):
        import torch.multiprocessing as mp

        from layerwise.benchmarks import weight_transfer  # by its package name, even when run with -m

        ctx = mp.get_context("spawn")
        self.timeout_seconds = timeout_seconds
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=weight_transfer.trainer_main,
            args=(str(path), device, threads, self.commands, self.replies),
            daemon=True,
        )
        self.process.start()
        try:
            self.metadata = self.expect("ready", READY_SECONDS)  # the update info's names, dtype_names, shapes
        except BaseException:
            self.close()
            raise

    def send(self, cmd: str, payload=None) -> None:
        self.commands.put((cmd, payload))

    def expect(self, kind: str = "ok", timeout: float | None = None):
        """The payload of the next reply, which must be ``kind``.

        Raises:
            RuntimeError: the trainer replied an error, or nothing within ``timeout`` seconds (default: the
                group timeout plus a minute).
        """
        timeout = timeout if timeout is not None else self.timeout_seconds + 60
        deadline = time.monotonic() + timeout
        while True:  # poll, so a trainer that died is noticed within a second, not at the deadline
            try:
                got, payload = self.replies.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the trainer process exited with {self.process.exitcode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the trainer process replied nothing within {timeout:g} s") from None
        if got != kind:
            raise RuntimeError(f"the trainer process replied {got}: {payload}")
        return payload

    def close(self) -> None:
        if self.process.is_alive():
            self.send("exit")
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


# ----------------------------------------------------------------------------- the engine side


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8)


def differing(model, reference) -> list[str]:
    """Names of the state_dict entries of ``model`` whose bytes (FP8 viewed as uint8) differ from
    ``reference``'s.

    Raises:
        AssertionError: the two state_dicts differ in names, dtypes or shapes.
    """
    ours, theirs = model.state_dict(), reference.state_dict()
    if ours.keys() != theirs.keys():
        raise AssertionError(f"state_dict names differ: {sorted(set(ours) ^ set(theirs))[:5]}")
    out = []
    for name, t in ours.items():
        if t.dtype != theirs[name].dtype or t.shape != theirs[name].shape:
            other = theirs[name]
            raise AssertionError(f"{name}: {t.dtype}{tuple(t.shape)} vs {other.dtype}{tuple(other.shape)}")
        if not torch.equal(_raw(t), _raw(theirs[name])):
            out.append(name)
    return out


def _pointers(model) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in model.state_dict().items()}


def _scramble(model, path: Path) -> None:
    """Reload ``model`` with every checkpoint tensor negated and doubled (FP8 codes and scales change)."""
    import layerwise
    from layerwise.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    try:
        layerwise.reload_weights(model, ((k, t * -2) for k, t in ckpt))
    finally:
        ckpt.close()


class Bench:
    """The engine side: the transfer engine joined to the trainer, the live model, and the reference."""

    def __init__(self, path: Path, device: torch.device, threads: int, timeout_seconds: float):
        import layerwise
        from layerwise.transfer import TensorListUpdateInfo, WeightTransferEngineFactory

        self.path, self.device = path, device
        trainer_device = "cpu"
        if device.type == "cuda":
            if torch.cuda.device_count() < 2:
                raise RuntimeError("--device cuda needs two GPUs: NCCL refuses the trainer and the engine on one")
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = device = torch.device("cuda", index)
            trainer_device = f"cuda:{(index + 1) % torch.cuda.device_count()}"
        self.trainer = TrainerProcess(path, trainer_device, threads, timeout_seconds)
        self.transfer = None
        try:
            self.metadata = self.trainer.metadata
            parsed = TensorListUpdateInfo(**self.metadata)
            self.sizes = [parsed.nbytes(i) for i in range(len(parsed.names))]  # bytes of each tensor, in send order
            info = {
                "master_address": "127.0.0.1",
                "master_port": free_port(),
                "rank_offset": 1,
                "world_size": 2,
                "timeout_seconds": timeout_seconds,
            }
            self.trainer.send("init", info)
            self.transfer = WeightTransferEngineFactory.create_engine("nccl", device=device)
            self.transfer.init_transfer_engine(info)
            self._time_waits(self.transfer.group)
            self._time_checks()
            self.trainer.expect()
            self.model = layerwise.load_model(path, quantization="fp8", device=device)
            self.reference = layerwise.load_model(path, quantization="fp8", device=device)  # the trainer's weights
        except BaseException:
            self.close()
            raise

    def _time_waits(self, group) -> None:
        """Make ``group.wait`` add the seconds this thread blocks in it to ``self.waited`` (on CUDA an NCCL
        wait only orders streams, so this counts host blocking, not transfer time)."""
        inner = group.wait
        self.waited = 0.0

        def wait(work, key, what):
            start = time.monotonic()
            try:
                inner(work, key, what)
            finally:
                self.waited += time.monotonic() - start

        group.wait = wait

    def set_header_checks(self, on: bool) -> None:
        """Switch the header agreement off or on in both processes (see :func:`set_header_checks`)."""
        self.trainer.send("checks", on)
        self.trainer.expect()
        self.agreement_cls = self._wire_functions[0] if on else _Agreed

    def _time_checks(self) -> None:
        """Make the wire agreement add the seconds a rank waits for its result to ``self.checked`` (headers)
        and ``self.verified`` (checksums: computing one, and its all-reduce), in this process; ``close``
        undoes it."""
        from layerwise.transfer import wire

        self._wire_functions = agreement, checksum = wire.Agreement, wire.checksum
        self.agreement_cls = agreement
        self.checked = self.verified = 0.0
        bench = self

        class TimedAgreement:
            def __init__(self, group, values, key, what):
                self.inner = bench.agreement_cls(group, values, key, what)
                self.key, self.what = key, what

            def result(self):
                start = time.monotonic()
                try:
                    return self.inner.result()
                finally:
                    if self.what.endswith("checksum"):
                        bench.verified += time.monotonic() - start
                    else:
                        bench.checked += time.monotonic() - start

        def timed_checksum(data):
            start = time.monotonic()
            try:
                return checksum(data)
            finally:
                self.verified += time.monotonic() - start

        wire.Agreement, wire.checksum = TimedAgreement, timed_checksum

    def _untime_checks(self) -> None:
        from layerwise.transfer import wire

        if hasattr(self, "_wire_functions"):
            wire.Agreement, wire.checksum = self._wire_functions

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def floor(self, capacity: int | None) -> float:
        """One floor run; seconds from the trainer's first send to the engine's last receive."""
        buckets = _floor_layout(self.sizes, capacity)
        buffers = [torch.empty(b.nbytes, dtype=torch.uint8, device=self.device) for b in buckets]
        keys = [self.metadata["names"][b.entries[0][0]] for b in buckets]
        self.trainer.send("floor", capacity)
        _broadcast_all(self.transfer.group, buffers, keys, src=0)
        self._sync()
        end = time.monotonic()
        return end - self.trainer.expect()

    def update(self, capacity: int | None, verify: bool = False):
        """One update; returns (seconds from the trainer's first send to update_weights' return, seconds
        the engine blocked waiting for a broadcast, ReloadReport, seconds of header checks, seconds of
        checksums)."""
        from layerwise.transfer import update_weights

        args = {"packed": capacity is not None, "packed_num_buffers": NUM_BUFFERS, "verify": verify}
        if capacity is not None:
            args["packed_buffer_size_bytes"] = capacity
        info = dict(self.metadata, is_checkpoint_format=True, **args)
        self.waited = self.checked = self.verified = 0.0
        self.trainer.send("send", args)
        try:
            report = update_weights(self.model, self.transfer, {"update_info": info})
        except BaseException:
            try:
                self.trainer.expect()
            except RuntimeError as trainer_error:
                print(f"trainer: {trainer_error}")
            raise
        self._sync()
        end = time.monotonic()
        return end - self.trainer.expect(), self.waited, report, self.checked, self.verified

    def verified_update(self, capacity: int | None, verify: bool = False) -> dict:
        """Scramble the engine, update it under the memory tracker, and check it bit for bit.

        Returns:
            peak_extra_bytes (tracker peak), final_extra_bytes, peak_buffered_bytes (ReloadReport), and
            tensors_changed (state_dict entries the update had to change: scrambled ones).
        Raises:
            AssertionError: the engine differs from a fresh load_model of the trainer's weights, or a
                kernel tensor moved (data_ptr changed).
        """
        from layerwise.memory import DeviceMemoryTracker

        _scramble(self.model, self.path)
        changed = differing(self.model, self.reference)
        if not changed:
            raise AssertionError("scrambling left the engine equal to the reference: the check would prove nothing")
        pointers = _pointers(self.model)
        self._sync()
        with DeviceMemoryTracker(self.device) as tracker:
            report = self.update(capacity, verify)[2]
            # gloo's worker thread drops its reference to the last received bucket just after wait() returns:
            # give it that moment, or the bucket is counted as memory the update kept (seen once: 1 MiB)
            time.sleep(0.2)
        wrong = differing(self.model, self.reference)
        if wrong:
            raise AssertionError(
                f"after the update {len(wrong)} state_dict tensors differ from a fresh load_model of the "
                f"trainer's weights, e.g. {wrong[:5]}"
            )
        moved = [n for n, p in _pointers(self.model).items() if pointers[n] != p]
        if moved:
            raise AssertionError(f"the update moved kernel tensors (data_ptr changed), e.g. {moved[:5]}")
        return {
            "peak_extra_bytes": tracker.peak_bytes,
            "final_extra_bytes": tracker.final_bytes,
            "peak_buffered_bytes": report.peak_buffered_bytes,
            "tensors_changed": len(changed),
        }

    def close(self) -> None:
        self._untime_checks()
        if self.transfer is not None:
            self.transfer.shutdown()
        self.trainer.close()


def default_threads() -> int:
    """Torch intra-op threads per process: half the cores each, so the two processes do not oversubscribe."""
    return max(1, (os.cpu_count() or 2) // 2)


def run(
    size: str,
    device: str,
    repeats: int,
    cache: Path,
    bucket_bytes: int | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    threads: int | None = None,
) -> dict:
    """Every case on the ``size`` checkpoint (generated under ``cache`` if needed); returns the result that
    main writes as JSON (seconds, ratios to the floor, bytes, targets).

    Args:
        bucket_bytes: packed bucket size in bytes (default: :func:`default_bucket_bytes`).
        timeout_seconds: bound on every wait of the group.
        threads: torch intra-op threads of each process (default: :func:`default_threads`); this process's
            setting is restored on return.
    """
    threads = threads or default_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(size, device, repeats, cache, bucket_bytes, timeout_seconds, threads)
    finally:
        torch.set_num_threads(before)


def _run(size, device, repeats, cache, bucket_bytes, timeout_seconds, threads) -> dict:
    from layerwise.checkpoint import Checkpoint

    path = make_checkpoint(size, cache)
    ckpt = Checkpoint(path)
    largest_layer, checkpoint_bytes = max(ckpt.group_bytes().values()), ckpt.total_bytes
    largest_tensor = max(ckpt.tensors[k].nbytes for k in ckpt.keys)
    ckpt.close()
    bucket = bucket_bytes or default_bucket_bytes(checkpoint_bytes, largest_tensor)
    bench = Bench(path, torch.device(device), threads, timeout_seconds)
    try:
        sizes = bench.sizes
        cases = [("unpacked", None), ("packed", bucket)]
        floors = {}
        rows = []
        for label, capacity in cases:
            bench.floor(capacity)  # untimed: packs the trainer's buckets, warms the connection
            floors[label] = min(bench.floor(capacity) for _ in range(repeats))
            n = len(_floor_layout(sizes, capacity))
            rows.append(
                {
                    "case": f"floor: {label}",
                    "seconds": floors[label],
                    "gbps": checkpoint_bytes / floors[label] / 1e9,
                    "broadcasts": n,
                }
            )
        unverified = {}
        for label, capacity, verify in [(label, capacity, False) for label, capacity in cases] + [
            ("packed, verify", bucket, True)
        ]:
            floor = floors[label.split(",")[0]]
            checked = bench.verified_update(capacity, verify)  # untimed: verified, memory-tracked, warms up
            runs = [bench.update(capacity, verify) for _ in range(repeats)]
            seconds, waited, _, check, verify_seconds = min(runs, key=lambda r: r[0])
            unverified.setdefault(label, seconds)
            unchecked = None
            if not verify:
                bench.set_header_checks(False)
                try:
                    unchecked = min(bench.update(capacity)[0] for _ in range(repeats))
                finally:
                    bench.set_header_checks(True)
            slot = capacity if capacity is not None else max(sizes)
            bound = NUM_BUFFERS * slot + largest_layer
            over = seconds / floor
            rows.append(
                {
                    "case": f"update: {label}",
                    "seconds": seconds,
                    "wait_seconds": waited,
                    "check_seconds": check,
                    "check_fraction": check / seconds,
                    **(
                        {
                            "unchecked_seconds": unchecked,
                            "check_cost": seconds / unchecked - 1,
                            "meets_check_target": seconds / unchecked - 1 <= TARGET_CHECK_COST,
                        }
                        if unchecked
                        else {}
                    ),
                    **(
                        {"verify_seconds": verify_seconds, "over_unverified": seconds / unverified["packed"]}
                        if verify
                        else {}
                    ),
                    "floor_seconds": floor,
                    "over_floor": over,
                    **checked,
                    "memory_bound_bytes": bound,
                    "meets_time_target": over <= TARGET_TIME_OVER_FLOOR,
                    "meets_memory_target": checked["peak_extra_bytes"] <= bound,
                    "verified": True,
                }
            )
    finally:
        bench.close()
    return {
        "benchmark": "weight_transfer",
        **provenance(str(bench.device), size, checkpoint_shape(size)),
        "device": str(bench.device),
        "backend": "nccl (gloo)" if bench.device.type == "cpu" else "nccl (NCCL)",
        "checkpoint": str(path),
        "config": dict(SIZES[size]),
        "checkpoint_bytes": checkpoint_bytes,
        "tensors": len(sizes),
        "largest_tensor_bytes": max(sizes),
        "largest_layer_checkpoint_bytes": largest_layer,
        "packed_buffer_size_bytes": bucket,
        "packed_num_buffers": NUM_BUFFERS,
        "target_time_over_floor": TARGET_TIME_OVER_FLOOR,
        "target_check_cost": TARGET_CHECK_COST,
        "memory_target": "peak extra bytes <= 2 buckets (unpacked: 2 x the largest tensor) + the largest layer",
        "repeats": repeats,
        "torch_threads_per_process": threads,
        "machine": describe_machine(str(bench.device)),
        "results": rows,
    }


DEVICE_HELP = "cpu (gloo) or cuda (NCCL, needs two GPUs) (default: cpu)"


def main(argv=None) -> int:
    """Parse ``argv``, run, write DIR/NAME.json, print the table.

    Raises:
        MissingDependencyError: transformers (which generates the checkpoint) is missing; checked first.
        AssertionError: an update did not produce the trainer's weights bit for bit.
    """
    parser = benchmark_parser("python -m layerwise.benchmarks.weight_transfer", __doc__, DEVICE_HELP)
    parser.add_argument("--repeats", type=positive_int, default=3, help="best of this many runs (default: 3)")
    parser.add_argument(
        "--bucket-mib",
        type=positive_int,
        default=None,
        metavar="MIB",
        help="packed bucket size in MiB (default: 64, halved while the checkpoint fills fewer than 8 buckets, "
        "but not below its largest tensor)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"bound on every wait of the group (default: {DEFAULT_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch intra-op threads of each of the two processes (default: half the cores)",
    )
    add_output_arguments(parser, default_name="weight_transfer_<device>_<size>")
    args = parser.parse_args(argv)
    require(["transformers"], purpose="python -m layerwise.benchmarks.weight_transfer")

    bucket = args.bucket_mib * MIB if args.bucket_mib else None
    cache = args.cache_dir or default_cache_dir()
    result = run(args.size, args.device, args.repeats, cache, bucket, args.timeout, args.threads)
    device = torch.device(args.device).type
    path = write_json(result, args.out_dir, args.name or f"weight_transfer_{device}_{args.size}")
    print(weight_transfer_table(result))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
