"""Peak device memory during a load, measured by a tracker that the loader does not feed.

* CUDA: the caching allocator's own statistics (``torch.cuda.max_memory_allocated``), relative to
  what was allocated when tracking started.
* CPU: a TorchDispatchMode that sees every tensor an operator returns and registers each new CPU
  storage (with a weak reference to learn when it is freed). Storages that are views of an
  operator's inputs are not new; memory-mapped checkpoint tensors are created by safetensors
  outside the dispatcher, so they and their views never count - as on a GPU, where they would stay
  in host memory. Anonymous RSS (``/proc/self/status`` RssAnon) is sampled as a second, OS-level
  figure; it includes the Python heap and everything else in the process.
"""

from __future__ import annotations

import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from layerwise.dispatch import EagerDispatchMode

_RSS_SAMPLE_SECONDS = 0.002


def rss_anon_bytes() -> int:
    """Anonymous resident memory of this process in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: ``[t]``, or for a wrapper subclass (torchao's
    Float8Tensor, Int8Tensor, ...) its inner tensors from ``__tensor_flatten__``, recursively."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [p for name in names for p in plain_tensors(getattr(t, name))]


def tensor_bytes(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers (tied counted once).

    Args:
        device: count only tensors on this device (all devices when None).
    """
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        for p in plain_tensors(t.data if isinstance(t, torch.nn.Parameter) else t):
            if device is not None and p.device.type != torch.device(device).type:
                continue
            storage = p.untyped_storage()
            key = (p.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


class _LiveStorageMode(EagerDispatchMode):
    def __init__(self, device_type: str, clock):
        super().__init__()
        self.device_type = device_type
        self.clock = clock
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.peak_rss_anon = rss_anon_bytes()
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self._last_rss = 0.0

    def _sweep(self) -> None:
        dead = [ptr for ptr, (ref, _) in self.live.items() if ref.expired()]
        for ptr in dead:
            self.current -= self.live.pop(ptr)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            p.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type
            for p in plain_tensors(t)
        }
        for t in (p for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) for p in plain_tensors(o)):
            if t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs:
                continue
            self._sweep()
            if ptr in self.live:
                continue
            self.live[ptr] = (StorageWeakRef(storage), nbytes)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.timeline.append((self.clock(), self.current))
            now = time.perf_counter()
            if now - self._last_rss > _RSS_SAMPLE_SECONDS:
                self._last_rss = now
                self.peak_rss_anon = max(self.peak_rss_anon, rss_anon_bytes())
        return out


class DeviceMemoryTracker:
    """Context manager measuring peak bytes of live tensors on ``device`` while it is active.

    Attributes (valid after exit, ``peak_bytes`` and ``timeline`` also while active):
        peak_bytes: maximum bytes of live tensors on the device, allocated inside the context.
        final_bytes: bytes still live at exit.
        timeline: [(seconds since enter, live bytes)] at each allocation (CPU) or at exit (CUDA).
        peak_rss_anon_bytes: largest sampled anonymous RSS of the process (OS figure, CPU only).
        method: "cuda-allocator" or "cpu-live-storages".
        marks: [(name, bytes)] figures recorded by the caller with :meth:`mark`.
    Raises:
        ValueError: a device type other than cpu or cuda.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"memory tracking supports cpu and cuda, not {self.device}")
        self.method = "cuda-allocator" if self.device.type == "cuda" else "cpu-live-storages"
        self._mode: _LiveStorageMode | None = None
        self._t0 = 0.0
        self.final_bytes = 0
        self.peak_rss_anon_bytes = 0
        self._cuda_timeline: list[tuple[float, int]] = []
        self._cuda_peak: int | None = None
        self.marks: list[tuple[str, int]] = []
        self.timeline_marks: list[tuple[float, int]] = []

    def _clock(self) -> float:
        return time.perf_counter() - self._t0

    def __enter__(self) -> DeviceMemoryTracker:
        self._t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _LiveStorageMode("cpu", self._clock)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.final_bytes = torch.cuda.memory_allocated(self.device) - self._base
            # frozen here: the allocator's peak keeps counting whatever runs after the block
            self._cuda_peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self._cuda_timeline = [(0.0, 0), (self._clock(), self.final_bytes)]
        else:
            self._mode.__exit__(*exc)
            self._mode._sweep()
            self.final_bytes = self._mode.current
            self._mode.timeline.append((self._clock(), self.final_bytes))
            self.peak_rss_anon_bytes = max(self._mode.peak_rss_anon, rss_anon_bytes())

    def sample(self) -> None:
        """Record a CUDA timeline point now (CPU records on every allocation by itself)."""
        if self.device.type == "cuda":
            self._cuda_timeline.append((self._clock(), torch.cuda.memory_allocated(self.device) - self._base))

    @property
    def current_bytes(self) -> int:
        """Live bytes now (CPU: after dropping storages freed since the last allocation)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._base
        self._mode._sweep()
        return self._mode.current

    def mark(self, name: str, nbytes: int) -> None:
        """Record a named figure at this moment (e.g. device-equivalent bytes computed by the caller)."""
        self.marks.append((name, nbytes))
        self.timeline_marks.append((self._clock(), nbytes))

    def untracked_bytes(self, tensors) -> int:
        """Bytes of the distinct storages behind ``tensors`` that the tracker never saw allocated
        (CPU: e.g. memory-mapped checkpoint views kept as parameters; always 0 on CUDA)."""
        if self.device.type == "cuda":
            return 0
        seen, total = set(), 0
        for t in tensors:
            for p in plain_tensors(t.data if isinstance(t, torch.nn.Parameter) else t):
                storage = p.untyped_storage()
                ptr = storage.data_ptr()
                if p.device.type == "cpu" and ptr not in self._mode.live and ptr not in seen:
                    seen.add(ptr)
                    total += storage.nbytes()
        return total

    @property
    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            if self._cuda_peak is not None:
                return self._cuda_peak
            return torch.cuda.max_memory_allocated(self.device) - self._base
        return self._mode.peak

    @property
    def timeline(self) -> list[tuple[float, int]]:
        """[(seconds, bytes)], the tracker's samples and any :meth:`mark` figures, in time order."""
        base = self._cuda_timeline if self.device.type == "cuda" else list(self._mode.timeline)
        return sorted(base + self.timeline_marks)
