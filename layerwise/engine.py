"""A rollout engine: vLLM's offline ``generate`` over a loaded model, with weight updates between rollouts.

``Engine.generate(prompts, SamplingParams(...))`` schedules any number of prompts through a slot-based KV
cache (continuous batching, layerwise/scheduler.py), prefills new prompts together in one forward, decodes
every running sequence in one step (a CUDA graph per captured batch size on CUDA, layerwise/model_runner.py),
samples each request with its own parameters and generator (layerwise/sampler.py) and stops at EOS, stop
ids or max_tokens; outputs are vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``.

Weights change only between forward steps: every prefill and decode step holds the engine's
``weight_update_lock()``, and so do ``reload_weights`` and the weight-sync calls (``update_weights``,
or ``start_weight_update`` ... ``finish_weight_update``), so an update requested while the engine is
generating waits for the current step and no forward ever sees a half-written module. Reloading writes
into the very tensors the captured graphs read (see :func:`layerwise.reload_weights`), so no graph is
ever recaptured.

Which weights made a rollout: ``Engine.weight_version`` counts the weight changes made under that lock
(0 after load), every step records the version it ran with, and each output says which versions its
tokens came from (``RequestOutput.weight_versions``, ``CompletionOutput.token_weight_versions``). An
update lands between the steps of a generation in flight, as vLLM's do unless generation is paused
(its ``pause_generation(mode="wait")``); ``wait_for_generate=True`` waits for the generations in flight
to end instead, and holds off those that have not started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import operator
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from layerwise.api import ReloadReport, Weights, reload_weights
from layerwise.kv_calibration import calibrate_kv_scales, calibration_prompts
from layerwise.layers.kv_cache import LayerKVCache, check_kv_cache_dtype
from layerwise.model_runner import ModelRunner
from layerwise.outputs import RequestOutput
from layerwise.sampler import SamplingBatch, position_logprobs, sample, token_logprobs
from layerwise.sampling_params import SamplingParams
from layerwise.scheduler import Request, Scheduler, StopIds

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # prefill budget (padded tokens per forward) unless max_seq_len is larger


class Engine:
    """Generation over a loaded model: vLLM's offline ``LLM.generate`` / ``LLM.chat``, plus weight updates.

    Args:
        model: a model from :func:`layerwise.load_model`.
        max_batch_size: KV cache slots: most sequences decoded together (more prompts wait for a free slot).
        max_seq_len: most tokens per sequence, prompt plus generated (each slot's length).
        use_cuda_graph: capture decode steps as CUDA graphs; default: True on CUDA, and never on CPU.
        tokenizer: a Hugging Face tokenizer for text prompts and outputs, or None (token ids only).
        eos_token_ids: the checkpoint's EOS ids (:meth:`from_pretrained` reads them); with the tokenizer's own
            ``eos_token_id`` they end a completion unless ``ignore_eos``, split as vLLM splits them: the
            tokenizer's EOS gives stop_reason None, the others their id.
        max_num_batched_tokens: most tokens (padding included) in one prefill forward; default
            max(2048, max_seq_len).
        cuda_graph_sizes: the batch sizes captured (default 1, 2, 4, 8, 16, ... up to max_batch_size).
        kv_cache_dtype: "auto" (the model's dtype, default) or "fp8" (e4m3 with a float32 K and V scale per layer,
            vLLM's name): half the cache bytes of BF16. The scales are calibrated (amax / 448,
            layerwise/kv_calibration.py) when the engine is created and again after every weight change
            (:meth:`reload_weights`, :meth:`update_weights`, :meth:`finish_weight_update`, any
            :meth:`weight_update_lock` block), written in place; :meth:`kv_scales` returns them. Values beyond the
            calibrated range are clamped to +-448 (:attr:`kv_clamped_fraction`).
        kv_calibration_prompts: what fp8 calibrates on: strings (with the tokenizer) or token-id lists; default
            the built-in ``DEFAULT_CALIBRATION_TEXT`` (with a tokenizer), else a fixed random id sequence.
    Raises:
        ValueError: use_cuda_graph=True on a non-CUDA model; a size below 1; another kv_cache_dtype; a bad
            calibration prompt.
    Memory: the KV cache takes 2 x layers x max_batch_size x max_seq_len x kv_heads x head_dim
    elements of the embedding dtype, or bytes with fp8 (kv_heads: this rank's, under tensor parallelism).
    Tensor parallelism: every rank of ``model.tp_group`` wraps its shard in an Engine and calls the same
    methods with the same arguments (each forward step runs collectives over the group; the group's first
    rank samples, and the others take its tokens).
    """

    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int = 8,
        max_seq_len: int = 256,
        use_cuda_graph: bool | None = None,
        *,
        tokenizer=None,
        eos_token_ids: Sequence[int] = (),
        max_num_batched_tokens: int | None = None,
        cuda_graph_sizes: Sequence[int] | None = None,
        kv_cache_dtype: str = "auto",
        kv_calibration_prompts: Sequence | None = None,
    ):
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        self.model = model
        self.runner = ModelRunner(model, max_batch_size, max_seq_len, use_cuda_graph, cuda_graph_sizes, kv_cache_dtype)
        self.device, self.dtype, self.use_cuda_graph = self.runner.device, self.runner.dtype, self.runner.use_cuda_graph
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_num_batched_tokens = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_seq_len)
        self.tokenizer = tokenizer
        self._no_tokenizer_reason: str | None = None  # from_pretrained: why the checkpoint's tokenizer is not here
        main = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids) | ({main} if main is not None else set())
        self.stop_ids = StopIds(main, self.eos_token_ids - {main})
        self._request_ids = itertools.count()  # request ids count up across calls, as vLLM's LLM's do
        self._weights_lock = threading.Lock()  # held by each forward step and by each weight update
        self._weight_version = 0  # written with the weights lock held (_end_update), read by steps holding it
        # updates waiting for the lock: forward steps let them go first (a Lock is not fair: a generating thread
        # that releases and retakes it between steps would starve a waiting update for many steps)
        self._updates_waiting = 0
        # _turn guards the counts and owners below; every change to them notifies all its waiters
        self._turn = threading.Condition()
        self._generating_owner: int | None = None  # the thread whose generation owns the KV cache's slots, or None
        # wait_for_generate: updates waiting for the generation in flight (generations not yet started let them go
        # first), and whether one such update holds generations off
        self._updates_waiting_for_generations = 0
        self._generations_held = False
        # start_weight_update ... finish/abort hold the weights lock across calls: the update (a
        # layerwise.transfer.WeightUpdate; what it overwrote, if it fails) and the thread that opened it
        self._open_update = None
        self._update_owner: int | None = None
        self._open_update_holds_generations = False  # it was started with wait_for_generate
        self.transfer_engine = None  # set by init_weight_transfer_engine
        self._kv_clamped_fraction = 0.0
        self._calibration_ids = None  # fp8: the calibration prompts' token ids
        if kv_cache_dtype == "fp8":
            self._calibration_ids = calibration_prompts(
                kv_calibration_prompts, tokenizer, model.config.vocab_size, max_seq_len
            )
            calibrate_kv_scales(self.runner, self._calibration_ids, requantize=False)

    @classmethod
    def from_pretrained(
        cls,
        path,
        max_batch_size: int = 8,
        max_seq_len: int = 256,
        *,
        tokenizer=True,
        use_cuda_graph: bool | None = None,
        max_num_batched_tokens: int | None = None,
        cuda_graph_sizes: Sequence[int] | None = None,
        kv_cache_dtype: str = "auto",
        kv_calibration_prompts: Sequence | None = None,
        **load_kwargs,
    ) -> Engine:
        """Load ``path`` with :func:`layerwise.load_model` (``load_kwargs``: its keyword arguments) and wrap it, with
        the checkpoint's EOS ids (generation_config.json, else config.json) and its tokenizer.

        Args:
            tokenizer: True: the checkpoint's tokenizer when the directory has one and transformers (the ``text``
                extra) is installed, else none (an engine of token ids; a string prompt then raises, naming the
                extra); False: none; or a tokenizer object to use.
            max_batch_size, max_seq_len, use_cuda_graph, max_num_batched_tokens, cuda_graph_sizes, kv_cache_dtype,
                kv_calibration_prompts: as :class:`Engine`.
        Raises:
            what :func:`layerwise.load_model` raises; CheckpointError: the checkpoint's tokenizer files do not load.
        """
        from layerwise.api import load_model
        from layerwise.tokenizer import eos_token_ids, has_tokenizer, load_tokenizer

        missing = None  # why a checkpoint with a tokenizer gives an engine without one
        if tokenizer is True:
            tokenizer = None
            if has_tokenizer(path):
                if importlib.util.find_spec("transformers") is None:
                    missing = f"{path} has a tokenizer, but transformers is not installed"
                else:
                    tokenizer = load_tokenizer(path)
        elif tokenizer is False:
            tokenizer = None
        check_kv_cache_dtype(kv_cache_dtype)  # before the load, not after it
        eos = eos_token_ids(path)
        model = load_model(path, **load_kwargs)
        engine = cls(
            model,
            max_batch_size,
            max_seq_len,
            use_cuda_graph,
            tokenizer=tokenizer,
            eos_token_ids=eos,
            max_num_batched_tokens=max_num_batched_tokens,
            cuda_graph_sizes=cuda_graph_sizes,
            kv_cache_dtype=kv_cache_dtype,
            kv_calibration_prompts=kv_calibration_prompts,
        )
        engine._no_tokenizer_reason = missing
        return engine

    # ---- generation (vLLM's offline API) ----

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far (one per batch size used; reloads and weight updates add none)."""
        return self.runner.captures

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The captured decode graphs, by batch size."""
        return self.runner.graphs

    @property
    def kv_caches(self) -> list[LayerKVCache]:
        """One cache per decoder layer (``k_cache, v_cache = engine.kv_caches[i]``), each [max_batch_size,
        max_seq_len, kv_heads, head_dim] of the model's dtype, or float8_e4m3fn with its ``k_scale`` /
        ``v_scale`` (kv_cache_dtype="fp8")."""
        return self.runner.kv_caches

    @property
    def kv_cache_dtype(self) -> str:
        """ "auto" (the model's dtype) or "fp8" (e4m3 with per-layer scales): the runner's, set at creation."""
        return self.runner.kv_cache_dtype

    def kv_scales(self) -> torch.Tensor | None:
        """The FP8 KV cache's scales, a float32 CPU copy [layers, 2] (column 0: K, 1: V; stored value x scale =
        key or value), or None with kv_cache_dtype="auto"."""
        scales = self.runner.kv_scales
        return None if scales is None else scales.detach().cpu().clone()

    @property
    def kv_clamped_fraction(self) -> float:
        """The fraction of the keys and values written into the FP8 KV cache by the last ``generate`` (or
        ``stream``, ``chat``) that lay beyond the calibrated range and were clamped to +-448; 0.0 with
        kv_cache_dtype="auto". Counts every value written, the padding of a batched prefill and of a CUDA
        graph's batch included (those rarely clamp, so the fraction is, if anything, low)."""
        return self._kv_clamped_fraction

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt (vLLM's ``LLM.generate``).

        Args:
            prompts: one prompt or a list of them; a prompt is a string (needs a tokenizer), a list of token
                ids, ``{"prompt_token_ids": [...]}`` (vLLM's TokensPrompt) or ``{"prompt": "..."}``; a 2-D
                integer tensor [B, T] is B token-id prompts. Any number: those beyond the free slots wait.
            sampling_params: one ``SamplingParams`` for all prompts, a list with one per prompt, or None
                (``SamplingParams()``: temperature 1, 16 tokens, as vLLM's default).
            use_tqdm: show a progress bar of finished prompts.
        Returns:
            one ``RequestOutput`` per prompt, in order, each with its ``n`` completions. Log-probabilities
            (``logprobs`` / ``prompt_logprobs``) are of the raw model distribution: float32 log_softmax of the
            logits the sampler drew from, before temperature, top-k, top-p or min-p (vLLM's default). A weight
            update from another thread may land between two forward steps (unless it was made with
            ``wait_for_generate=True``); each output's ``weight_versions``, and each completion's
            ``token_weight_versions`` (one per token), say which :attr:`weight_version` made its tokens.
        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt of max_seq_len tokens or
                more, n > max_batch_size, a string prompt without a tokenizer (names the ``text`` extra), a
                sampling_params list of the wrong length; nothing has run then, and the engine stays usable.
            TypeError: a prompt of another type.
        """
        requests = self._requests(prompts, sampling_params)
        for _ in self._steps(requests, use_tqdm):
            pass
        return [r.output(self._text) for r in requests]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate one prompt, yielding its ``RequestOutput`` (cumulative: all tokens so far) after every step;
        the last one has ``finished=True``. The prompt is checked at the call (errors as :meth:`generate`);
        ``reload_weights`` and ``update_weights`` (from this thread or another) may land between yields: then the
        completion mixes tokens of both weights, and ``weight_versions`` / ``token_weight_versions`` say which.
        The stream holds the engine from its first step until it ends or is closed: an update with
        ``wait_for_generate=True`` waits for that (from this thread it raises instead)."""
        requests = self._requests(prompt, sampling_params)
        if len(requests) != 1:
            raise ValueError(f"stream takes one prompt, got {len(requests)}; use generate for several")
        return self._stream(requests[0])

    def _stream(self, request: Request) -> Iterator[RequestOutput]:
        for _ in self._steps([request], use_tqdm=False):
            yield request.output(self._text)

    def chat(
        self,
        messages,
        sampling_params=None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Complete conversations through the tokenizer's chat template (vLLM's ``LLM.chat``).

        Args:
            messages: one conversation (a list of ``{"role": ..., "content": ...}``) or a list of them.
            sampling_params: as in :meth:`generate`.
            add_generation_prompt: end the prompt with the assistant turn's opening.
            chat_template: a Jinja template to use instead of the tokenizer's.
        Returns:
            one ``RequestOutput`` per conversation; ``prompt`` is the rendered text.
        Raises:
            ValueError: no tokenizer, or it has no chat template; the errors of :meth:`generate`.
        """
        tokenizer = self._require_tokenizer("chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            try:
                text = tokenizer.apply_chat_template(
                    conversation,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                )
            except ValueError as e:  # transformers: "Cannot use chat template functions ... no template"
                raise ValueError(f"the tokenizer cannot render this chat: {e}") from e
            prompts.append({"prompt": text, "add_special_tokens": False})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step of the sequences in slots 0..B-1, the step :meth:`generate` runs (a CUDA graph
        replay on CUDA), writing each row's key and value at its position in the KV cache.

        Args:
            tokens: int64 [B, 1] (B <= max_batch_size), each slot's next input token.
            positions: int64 [B, 1], their positions (< max_seq_len).
        Returns:
            float32 logits [B, vocab]; with a CUDA graph a view of its output buffer, overwritten by the
            next step of the same size (clone it to keep it).
        """
        self._refuse_nested_update()
        with self._step_lock():
            return self.runner.decode(tokens.view(-1).tolist(), positions.view(-1).tolist())

    def teacher_forced_logits(self, sequences) -> list[torch.Tensor]:
        """The logits the engine's model gives at every position of each sequence, teacher-forced: its weights,
        its KV cache dtype and scales, batched prefill forwards (no sampling). For scoring rollouts against a
        reference policy (``layerwise.benchmarks.mismatch``).

        Args:
            sequences: token-id lists (or a 2-D integer tensor), each of 2 to max_seq_len tokens (a completion that
                stopped at max_seq_len included: its last token is scored, never fed).
        Returns:
            one float32 [len - 1, vocab] per sequence on the engine's device: row j holds the logits predicting
            token j + 1.
        Raises:
            ValueError: a sequence shorter than 2 or longer than max_seq_len, an id outside the vocabulary.
        """
        self._refuse_nested_update()
        if isinstance(sequences, torch.Tensor):
            sequences = sequences.tolist()
        vocab = self.model.config.vocab_size
        sequences = [[int(t) for t in seq] for seq in sequences]
        for i, seq in enumerate(sequences):
            if not 2 <= len(seq) <= self.max_seq_len or not all(0 <= t < vocab for t in seq):
                raise ValueError(
                    f"sequence {i}: needs 2 to {self.max_seq_len} tokens with ids in [0, {vocab}), "
                    f"got {len(seq)} tokens"
                )
        out = []
        with self._owning_kv_cache():
            start = 0
            while start < len(sequences):  # batches within max_batch_size and the prefill token budget
                stop = start + 1
                while (
                    stop < len(sequences)
                    and stop - start < self.max_batch_size
                    and (stop + 1 - start) * max(map(len, sequences[start : stop + 1])) <= self.max_num_batched_tokens
                ):
                    stop += 1
                fed = [seq[:-1] for seq in sequences[start:stop]]  # the last token is only scored
                with self._step_lock():
                    last, full = self.runner.prefill(fed, 0, range(stop - start))
                out.extend(torch.cat([full[i], last[i : i + 1]]) for i in range(stop - start))
                start = stop
        return out

    # ---- generation internals ----

    def _requests(self, prompts, sampling_params) -> list[Request]:
        """Check every prompt and parameter before anything runs, and make the requests."""
        self._refuse_nested_update()
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() != 2 or prompts.is_floating_point() or prompts.is_complex():
                raise ValueError(
                    f"a prompt tensor must be a 2-D integer tensor [B, T], got {prompts.dtype} of shape "
                    f"{tuple(prompts.shape)}"
                )
            prompts = prompts.tolist()
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple))
            and len(prompts) > 0
            and not isinstance(prompts[0], (str, dict, list, tuple))
        )
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__} "
                f"(the number of new tokens is SamplingParams(max_tokens=...))"
            )
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
            if not all(isinstance(p, SamplingParams) for p in params):
                raise TypeError("sampling_params must be a SamplingParams or a list of them")
        vocab = self.model.config.vocab_size
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            text, ids = self._prompt(prompt, i)
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt {i} holds token id {bad}, outside the vocabulary [0, {vocab})")
            if len(ids) >= self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; max_seq_len={self.max_seq_len} leaves no room to generate "
                    f"(the prompt must be shorter than max_seq_len)"
                )
            if p.n > self.max_batch_size:
                raise ValueError(f"n={p.n} completions do not fit max_batch_size={self.max_batch_size} slots")
            requests.append(Request(text, ids, p))
        for request in requests:  # ids only once every request is valid
            request.request_id = str(next(self._request_ids))
        return requests

    def _prompt(self, prompt, index: int) -> tuple[str | None, list[int]]:
        add_special_tokens = True
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                add_special_tokens = prompt.get("add_special_tokens", True)
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt {index}: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            tokenizer = self._require_tokenizer("a text prompt")
            return prompt, list(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        try:
            return None, [operator.index(t) for t in prompt]  # ints, numpy ints, 0-d int tensors
        except TypeError as e:
            raise TypeError(f"prompt {index} must be a string, token ids or a dict: {e}") from e

    def _require_tokenizer(self, what: str):
        if self.tokenizer is None:
            from layerwise.optional import install_hint

            reason = self._no_tokenizer_reason or "this engine has none"
            raise ValueError(
                f"{what} needs a tokenizer, and {reason}: pass token ids, or load a checkpoint with tokenizer files "
                f"through Engine.from_pretrained with transformers installed ({install_hint('text')})"
            )
        return self.tokenizer

    def _text(self, token_ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None or not params.detokenize:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def _namer(self, params: SamplingParams):
        """id -> its text for logprob entries, or None (no tokenizer, or detokenize=False)."""
        if self.tokenizer is None or not params.detokenize:
            return None
        return lambda token_id: self.tokenizer.decode([token_id])

    def _top(self, k: int) -> int:
        """How many most likely tokens a logprobs setting asks for (-1: the whole vocabulary)."""
        return self.model.config.vocab_size if k == -1 else k

    def _steps(self, requests: list[Request], use_tqdm: bool) -> Iterator[None]:
        """Run the requests to their end, one forward step per iteration, owning the KV cache meanwhile."""
        with self._owning_kv_cache():
            yield from self._run(requests, use_tqdm)

    @contextlib.contextmanager
    def _owning_kv_cache(self):
        """Hold the KV cache's slots for this thread (a generation, or teacher-forced scoring)."""
        me = threading.get_ident()
        if self._generating_owner == me:
            raise RuntimeError(
                "this thread is already generating on this engine (an unfinished stream()?): finish or close it "
                "first; the engine's KV cache holds one generation at a time"
            )
        with self._turn:  # another thread's generation is waited for, and so is an update waiting for generations
            self._turn.wait_for(
                lambda: (
                    self._generating_owner is None
                    and not self._generations_held
                    and self._updates_waiting_for_generations == 0
                )
            )
            self._generating_owner = me
        try:
            yield
        finally:
            with self._turn:
                self._generating_owner = None
                self._turn.notify_all()

    def _run(self, requests: list[Request], use_tqdm: bool) -> Iterator[None]:
        from tqdm.auto import tqdm

        for request in requests:
            request.start(self.max_seq_len, self.device)
        scheduler = Scheduler(requests, self.max_batch_size, self.max_num_batched_tokens)
        done = 0
        counts = self.runner.kv_counts
        if counts is not None:
            counts.zero_()
            self._kv_clamped_fraction = 0.0
        with tqdm(total=len(requests), desc="generate", unit="prompt", disable=not use_tqdm) as bar:
            try:
                while scheduler.has_work():
                    self._refuse_nested_update()  # e.g. start_weight_update between a stream's yields, same thread
                    admitted = scheduler.admit()
                    if admitted:
                        self._prefill(scheduler, admitted)
                    else:
                        self._decode(scheduler)
                    moves = scheduler.retire()
                    if moves:  # under the lock: an update re-encodes an FP8 cache in place between steps
                        with self._step_lock():
                            for src, dst, length in moves:
                                self.runner.copy_slot(src, dst, length)
                    if use_tqdm:
                        finished = sum(r.finished for r in requests)
                        bar.update(finished - done)
                        done = finished
                    yield
            finally:
                if counts is not None:  # one host read per generation
                    clamped, written = counts.tolist()
                    self._kv_clamped_fraction = clamped / max(written, 1)

    def _prefill(self, scheduler: Scheduler, admitted: list[Request]) -> None:
        first = len(scheduler.running)
        prompts = [r.prompt_token_ids for r in admitted]
        full_rows = [i for i, r in enumerate(admitted) if r.params.prompt_logprobs is not None]
        with self._step_lock() as version:  # the copies too: an update re-encodes an FP8 cache between steps
            logits, full = self.runner.prefill(prompts, first, full_rows)
            placed = scheduler.place(admitted)
            for slot, (seq, row) in enumerate(placed[len(admitted) :], start=first + len(admitted)):
                self.runner.copy_slot(first + row, slot, len(seq.request.prompt_token_ids))
        for i, row_logits in full.items():
            admitted[i].prompt_logprobs = self._prompt_logprobs(admitted[i], row_logits)
        rows = torch.tensor([row for _, row in placed], device=logits.device)
        seqs = [seq for seq, _ in placed]
        self._sample(seqs, logits.index_select(0, rows), version)

    def _decode(self, scheduler: Scheduler) -> None:
        seqs = scheduler.running
        tokens = [s.token_ids[-1] for s in seqs]
        positions = [s.length - 1 for s in seqs]
        with self._step_lock() as version:
            logits = self.runner.decode(tokens, positions)
        self._sample(seqs, logits, version)

    def _sample(self, seqs, logits: torch.Tensor, weight_version: int) -> None:
        """Draw each sequence's next token from float32 ``logits`` [len(seqs), vocab] (computed with the weights of
        ``weight_version``) and append it."""
        batch = SamplingBatch.of([s.params for s in seqs], [s.generator for s in seqs], logits.device)
        tokens = self._agree(sample(logits, batch))
        token_list = tokens.tolist()
        entries = [None] * len(seqs)
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            ks = [self._top(seqs[i].params.logprobs) for i in wanted]
            values, ranks, top_ids, top_values = token_logprobs(
                torch.log_softmax(logits.index_select(0, rows), -1), tokens.index_select(0, rows), max(ks)
            )
            for j, (i, k) in enumerate(zip(wanted, ks, strict=True)):
                name = self._namer(seqs[i].params)
                entries[i] = position_logprobs(
                    token_list[i], values[j], ranks[j], top_ids[j][:k], top_values[j][:k], name
                )
        for seq, token, entry in zip(seqs, token_list, entries, strict=True):
            seq.append(token, entry, self.stop_ids, weight_version)

    def _prompt_logprobs(self, request: Request, logits: torch.Tensor) -> list:
        """Entries for prompt tokens 1..len-1 from float32 ``logits`` [len - 1, vocab] (the first is None)."""
        ids = request.prompt_token_ids
        if len(ids) == 1:
            return [None]
        targets = torch.tensor(ids[1:], device=logits.device)
        top = self._top(request.params.prompt_logprobs)
        values, ranks, top_ids, top_values = token_logprobs(torch.log_softmax(logits, -1), targets, top)
        name = self._namer(request.params)
        return [None] + [
            position_logprobs(t, values[j], ranks[j], top_ids[j], top_values[j], name) for j, t in enumerate(ids[1:])
        ]

    def _agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism, every rank takes the tokens the group's first rank drew (the ranks' own RNG
        streams differ)."""
        tp = getattr(self.model, "tp", None)
        if tp is None or tp.size == 1:
            return tokens
        import torch.distributed as dist

        dist.broadcast(tokens, src=dist.get_global_rank(tp.group, 0), group=tp.group)
        return tokens

    # ---- weight versions and the weights lock ----

    @property
    def weight_version(self) -> int:
        """How many times the weights changed under the engine's lock: 0 after load, +1 for each completed
        ``reload_weights``, ``update_weights`` (this method, or ``layerwise.transfer.update_weights(engine, ...)``)
        and ``finish_weight_update``, and for each other ``weight_update_lock()`` block that ends normally.

        A failed update counts only when it overwrote something: a non-atomic one whose error lists
        ``updated_modules`` (the weights did change, part old, part new); a failed atomic update, a refused one
        and ``abort_weight_update`` of an update that wrote nothing leave the version as it was. So two tokens of
        the same version were drawn from the same weights; a new version may, rarely, hold the same values (an
        empty update, a lock held without changing anything). Changes made to ``engine.model`` without the
        engine (``layerwise.reload_weights(engine.model, ...)``) are not seen. Under tensor parallelism each rank
        counts its own, equal when every rank makes the same calls.
        """
        return self._weight_version

    @contextlib.contextmanager
    def weight_update_lock(self, *, wait_for_generate: bool = False, wait_timeout: float | None = None):
        """Hold off forward steps while weights change (waits for the step in flight to end), then count a
        weight version (see :attr:`weight_version`: the block is taken to have changed the weights, unless it
        raises an error without ``updated_modules``).

        Args:
            wait_for_generate: also wait for the generation in flight (a ``generate`` call, or a ``stream`` until
                it ends or is closed) to finish, and keep generations that have not started waiting until the
                block ends; False (default, as vLLM): the block runs between two steps of a generation in
                flight, whose later tokens then come from the new weights.
            wait_timeout: most seconds to wait before the block runs; None: as long as it takes.
        Raises:
            TimeoutError: ``wait_timeout`` passed; nothing was held or changed.
            RuntimeError: this thread opened an update with ``start_weight_update`` and has not finished it, or
                (wait_for_generate) this thread's own stream is generating: it would wait for itself forever.

        On CUDA the step's kernels may still run when the lock is released; the update's copies are
        issued on the same stream after them, so they never overlap.

        Yields an :class:`UpdateScope`: set its ``report`` to the block's ``ReloadReport`` and the lock records in it
        what it did after the change (the FP8 KV cache's recalibration, which runs before the lock is released).
        """
        self._begin_update(wait_for_generate, wait_timeout)
        changed, error = False, None
        scope = UpdateScope()
        try:
            yield scope
            changed = True
        except BaseException as e:
            changed, error = _overwrote_something(e), e
            raise
        finally:
            self._end_update(changed, holds_generations=wait_for_generate, report=scope.report, error=error)

    @contextlib.contextmanager
    def _step_lock(self):
        """The weights lock for one forward step, taken only once no weight update is waiting for it; yields the
        weight version the step runs with (no update can land while the step holds the lock)."""
        with self._turn:
            self._turn.wait_for(lambda: self._updates_waiting == 0)
        with self._weights_lock:
            yield self._weight_version

    def _begin_update(self, wait_for_generate: bool, wait_timeout: float | None) -> None:
        """Wait for the turn to change the weights: (wait_for_generate) no generation in flight, then the weights
        lock, ahead of forward steps that have not started. Raises TimeoutError past ``wait_timeout`` seconds,
        holding nothing."""
        self._refuse_nested_update()
        if wait_timeout is not None and not wait_timeout >= 0:
            raise ValueError(f"wait_timeout must be None or >= 0 seconds, got {wait_timeout}")
        deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
        if wait_for_generate:
            self._hold_generations(deadline)
        try:
            self._acquire_for_update(deadline)
        except BaseException:
            if wait_for_generate:
                self._release_generations()
            raise

    def _end_update(
        self,
        changed: bool,
        *,
        holds_generations: bool,
        report: ReloadReport | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Count the version and recalibrate the FP8 KV cache's scales to the new weights (still under the weights
        lock, so a step sees neither before the other), then let forward steps and generations run again.
        ``error``: the update's own error, being raised; a failed calibration is then added to it as a note
        instead of replacing it (its ``updated_modules`` stay where the caller looks)."""
        try:
            if changed:
                self._weight_version += 1
                try:
                    self._recalibrate_kv_scales(report)
                except Exception as e:
                    if error is None:
                        raise
                    error.add_note(f"then the FP8 KV cache's recalibration failed too (scales unchanged): {e}")
        finally:
            self._weights_lock.release()
            if holds_generations:
                self._release_generations()

    def _recalibrate_kv_scales(self, report: ReloadReport | None) -> None:
        """FP8 KV cache: new scales for the new weights; sequences in flight (an update that lands between steps)
        have what they cached re-encoded with them. Records it in ``report``."""
        if self._calibration_ids is None:
            return
        seconds = calibrate_kv_scales(self.runner, self._calibration_ids, requantize=self._generating_owner is not None)
        if report is not None:
            report.kv_scales_recalibrated, report.kv_calibration_seconds = True, seconds

    def _hold_generations(self, deadline: float | None) -> None:
        """Wait until no generation is in flight, and keep new ones from starting until _release_generations.
        Generations that have not started wait behind a waiting update, so a thread that generates in a loop
        cannot keep it waiting; the update waits at most for the generation in flight."""
        if self._generating_owner == threading.get_ident():
            raise RuntimeError(
                "wait_for_generate=True from the thread whose stream() is generating on this engine would wait for "
                "that stream forever: finish or close the stream first, or update without wait_for_generate (the "
                "update then lands between the stream's steps)"
            )
        with self._turn:
            self._updates_waiting_for_generations += 1
            try:
                free = self._turn.wait_for(
                    lambda: self._generating_owner is None and not self._generations_held, _seconds_left(deadline)
                )
                if free:
                    self._generations_held = True
            finally:
                self._updates_waiting_for_generations -= 1
                self._turn.notify_all()
        if not free:
            raise TimeoutError(
                "wait_for_generate: the generation in flight on this engine did not end within wait_timeout "
                "(an unfinished stream that is no longer read holds the engine until it is closed); the weights "
                "were not changed"
            )

    def _release_generations(self) -> None:
        with self._turn:
            self._generations_held = False
            self._turn.notify_all()

    def _acquire_for_update(self, deadline: float | None) -> None:
        """Take the weights lock for an update, ahead of forward steps that have not started yet."""
        with self._turn:
            self._updates_waiting += 1
        try:
            left = _seconds_left(deadline)
            acquired = self._weights_lock.acquire(timeout=-1 if left is None else left)
        finally:
            with self._turn:
                self._updates_waiting -= 1
                self._turn.notify_all()
        if not acquired:
            raise TimeoutError(
                "the weights lock was not free within wait_timeout (another thread's update, opened with "
                "start_weight_update, may still be open); the weights were not changed"
            )

    def reload_weights(
        self, weights: Weights, *, wait_for_generate: bool = False, wait_timeout: float | None = None, **kwargs
    ) -> ReloadReport:
        """:func:`layerwise.reload_weights` on the engine's model, between forward steps; the captured
        graph stays valid. Counts a :attr:`weight_version` when it completes (or fails having overwritten
        modules).

        Args:
            wait_for_generate, wait_timeout: as :meth:`weight_update_lock`: by default the reload lands between two
                steps of a generation in flight (vLLM's behaviour); True waits for it to end.
            kwargs: those of :func:`layerwise.reload_weights` (is_checkpoint_format, atomic).
        """
        with self.weight_update_lock(wait_for_generate=wait_for_generate, wait_timeout=wait_timeout) as scope:
            scope.report = reload_weights(self.model, weights, **kwargs)
            return scope.report

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

    def update_weights(
        self,
        request,
        *,
        atomic: bool = False,
        wait_for_generate: bool = False,
        wait_timeout: float | None = None,
    ) -> ReloadReport:
        """Receive one update from the trainer through the engine's transfer backend, between forward
        steps (see :func:`layerwise.transfer.update_weights` for the request and the errors). Counts a
        :attr:`weight_version` when it completes (or fails having overwritten modules).

        Args:
            wait_for_generate, wait_timeout: as :meth:`weight_update_lock`. By default the update lands between two
                steps of a generation in flight, as vLLM's ``update_weights`` does when generation is not paused;
                True waits for the generation to end, as vLLM's ``pause_generation(mode="wait")`` before it.
        Raises:
            RuntimeError: no transfer backend (call init_weight_transfer_engine first).
        """
        from layerwise.transfer import update_weights

        if self.transfer_engine is None:
            raise RuntimeError("no weight-transfer backend: call engine.init_weight_transfer_engine(...) first")
        with self.weight_update_lock(wait_for_generate=wait_for_generate, wait_timeout=wait_timeout) as scope:
            scope.report = update_weights(self.model, self.transfer_engine, request, atomic=atomic)
            return scope.report

    def start_weight_update(
        self,
        is_checkpoint_format: bool = True,
        *,
        atomic: bool = False,
        wait_for_generate: bool = False,
        wait_timeout: float | None = None,
    ):
        """Open an update (vLLM's start_weight_update); forward steps wait until it is finished or
        aborted. Returns the open ``layerwise.transfer.WeightUpdate``.

        Args:
            wait_for_generate, wait_timeout: as :meth:`weight_update_lock`; with wait_for_generate, generations
                that have not started wait until the update is finished or aborted.
        """
        from layerwise.transfer import start_weight_update

        self._begin_update(wait_for_generate, wait_timeout)
        try:
            update = start_weight_update(self.model, is_checkpoint_format, atomic=atomic)
        except BaseException:
            self._end_update(False, holds_generations=wait_for_generate)
            raise
        self._update_owner = threading.get_ident()
        self._open_update, self._open_update_holds_generations = update, wait_for_generate
        return update

    def receive_weights(self, update_info, transfer_engine=None) -> None:
        """Receive one update (or one chunk) into the open update, from ``transfer_engine`` or the
        engine's own backend."""
        from layerwise.transfer import receive_weight_update

        receive_weight_update(self.model, transfer_engine or self.transfer_engine, update_info)

    def finish_weight_update(self) -> ReloadReport:
        """Finish the open update (atomic: commit it), count a :attr:`weight_version`, and let forward steps run
        again. A failed finish counts a version only when the update overwrote something (its error's
        ``updated_modules``, or what a failed ``receive`` had written before it closed the update)."""
        from layerwise.transfer import finish_weight_update

        update, changed, report, error = self._open_update, False, None, None
        try:
            report = finish_weight_update(self.model)
            changed = True
            return report
        except BaseException as e:
            changed, error = _overwrote_something(e) or bool(update is not None and update.updated), e
            raise
        finally:
            self._release_update_lock(changed, report, error)

    def abort_weight_update(self) -> list[str]:
        """Abort the open update and let forward steps run again; returns the modules it had already
        overwritten (see ``layerwise.transfer.abort_weight_update``). Counts a :attr:`weight_version` only when
        the update had overwritten something (non-atomic)."""
        from layerwise.transfer import abort_weight_update

        update = self._open_update
        try:
            return abort_weight_update(self.model)
        finally:  # the update's list holds what it wrote, also when a failed receive had closed it already
            self._release_update_lock(bool(update is not None and update.updated))

    def shutdown_weight_transfer(self) -> None:
        """Close the transfer backend's connection (its process group or shared memory)."""
        if self.transfer_engine is not None:
            self.transfer_engine.shutdown()
            self.transfer_engine = None

    def _refuse_nested_update(self) -> None:
        """Raise instead of waiting forever when this thread's own open update holds the lock (another
        thread's update is simply waited for)."""
        if self._open_update is not None and self._update_owner == threading.get_ident():
            raise RuntimeError(
                "a weight update opened with start_weight_update is in progress on this engine: call "
                "finish_weight_update() or abort_weight_update() first (generate, reload_weights and "
                "update_weights wait for it)"
            )

    def _release_update_lock(
        self, changed: bool, report: ReloadReport | None = None, error: BaseException | None = None
    ) -> None:
        if self._open_update is not None:
            holds_generations = self._open_update_holds_generations
            self._update_owner = None
            self._open_update, self._open_update_holds_generations = None, False
            self._end_update(changed, holds_generations=holds_generations, report=report, error=error)


@dataclass
class UpdateScope:
    """What a :meth:`Engine.weight_update_lock` block hands back: ``report``, the block's ``ReloadReport`` (or None),
    which the lock completes when the block ends (``kv_scales_recalibrated``, ``kv_calibration_seconds``)."""

    report: ReloadReport | None = None


def _overwrote_something(error: BaseException) -> bool:
    """Whether a failed update changed weights: a ReloadError lists the modules it had overwritten (none when
    atomic, or when it failed before writing)."""
    return bool(getattr(error, "updated_modules", None))


def _seconds_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
