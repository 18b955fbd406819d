"""Weight sync from an RL trainer into a live FP8 engine, on one CPU machine (``layerwise sync-demo``).

Two processes, wired as an RL system would wire them (the trainer spawned with torch.multiprocessing, a
gloo group of their own on 127.0.0.1 and a free port, a queue as the control plane):

    trainer (child process, group rank 0)             engine (this process, group rank 1)
                                                      Engine.from_pretrained(ckpt, quantization="fp8")
                                                      generate greedily from PROMPT
    transformers' model of ckpt, float32 master
    weights; one AdamW step on TRAIN_SEQUENCE
    update info (names, dtypes, shapes) --queue-->    engine.init_weight_transfer_engine("nccl", init_info)
    trainer_init + trainer_send_weights --gloo-->     engine.update_weights({"update_info": ...})
    writes the sent tensors to check_dir --queue-->   generate again; compare with load_model(check_dir)
                                    <--queue-- "exit"

The weights travel by Hugging Face name, in checkpoint format (BF16), packed into buckets; the engine
re-quantizes them layer by layer into its FP8 kernel tensors in place (every data_ptr kept).

Every wait is bounded by ``timeout_seconds``: the trainer's start-up (import, load, optimizer step), the
group's rendezvous and each broadcast, and each join. A trainer that dies ends the demo with a
:class:`SyncDemoError` (or a ``WeightTransferTimeoutError``) naming what was waited for, never a hang.

transformers is needed by the trainer only; it is imported inside the functions that use it.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerwise.checkpoint import CONFIG_NAME, SINGLE_FILE
from layerwise.demo import PROMPT
from layerwise.errors import LayerwiseError, WeightTransferError
from layerwise.optional import import_optional
from layerwise.reload.kernel_format import named_kernel_tensors
from layerwise.transfer.packed_tensor import flat_bytes

TRAIN_SEQUENCE = PROMPT + [101, 102, 103, 104, 105, 106, 107, 108]  # the trainer's language-modeling data
LEARNING_RATE = 3e-3  # one AdamW step moves every weight by about this much: greedy tokens change
PACKED_BUFFER_SIZE_BYTES = 8 << 20  # 8 MiB buckets: the demo checkpoint (52 MiB) travels in several
PACKED_NUM_BUFFERS = 2  # double buffering: bucket k + 1 is packed while bucket k is in flight
DEFAULT_TIMEOUT_SECONDS = 60.0
FAULT_ENV = "LAYERWISE_SYNC_DEMO_FAULT"  # read by ``layerwise sync-demo`` to inject a fault (tests)
FAULTS = ("die-before-send",)  # the trainer exits (code 3) after joining the group, before sending


class SyncDemoError(LayerwiseError):
    """The demo's trainer process failed or exited, or the control plane broke."""


class SyncDemoTimeoutError(SyncDemoError, TimeoutError):
    """Nothing came from the trainer process within the timeout."""


# ---- helpers shared by both sides ---------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the trainer hosts the group's store there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_init_info(port: int, timeout_seconds: float) -> dict:
    """Init info of the "nccl" backend (gloo on CPU) for one trainer (rank 0) and one engine (rank 1)."""
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "timeout_seconds": timeout_seconds,
    }


def update_nbytes(update_info: dict) -> int:
    """Bytes of tensor data an update info announces (what the trainer broadcasts, before packing)."""
    from layerwise.transfer.nccl import NCCLWeightTransferUpdateInfo

    info = NCCLWeightTransferUpdateInfo(**update_info)  # checked as the engine checks it
    return sum(info.nbytes(i) for i in range(len(info.names)))


def quiet_import_notices() -> None:
    """Silence third-party notices printed when transformers imports torchao (unusable-library
    warnings on some installs, a torch deprecation): they say nothing about the demo."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


_WAITING_FOR = {
    "update": " (importing transformers, loading the model, taking its optimizer step)",
    "sent": " (finishing its send)",
}


def wait_for(replies, process, what: str, timeout_seconds: float) -> Any:
    """The trainer's next control-plane message ``(kind, payload)``, expected to be of kind ``what``.

    Polls ``replies`` and the process: a dead trainer is reported at once, not after the timeout.

    Args:
        replies: the queue the trainer writes to.
        process: the trainer's ``multiprocessing.Process``.
        what: the expected kind ("update", "sent"): named in errors.
        timeout_seconds: the longest wait (seconds).
    Returns:
        the message's payload.
    Raises:
        SyncDemoTimeoutError: no message within ``timeout_seconds``.
        SyncDemoError: the trainer reported an error, or exited, or sent another kind of message.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            kind, payload = replies.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            break
        except queue.Empty:
            pass
        if not process.is_alive():
            try:  # a message written just before the exit is in the pipe by now
                kind, payload = replies.get(timeout=0.5)
                break
            except queue.Empty:
                raise SyncDemoError(
                    f"the trainer process exited with code {process.exitcode} before sending its {what!r} message"
                ) from None
        if time.monotonic() >= deadline:
            doing = _WAITING_FOR.get(what, "")
            raise SyncDemoTimeoutError(
                f"no {what!r} message from the trainer process{doing} within {timeout_seconds:g} s"
            )
    if kind == "error":
        raise SyncDemoError(f"the trainer failed: {payload}")
    if kind != what:
        raise SyncDemoError(f"expected a {what!r} message from the trainer, got {kind!r}")
    return payload


def stop_process(process, timeout_seconds: float) -> None:
    """Join ``process`` at most ``timeout_seconds``, then kill it (and join it at most 5 s)."""
    process.join(timeout=timeout_seconds)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


def kernel_pointers(model: nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (object id, data_ptr) of every kernel tensor, to check an update wrote in place."""
    return {name: (id(t), t.data_ptr()) for name, t in named_kernel_tensors(model).items()}


def same_tensors(model: nn.Module, reference: nn.Module) -> bool:
    """True when both models have the same kernel tensors by name, with equal dtypes, shapes and bytes."""
    ours, theirs = named_kernel_tensors(model), named_kernel_tensors(reference)
    if ours.keys() != theirs.keys():
        return False
    for name, a in ours.items():
        b = theirs[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if not torch.equal(flat_bytes(a).cpu(), flat_bytes(b).cpu()):
            return False
    return True


# ---- trainer side ------------------------------------------------------------------------------


def train_one_step(model: nn.Module, sequence: list[int], lr: float) -> tuple[float, float]:
    """One AdamW step of a language-modeling loss on ``sequence`` (a stand-in for an RL step).

    Returns:
        the loss before and after the step (nats per token).
    """
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ids = torch.tensor([sequence])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    return loss.item(), after.item()


def weights_to_send(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters by Hugging Face name, cast to BF16 (the checkpoint's dtype).

    ``named_parameters`` lists a tied ``lm_head.weight`` once, as ``model.embed_tokens.weight``, as the
    checkpoint does. Casting copies: the optimizer's float32 master weights are left as they are.
    """
    return [(name, p.detach().to(torch.bfloat16).contiguous()) for name, p in model.named_parameters()]


def write_sent_weights(weights: Iterable[tuple[str, torch.Tensor]], checkpoint: str | os.PathLike, out_dir) -> Path:
    """Write ``weights`` as a one-shard checkpoint with ``checkpoint``'s config.json into ``out_dir``.

    For the demo's check only (a trainer syncing weights writes nothing): the engine compares itself
    with a fresh ``layerwise.load_model`` of this directory. Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(weights), str(out / SINGLE_FILE), metadata={"format": "pt"})
    shutil.copy(Path(checkpoint) / CONFIG_NAME, out / CONFIG_NAME)
    return out


def trainer_main(
    checkpoint: str,
    init_info: dict,
    replies,
    commands,
    check_dir: str,
    lr: float = LEARNING_RATE,
    fault: str | None = None,
) -> None:
    """The trainer process (the target of ``torch.multiprocessing``'s spawn): group rank 0.

    Loads ``checkpoint`` with transformers (float32 master weights), takes one optimizer step, puts
    ``("update", {"update_info": ...})`` on ``replies``, joins the group (``trainer_init``), broadcasts
    the weights (``trainer_send_weights``, packed), writes them to ``check_dir``, puts ``("sent", {...})``
    and waits for ``"exit"`` on ``commands`` (at most the group's ``timeout_seconds``) before leaving
    the group. Any error is put as ``("error", "Type: message")`` and the process exits with code 1,
    without a traceback (Ctrl-C: code 130, also without one). ``fault="die-before-send"``: once the engine
    has joined the group too (it puts ``"joined"`` on ``commands`` when a fault is injected), exit with code 3
    without sending.
    """
    try:
        _trainer(checkpoint, init_info, replies, commands, check_dir, lr, fault)
    except Exception as e:  # noqa: BLE001 -- reported to the engine process, which prints one line
        replies.put(("error", f"{type(e).__name__}: {e}"))
        replies.close()
        replies.join_thread()
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C reaches both processes: the engine process reports it, this one leaves quietly
        raise SystemExit(130) from None


def _trainer(checkpoint, init_info, replies, commands, check_dir, lr, fault) -> None:
    from layerwise.transfer import tensor_metadata
    from layerwise.transfer.nccl import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

    quiet_import_notices()
    transformers = import_optional("transformers", extra="bench", purpose="layerwise sync-demo")
    transformers.utils.logging.disable_progress_bar()  # the engine process prints the demo's output
    torch.manual_seed(0)
    # float32 master weights, as mixed-precision trainers keep them: AdamW's moments and small steps
    # stay exact across steps; what the engine receives is a BF16 copy (the checkpoint's dtype, half
    # the bytes), made fresh for every sync.
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    loss_before, loss_after = train_one_step(model, TRAIN_SEQUENCE, lr)
    weights = weights_to_send(model)
    packing = {
        "packed": True,
        "packed_buffer_size_bytes": PACKED_BUFFER_SIZE_BYTES,
        "packed_num_buffers": PACKED_NUM_BUFFERS,
    }
    update_info = dict(tensor_metadata(weights), is_checkpoint_format=True, **packing)
    replies.put(("update", {"update_info": update_info}))

    group = NCCLWeightTransferEngine.trainer_init(init_info, device="cpu")
    try:
        if fault == "die-before-send":
            commands.get(timeout=init_info["timeout_seconds"])  # "joined": the fault hits the update, not the join
            os._exit(3)
        start = time.perf_counter()
        NCCLWeightTransferEngine.trainer_send_weights(
            iter(weights), NCCLTrainerSendWeightsArgs(group=group, src=0, **packing)
        )
        send_seconds = time.perf_counter() - start
        write_sent_weights(weights, checkpoint, check_dir)
        replies.put(("sent", {"loss_before": loss_before, "loss_after": loss_after, "send_seconds": send_seconds}))
        try:
            commands.get(timeout=init_info["timeout_seconds"])  # "exit": the engine has what it needs
        except queue.Empty:
            pass
    finally:
        group.shutdown()


# ---- engine side -------------------------------------------------------------------------------


def run_sync_demo(
    cache_dir: str | os.PathLike | None = None,
    tokens: int = 8,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    checkpoint: str | os.PathLike | None = None,
    lr: float = LEARNING_RATE,
    fault: str | None = None,
) -> dict:
    """Run the trainer -> engine weight sync once, in this process (the engine) and a spawned trainer.

    Args:
        cache_dir: where the demo checkpoint is generated (default: ``layerwise.demo.default_cache_dir()``).
        tokens: greedy tokens generated before and after the update (>= 1).
        timeout_seconds: bound on every wait (seconds): the trainer's start-up and optimizer step, the
            group's rendezvous, each broadcast, each join.
        checkpoint: a Hugging Face checkpoint directory to use instead of the demo checkpoint (one that
            both transformers and layerwise load, e.g. Qwen3, Qwen2 or Llama).
        lr: the trainer's AdamW learning rate.
        fault: inject a fault: one of :data:`FAULTS` (for tests), or None.
    Returns:
        a dict: ``checkpoint``, ``prompt``, ``tokens_before``, ``tokens_after``, ``tokens_changed``,
        ``update_seconds`` (``engine.update_weights`` wall-clock, seconds), ``send_seconds`` (the
        trainer's ``trainer_send_weights``, seconds), ``bytes_sent`` (tensor data, BF16, in bytes;
        the buckets add up to 15 bytes of alignment per tensor), ``packed_buffer_size_bytes``,
        ``tensors_sent``, ``modules_updated`` (count) and ``updated_modules`` (names),
        ``decoder_layers_updated``, ``tensors_kept`` / ``tensors_total`` (kernel tensors with the same
        object and data_ptr after the update), ``data_ptrs_kept`` (bool), ``equals_fresh_load`` (bool:
        every kernel tensor equals a fresh ``load_model`` of the sent weights, bit for bit),
        ``loss_before`` / ``loss_after`` (the trainer's loss around its step, nats per token).
    Raises:
        ValueError: tokens < 1, timeout_seconds <= 0, or an unknown fault.
        MissingDependencyError: transformers is not installed.
        SyncDemoError / SyncDemoTimeoutError: the trainer failed, exited, or was silent too long.
        WeightTransferTimeoutError: the trainer stopped sending (died) during the update; the engine's
            weights are unchanged (the update is atomic).
    """
    import torch.multiprocessing as mp

    from layerwise.api import load_model
    from layerwise.demo import demo_checkpoint
    from layerwise.engine import Engine
    from layerwise.sampling_params import SamplingParams

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if not timeout_seconds > 0:
        raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    import_optional("transformers", extra="bench", purpose="layerwise sync-demo")  # fail before spawning

    path = Path(checkpoint) if checkpoint is not None else demo_checkpoint(cache_dir)
    engine = Engine.from_pretrained(path, max_batch_size=1, max_seq_len=len(PROMPT) + tokens, quantization="fp8")
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    tokens_before = engine.generate([PROMPT], greedy)[0].outputs[0].token_ids
    pointers = kernel_pointers(engine.model)

    ctx = mp.get_context("spawn")
    replies, commands = ctx.Queue(), ctx.Queue()
    init_info = nccl_init_info(free_port(), timeout_seconds)
    with tempfile.TemporaryDirectory(prefix="layerwise-sync-demo-") as check_dir:
        trainer = ctx.Process(
            target=trainer_main,
            args=(str(path), init_info, replies, commands, check_dir, lr, fault),
            name="layerwise-sync-demo-trainer",
            daemon=True,
        )
        trainer.start()
        done = False
        try:
            request = wait_for(replies, trainer, "update", timeout_seconds)
            engine.init_weight_transfer_engine("nccl", init_info)
            if fault is not None:
                commands.put("joined")
            start = time.perf_counter()
            report = engine.update_weights(request, atomic=True)  # atomic: a failed sync changes nothing
            update_seconds = time.perf_counter() - start
            sent = wait_for(replies, trainer, "sent", timeout_seconds)
            commands.put("exit")
            done = True
        except WeightTransferError as e:  # say what became of the trainer: it died, or it failed too
            stop_process(trainer, 1.0)
            e.message += _trainer_fate(replies, trainer)
            raise
        finally:
            engine.shutdown_weight_transfer()
            stop_process(trainer, timeout_seconds if done else 1.0)  # after a failure: no need to wait
        tokens_after = engine.generate([PROMPT], greedy)[0].outputs[0].token_ids
        now = kernel_pointers(engine.model)
        kept = sum(now.get(name) == ptr for name, ptr in pointers.items())
        equal = same_tensors(engine.model, load_model(check_dir, quantization="fp8"))

    info = request["update_info"]
    return {
        "checkpoint": str(path),
        "prompt": list(PROMPT),
        "tokens_before": tokens_before,
        "tokens_after": tokens_after,
        "tokens_changed": tokens_after != tokens_before,
        "update_seconds": update_seconds,
        "send_seconds": sent["send_seconds"],
        "bytes_sent": update_nbytes(info),
        "tensors_sent": len(info["names"]),
        "packed_buffer_size_bytes": info["packed_buffer_size_bytes"],
        "modules_updated": len(report.updated_modules),
        "updated_modules": list(report.updated_modules),
        "decoder_layers_updated": len(report.updated_decoder_layers),
        "tensors_kept": kept,
        "tensors_total": len(pointers),
        "data_ptrs_kept": kept == len(pointers) and now.keys() == pointers.keys(),
        "equals_fresh_load": equal,
        "loss_before": sent["loss_before"],
        "loss_after": sent["loss_after"],
    }


def _trainer_fate(replies, process) -> str:
    """What became of the trainer, to append to an error message: its own error, or its exit code."""
    try:
        kind, payload = replies.get(timeout=0.5)
        if kind == "error":
            return f"; the trainer reported: {payload}"
    except queue.Empty:
        pass
    if process.exitcode is not None and process.exitcode > 0:
        return f"; the trainer process exited with code {process.exitcode}"
    return ""


def format_sync_demo(result: dict) -> str:
    """The lines ``layerwise sync-demo`` prints for a :func:`run_sync_demo` result."""
    mib = result["bytes_sent"] / 2**20
    return "\n".join(
        [
            f"checkpoint:                 {result['checkpoint']}",
            f"trainer loss (one AdamW step): {result['loss_before']:.3f} -> {result['loss_after']:.3f} nats/token",
            f"tokens before the update:   {result['tokens_before']}",
            f"tokens after the update:    {result['tokens_after']}",
            f"tokens changed:             {result['tokens_changed']}",
            f"update time:                {result['update_seconds']:.3f} s "
            f"(trainer_send_weights: {result['send_seconds']:.3f} s)",
            f"bytes sent:                 {result['bytes_sent']} ({mib:.2f} MiB, BF16, {result['tensors_sent']} "
            f"tensors, packed in {result['packed_buffer_size_bytes'] >> 20} MiB buckets)",
            f"modules updated:            {result['modules_updated']} "
            f"({result['decoder_layers_updated']} decoder layers)",
            f"every data_ptr kept:        {result['data_ptrs_kept']} "
            f"({result['tensors_kept']}/{result['tensors_total']} kernel tensors, same object, same data_ptr)",
            f"engine == fresh load of the sent weights: {result['equals_fresh_load']}",
        ]
    )


def sync_demo_ok(result: dict) -> bool:
    """The demo's claims hold: tokens changed, every data_ptr kept, engine == fresh load."""
    return result["tokens_changed"] and result["data_ptrs_kept"] and result["equals_fresh_load"]


__all__ = [
    "FAULTS",
    "FAULT_ENV",
    "PROMPT",
    "SyncDemoError",
    "SyncDemoTimeoutError",
    "TRAIN_SEQUENCE",
    "format_sync_demo",
    "free_port",
    "run_sync_demo",
    "same_tensors",
    "sync_demo_ok",
    "trainer_main",
    "wait_for",
]
