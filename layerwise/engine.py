"""A small generation engine: static KV cache, greedy decoding, CUDA-graph-captured decode step.

The decode step has static shapes (max_batch_size x 1 tokens against a max_seq_len cache), so on
CUDA it is captured once with ``torch.cuda.CUDAGraph`` and replayed. Reloading weights writes into
the very tensors the graph reads (see :func:`layerwise.reload_weights`), so the graph is never
recaptured. On CPU the same step runs eagerly.

Weights change only between forward steps: every prefill and decode step holds the engine's
``weight_update_lock()``, and so do ``reload_weights`` and the weight-sync calls (``update_weights``,
or ``start_weight_update`` ... ``finish_weight_update``), so an update requested while the engine is
generating waits for the current step and no forward ever sees a half-written module.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Sequence

import torch
from torch import nn

from layerwise.api import ReloadReport, Weights, reload_weights
from layerwise.quant.moe_base import capture_path


class Engine:
    """Greedy generation over a loaded model.

    Args:
        model: a model from :func:`layerwise.load_model`.
        max_batch_size: most prompts per ``generate`` call (the captured batch size).
        max_seq_len: most tokens per sequence, prompt plus generated (the KV cache length).
        use_cuda_graph: capture the decode step; default: True on CUDA, and never on CPU.
    Raises:
        ValueError: use_cuda_graph=True on a non-CUDA model.
    Memory: the KV cache takes 2 x layers x max_batch_size x max_seq_len x kv_heads x head_dim
    elements of the embedding dtype (kv_heads: this rank's, under tensor parallelism).
    Tensor parallelism: every rank of ``model.tp_group`` wraps its shard in an Engine and calls the same
    methods with the same arguments (each forward step runs collectives over the group).
    """

    def __init__(
        self, model: nn.Module, max_batch_size: int = 8, max_seq_len: int = 256, use_cuda_graph: bool | None = None
    ):
        self.model = model
        embed = model.model.embed_tokens.weight
        self.device, self.dtype = embed.device, embed.dtype
        cfg = model.config
        attn = model.model.layers[0].self_attn
        shape = (max_batch_size, max_seq_len, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self.use_cuda_graph = use_cuda_graph
        self._ids = torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device)
        self._logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        self._weights_lock = threading.Lock()  # held by each forward step and by each weight update
        self._held_update_lock = False  # start_weight_update ... finish/abort hold it across calls
        self._update_owner: int | None = None  # the thread that opened that update
        self.transfer_engine = None  # set by init_weight_transfer_engine

    @classmethod
    def from_pretrained(cls, path, max_batch_size: int = 8, max_seq_len: int = 256, **load_kwargs) -> Engine:
        """Load ``path`` with :func:`layerwise.load_model` (same keyword arguments) and wrap it."""
        from layerwise.api import load_model

        return cls(load_model(path, **load_kwargs), max_batch_size, max_seq_len)

    def _decode_step(self) -> torch.Tensor:
        return self.model(self._ids, self._pos, self.kv_caches)[:, -1]

    def _capture(self) -> None:
        # warm up kernels and allocator outside the graph, on the stream that then captures (a library's
        # per-stream workspace, cuBLAS's, is then not allocated inside the graph), along the path the capture
        # takes (MoE layers: every expert; a Triton kernel cannot be loaded while its stream captures)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), capture_path():
            for _ in range(2):
                self._decode_step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self._logits = self._decode_step()
        self.captures += 1

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step of every batch row: the step :meth:`generate` runs (a CUDA graph replay on CUDA, captured
        at the first call), writing each row's key and value at its position in the KV cache.

        Args:
            tokens: int64 [max_batch_size, 1], each row's next input token, on the engine's device.
            positions: int64 [max_batch_size, 1], their positions (< max_seq_len).
        Returns:
            logits [max_batch_size, vocab] in the model's dtype. With a CUDA graph this is the graph's own output
            buffer, overwritten by the next call: clone it to keep it.
        """
        self._ids.copy_(tokens)
        self._pos.copy_(positions)
        if not self.use_cuda_graph:
            return self._decode_step()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self._logits

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int
    ) -> list[list[int]] | torch.Tensor:
        """Greedy continuation of each prompt.

        Args:
            prompts: up to ``max_batch_size`` prompts: a list of token-id lists (lengths may
                differ), or a 2-D integer tensor [B, T] (every prompt T tokens, any device).
            max_new_tokens: tokens to generate per prompt (>= 0).
        Returns:
            for a list, one list of ``max_new_tokens`` new token ids per prompt; for a tensor, an
            int64 tensor [B, max_new_tokens] on the prompts' device.
        Raises:
            TypeError: prompts are neither a list of int lists nor an integer tensor.
            ValueError: a tensor that is not 2-D, too many prompts, an empty prompt, a token id
                outside the vocabulary, or prompt + new tokens > max_seq_len.
        """
        self._refuse_nested_update()
        as_tensor = isinstance(prompts, torch.Tensor)
        token_lists = _prompt_lists(prompts)
        vocab = self.model.config.vocab_size
        if not 0 < len(token_lists) <= self.max_batch_size:
            raise ValueError(f"between 1 and {self.max_batch_size} prompts, got {len(token_lists)}")
        if any(len(p) == 0 for p in token_lists):
            raise ValueError("empty prompt")
        if any(not 0 <= t < vocab for p in token_lists for t in p):
            raise ValueError(f"a token id is outside the vocabulary [0, {vocab})")
        if max(len(p) for p in token_lists) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt + {max_new_tokens} new tokens exceeds max_seq_len={self.max_seq_len}")
        generated = self._generate(token_lists, max_new_tokens)
        if as_tensor:
            return torch.tensor(generated, dtype=torch.long, device=prompts.device).reshape(len(generated), -1)
        return generated

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        b = self.max_batch_size
        tokens = torch.zeros(b, 1, dtype=torch.long, device=self.device)
        positions = torch.zeros(b, 1, dtype=torch.long, device=self.device)
        for i, prompt in enumerate(prompts):  # prefill one sequence at a time into its cache row
            ids = torch.tensor([prompt], device=self.device)
            pos = torch.arange(len(prompt), device=self.device)[None]
            caches = [(k[i : i + 1], v[i : i + 1]) for k, v in self.kv_caches]
            with self._weights_lock:
                tokens[i, 0] = self.model(ids, pos, caches)[0, -1].argmax()
            positions[i, 0] = len(prompt)
        out = [tokens[:, 0].clone()]
        for _ in range(max_new_tokens - 1):  # rows past len(prompts) decode padding and are ignored
            with self._weights_lock:
                tokens = self.decode(tokens, positions).argmax(-1, keepdim=True)
            positions = positions + 1
            out.append(tokens[:, 0].clone())
        generated = torch.stack(out, dim=1).tolist()
        return [generated[i] for i in range(len(prompts))]

    @contextlib.contextmanager
    def weight_update_lock(self):
        """Hold off forward steps while weights change (waits for the step in flight to end).

        On CUDA the step's kernels may still run when the lock is released; the update's copies are
        issued on the same stream after them, so they never overlap.
        """
        self._refuse_nested_update()
        with self._weights_lock:
            yield

    def reload_weights(self, weights: Weights, **kwargs) -> ReloadReport:
        """:func:`layerwise.reload_weights` on the engine's model, between forward steps; the captured
        graph stays valid."""
        with self.weight_update_lock():
            return reload_weights(self.model, weights, **kwargs)

    # ---- weight sync from a trainer (layerwise.transfer), named as vLLM's engine methods ----

    def init_weight_transfer_engine(self, backend: str, init_info) -> None:
        """Create and connect a weight-transfer backend ("nccl" or "ipc", or a registered one).

        Args:
            backend: a name registered with ``WeightTransferEngineFactory``.
            init_info: the backend's init info: a dict, a ``WeightTransferInitRequest`` or the typed
                dataclass (e.g. nccl: master_address, master_port, rank_offset, world_size). With a
                tensor-parallel model, every rank calls this and joins as ``rank_offset + model.tp.rank``;
                each receives the full tensors and keeps its own slices.
        Raises:
            ValueError: an unknown backend or init-info field (named); a backend other than nccl for a
                tensor-parallel model.
        """
        from layerwise.transfer import WeightTransferEngineFactory, WeightTransferInitRequest

        tp = getattr(self.model, "tp", None)  # under tensor parallelism each rank joins at rank_offset + its rank
        rank = {}
        if tp is not None and tp.size > 1:
            if backend != "nccl":
                raise ValueError(f"a tensor-parallel engine receives weights over nccl only, not {backend!r}")
            rank = {"worker_rank": tp.rank}
        engine = WeightTransferEngineFactory.create_engine(backend, device=self.device, **rank)
        if isinstance(init_info, WeightTransferInitRequest):
            init_info = init_info.init_info
        if isinstance(init_info, dict):
            init_info = engine.parse_init_info(init_info)
        engine.init_transfer_engine(init_info)
        self.transfer_engine = engine

    def update_weights(self, request, *, atomic: bool = False) -> ReloadReport:
        """Receive one update from the trainer through the engine's transfer backend, between forward
        steps (see :func:`layerwise.transfer.update_weights` for the request and the errors).

        Raises:
            RuntimeError: no transfer backend (call init_weight_transfer_engine first).
        """
        from layerwise.transfer import update_weights

        if self.transfer_engine is None:
            raise RuntimeError("no weight-transfer backend: call engine.init_weight_transfer_engine(...) first")
        return update_weights(self, self.transfer_engine, request, atomic=atomic)

    def start_weight_update(self, is_checkpoint_format: bool = True, *, atomic: bool = False):
        """Open an update (vLLM's start_weight_update); forward steps wait until it is finished or
        aborted. Returns the open ``layerwise.transfer.WeightUpdate``."""
        from layerwise.transfer import start_weight_update

        self._refuse_nested_update()
        self._weights_lock.acquire()
        try:
            update = start_weight_update(self.model, is_checkpoint_format, atomic=atomic)
        except BaseException:
            self._weights_lock.release()
            raise
        self._held_update_lock, self._update_owner = True, threading.get_ident()
        return update

    def receive_weights(self, update_info, transfer_engine=None) -> None:
        """Receive one update (or one chunk) into the open update, from ``transfer_engine`` or the
        engine's own backend."""
        from layerwise.transfer import receive_weight_update

        receive_weight_update(self.model, transfer_engine or self.transfer_engine, update_info)

    def finish_weight_update(self) -> ReloadReport:
        """Finish the open update (atomic: commit it) and let forward steps run again."""
        from layerwise.transfer import finish_weight_update

        try:
            return finish_weight_update(self.model)
        finally:
            self._release_update_lock()

    def abort_weight_update(self) -> list[str]:
        """Abort the open update and let forward steps run again; returns the modules it had already
        overwritten (see ``layerwise.transfer.abort_weight_update``)."""
        from layerwise.transfer import abort_weight_update

        try:
            return abort_weight_update(self.model)
        finally:
            self._release_update_lock()

    def shutdown_weight_transfer(self) -> None:
        """Close the transfer backend's connection (its process group or shared memory)."""
        if self.transfer_engine is not None:
            self.transfer_engine.shutdown()
            self.transfer_engine = None

    def _refuse_nested_update(self) -> None:
        """Raise instead of waiting forever when this thread's own open update holds the lock (another
        thread's update is simply waited for)."""
        if self._held_update_lock and self._update_owner == threading.get_ident():
            raise RuntimeError(
                "a weight update opened with start_weight_update is in progress on this engine: call "
                "finish_weight_update() or abort_weight_update() first (generate, reload_weights and "
                "update_weights wait for it)"
            )

    def _release_update_lock(self) -> None:
        if self._held_update_lock:
            self._held_update_lock, self._update_owner = False, None
            self._weights_lock.release()


def _prompt_lists(prompts) -> list[list[int]]:
    """Prompts as lists of Python ints, from a list of int sequences or a 2-D integer tensor."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.is_floating_point() or prompts.is_complex():
            raise ValueError(
                f"a prompt tensor must be a 2-D integer tensor [B, T], got {prompts.dtype} "
                f"of shape {tuple(prompts.shape)}"
            )
        return prompts.tolist()
    try:
        return [[operator.index(t) for t in p] for p in prompts]  # ints, numpy ints, 0-d int tensors
    except TypeError as e:
        raise TypeError(f"prompts must be a list of token-id lists (ints) or a 2-D integer tensor: {e}") from e
