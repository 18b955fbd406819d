"""The KV cache slots and the forward steps the engine runs over them: batched prefill, decode, CUDA graphs.

The cache is slot-based (one row per running sequence, nano-vllm's and vLLM's "slot" before paging): layer
i holds k and v of shape [max_batch_size, max_seq_len, kv_heads, head_dim]. The scheduler keeps the running
sequences in slots 0..n-1 (a finished sequence's slot is refilled by moving the last one into it, see
:meth:`ModelRunner.copy_slot`), so every step works on the leading slice ``cache[:n]``, a view.

- Prefill: the new prompts, right-padded to the longest, in one forward over their slots. A padded query's
  key and value land at positions past its prompt, where decode overwrites them before any query may see
  them (a query at position p attends to positions <= p only), and its logits are dropped.
- Decode: one token per running sequence. On CUDA each step is a CUDA graph replay, one graph per capture
  size (vLLM's: 1, 2, 4, then multiples of 8 up to max_batch_size), captured at its first use; a step
  pads its batch up to the next captured size with dummy rows in free slots. Graphs hold the engine's
  weight tensors by address: reloads and weight updates write into those same tensors, so no graph is
  ever recaptured. Eagerly (CPU), a step attends to the cached prefix its longest sequence needs, rounded
  up to 64 positions, not to the whole ``max_seq_len``.
"""

from __future__ import annotations

import torch
from torch import nn

from layerwise.layers.kv_cache import FP8_DTYPE, FP8_MAX, LayerKVCache, check_kv_cache_dtype
from layerwise.quant.moe_base import capture_path

PREFIX_ROUNDING = 64  # eager decode attends to the cache prefix rounded up to this many positions


def default_capture_sizes(max_batch_size: int) -> list[int]:
    """vLLM's CUDA-graph batch sizes, 1, 2, 4, 8, 16, 24, ..., up to ``max_batch_size`` (always included)."""
    sizes = [s for s in (1, 2, 4, *range(8, max_batch_size + 1, 8)) if s <= max_batch_size]
    return sorted({*sizes, max_batch_size})


class ModelRunner:
    """Runs a model's forward over the slots of a static KV cache.

    Args:
        model: a ``CausalLM`` (``model.model`` gives hidden states, ``model.lm_head.compute_logits`` logits).
        max_batch_size: KV cache slots.
        max_seq_len: positions per slot.
        use_cuda_graph: replay decode steps as CUDA graphs (a CUDA model only); None: on CUDA only.
        capture_sizes: batch sizes to capture (default :func:`default_capture_sizes`); sizes above
            max_batch_size are cut to it, and max_batch_size is always one of them.
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" (e4m3, with the per-layer float32 scales
            :attr:`kv_scales`, 1.0 until :meth:`set_kv_scales`; layerwise/layers/kv_cache.py).
    Raises:
        ValueError: use_cuda_graph=True on a non-CUDA model; a capture size below 1; another kv_cache_dtype.
    Memory: 2 x layers x max_batch_size x max_seq_len x kv_heads x head_dim elements of the model's dtype
    (1 byte each with fp8; kv_heads: this rank's under tensor parallelism), plus per captured size a float32
    logits buffer [size, vocab] and the graph's share of one memory pool.
    """

    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int,
        max_seq_len: int,
        use_cuda_graph: bool | None,
        capture_sizes: list[int] | None = None,
        kv_cache_dtype: str = "auto",
    ):
        self.model = model
        embed = model.model.embed_tokens.weight
        self.device, self.dtype = embed.device, embed.dtype
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        if capture_sizes is not None and any(int(size) < 1 for size in capture_sizes):
            raise ValueError(f"cuda_graph_sizes must be >= 1, got {list(capture_sizes)}")
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        fp8 = kv_cache_dtype == "fp8"
        attn = model.model.layers[0].self_attn
        shape = (max_batch_size, max_seq_len, attn.num_kv_heads, attn.head_dim)
        layers = len(model.model.layers)
        # fp8: float32 [layers, 2] (K, V) scales, each layer's a view of one row, rewritten in place by
        # set_kv_scales; int64 [2] counts (values clamped, values written), reset by the engine per generate
        self.kv_scales = torch.ones(layers, 2, dtype=torch.float32, device=self.device) if fp8 else None
        self.kv_counts = torch.zeros(2, dtype=torch.long, device=self.device) if fp8 else None
        cache_dtype = FP8_DTYPE if fp8 else self.dtype
        self.kv_caches = [
            LayerKVCache(
                torch.zeros(shape, dtype=cache_dtype, device=self.device),
                torch.zeros(shape, dtype=cache_dtype, device=self.device),
                *((self.kv_scales[i, 0:1], self.kv_scales[i, 1:2], self.kv_counts) if fp8 else ()),
            )
            for i in range(layers)
        ]
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.use_cuda_graph = use_cuda_graph
        sizes = default_capture_sizes(max_batch_size) if capture_sizes is None else capture_sizes
        self.capture_sizes = sorted({min(int(s), max_batch_size) for s in sizes} | {max_batch_size})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> its captured decode step
        self._graph_logits: dict[int, torch.Tensor] = {}  # batch size -> the graph's float32 output
        self._pool = None  # one memory pool shared by every graph (only one replays at a time)
        self._ids = torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device)
        self.captures = 0

    def _slots(self, start: int, stop: int, length: int) -> list[LayerKVCache]:
        return [cache.view(start, stop, length) for cache in self.kv_caches]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head.compute_logits(hidden).float()

    @torch.inference_mode()
    def prefill(
        self, prompts: list[list[int]], first_slot: int, full_rows: list[int] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the prompts in one forward, writing their keys and values into slots first_slot, first_slot + 1, ...

        Args:
            prompts: g non-empty token-id lists, each shorter than max_seq_len.
            first_slot: the first of the g consecutive slots they take.
            full_rows: rows (indices into prompts) whose logits at every prompt position are wanted
                (prompt log-probabilities).
        Returns:
            (float32 [g, vocab], the logits at each prompt's last token; row -> float32 [len - 1, vocab],
            the logits predicting its tokens 1..len-1).
        """
        g, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.long, device=self.device)
        positions = torch.arange(width, device=self.device).expand(g, width)
        hidden = self.model.model(ids, positions, self._slots(first_slot, first_slot + g, width))
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        logits = self._logits(hidden[torch.arange(g, device=self.device), last])
        return logits, {i: self._logits(hidden[i, : len(prompts[i]) - 1]) for i in full_rows}

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step of the sequences in slots 0..n-1.

        Args:
            tokens: n next input tokens, one per slot; positions: their positions (< max_seq_len).
        Returns:
            float32 logits [n, vocab]. With CUDA graphs this is a view of the graph's output buffer,
            overwritten by the next step of the same size: read or copy it before then.
        """
        n = len(tokens)
        size = next((s for s in self.capture_sizes if s >= n), None) if self.use_cuda_graph else None
        rows = n if size is None else size
        host = torch.zeros(2, rows, 1, dtype=torch.long)
        host[0, :n, 0] = torch.tensor(tokens, dtype=torch.long)
        host[1, :n, 0] = torch.tensor(positions, dtype=torch.long)
        self._ids[:rows].copy_(host[0], non_blocking=True)
        self._pos[:rows].copy_(host[1], non_blocking=True)
        if size is None:
            length = min(self.max_seq_len, -(-(max(positions) + 1) // PREFIX_ROUNDING) * PREFIX_ROUNDING)
            return self._step(n, length)
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self._graph_logits[size][:n]

    def _step(self, rows: int, length: int) -> torch.Tensor:
        hidden = self.model.model(self._ids[:rows], self._pos[:rows], self._slots(0, rows, length))
        return self._logits(hidden[:, -1])

    def _capture(self, size: int) -> None:
        # warm up kernels and allocator outside the graph, on the stream that then captures (a library's
        # per-stream workspace, cuBLAS's, is then not allocated inside the graph), along the path the capture
        # takes (MoE layers: every expert; a Triton kernel cannot be loaded while its stream captures). The
        # warm-up writes the same keys and values the step itself writes (same tokens, same positions).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), capture_path():
            for _ in range(2):
                self._step(size, self.max_seq_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._graph_logits[size] = self._step(size, self.max_seq_len)
        self.graphs[size] = graph
        self.captures += 1

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` into slot ``dst``, every layer (a finished
        sequence's slot refilled by a running one, or a prompt's cache shared with its other completions)."""
        for k, v in self.kv_caches:
            k[dst, :length].copy_(k[src, :length])
            v[dst, :length].copy_(v[src, :length])

    @torch.inference_mode()
    def set_kv_scales(self, scales: torch.Tensor, requantize: bool) -> None:
        """Write new FP8 KV-cache scales into :attr:`kv_scales` in place (its address, which captured graphs
        read, is kept).

        Args:
            scales: float32 [layers, 2] (K, V), positive and finite.
            requantize: also re-encode what the cache holds with the new scales (x_new = clamp(x_old * old /
                new), one more rounding), for sequences in flight; False when the cache holds nothing live.
        """
        if requantize:
            ratio = self.kv_scales / scales.to(self.kv_scales.device)
            for i, cache in enumerate(self.kv_caches):
                for j, stored in enumerate(cache):
                    for slot in stored:  # one slot at a time: a float32 copy of one slot, not of the whole cache
                        slot.copy_((slot.float() * ratio[i, j]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
        self.kv_scales.copy_(scales)
