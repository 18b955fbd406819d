"""A checkpoint that changes while it is reloaded (issue 32): a shard truncated, rewritten in place with another
checkpoint's bytes, or replaced, is a ReloadError naming the file and what changed; never a signal (a truncated
memory-mapped shard killed the process with SIGBUS), never a silent mix of two checkpoints.

A reload that could kill its process runs in a spawned child that reports what it saw; the test asserts the child
exited normally (exit code 0, not -7 for SIGBUS) and what it reported.
"""

import functools
import json
import multiprocessing as mp
import os
import shutil
import traceback

import pytest
import torch

import layerwise
from layerwise.api import model_digest
from layerwise.checkpoint import Checkpoint, LazyTensor
from layerwise.errors import CheckpointChangedError
from tests.hf_checkpoints import write_hf_checkpoint

ARCH = "Qwen3ForCausalLM"
CHILD_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three 3-layer Qwen3 checkpoints of one layout (shards of at most 64 KB) and different values: the live
    model's (seed 2), the one reloaded (seed 0), and the one whose bytes overwrite it midway (seed 1)."""
    root = tmp_path_factory.mktemp("changing-shards")
    return {seed: write_hf_checkpoint(root / f"seed{seed}", ARCH, seed=seed, num_layers=3) for seed in (0, 1, 2)}


def _copy(src, tmp_path, name="reloaded"):
    return shutil.copytree(src, tmp_path / name)


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _after_reads(n, change):
    """Make ``change(shard_path)`` happen right after the n-th checkpoint read returns, to the file it read."""
    original = LazyTensor.materialize
    count = 0

    def materialize(self):
        nonlocal count
        tensor = original(self)
        count += 1
        if count == n:
            change(self.checkpoint.file_of(self.key))
        return tensor

    LazyTensor.materialize = materialize


def _during_read(n, change):
    """Make ``change(shard_path)`` happen inside the n-th checkpoint read: after the checks before it, before its
    bytes are read."""
    original, real_preadv = LazyTensor.materialize, os.preadv
    count, armed = 0, []

    def preadv(fd, buffers, offset):
        if armed:
            change(armed.pop())
        return real_preadv(fd, buffers, offset)

    def materialize(self):
        nonlocal count
        count += 1
        if count == n:
            armed.append(self.checkpoint.file_of(self.key))
        return original(self)

    os.preadv = preadv
    LazyTensor.materialize = materialize


def _truncate(path):
    """Cut every tensor's bytes off, the header kept: the tensor just read too (a memory-mapped view of it would
    now raise SIGBUS when used)."""
    with open(path, "rb") as f:
        os.truncate(path, 8 + int.from_bytes(f.read(8), "little"))


def _overwrite(other_dir, path):
    """In place: the same file, same size, another checkpoint's bytes of the same layout."""
    data = (other_dir / os.path.basename(path)).read_bytes()
    assert len(data) == os.path.getsize(path), "not the same layout"
    with open(path, "r+b") as f:
        f.write(data)


def _replace(other_dir, path):
    """os.replace: a new file (another inode) at the shard's path, as a writer that saves atomically leaves it."""
    shutil.copyfile(other_dir / os.path.basename(path), path + ".new")
    os.replace(path + ".new", path)


def _mismatches(model, updated, new_dir, old_dir):
    """Parameters that hold what they may not: a module keeps its old values, or, listed as updated, holds the new
    checkpoint's (as it was before the change); anything else (a mix, the other checkpoint's bytes) is wrong. A
    module listed may still hold its old values: one replayed into its live tensors (Limitations 11) is listed
    once its reads start."""
    new, old = layerwise.load_model(new_dir).state_dict(), layerwise.load_model(old_dir).state_dict()
    wrong = []
    for name, t in model.state_dict().items():
        if not torch.equal(_bytes(t), _bytes(old[name])):
            if name.rsplit(".", 1)[0] not in updated or not torch.equal(_bytes(t), _bytes(new[name])):
                wrong.append(name)
    return wrong


def _reload_while_changing(live, source, pristine, change, atomic, when=_after_reads, n=3):
    """Load ``live``, reload ``source`` while ``change`` hits the shard of the n-th read (``when``: after it or
    during it); report what happened. ``pristine``: an unchanged copy of the source, for the expected values."""
    model = layerwise.load_model(live)
    before = model_digest(model)
    when(n, change)
    try:
        layerwise.reload_weights(model, source, atomic=atomic)
    except layerwise.ReloadError as e:
        error = e
    else:
        return {"error": None}
    return {
        "error": type(error).__name__,
        "cause": type(error.cause).__name__,
        "message": str(error),
        "file": error.file,
        "updated": error.updated_modules,
        "mismatches": _mismatches(model, error.updated_modules, pristine, live),
        "unchanged": model_digest(model) == before,
        "finite": bool(torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()),
    }


def _child(report_path, fn, args):
    try:
        report = fn(*args)
    except BaseException:
        report = {"raised": traceback.format_exc()}
    with open(report_path, "w") as f:
        json.dump(report, f)


def _in_child(tmp_path, fn, *args):
    """Run ``fn(*args)`` in a spawned process; its report (a JSON-able dict) once it exited normally."""
    report_path = tmp_path / "report.json"
    proc = mp.get_context("spawn").Process(target=_child, args=(str(report_path), fn, args))
    proc.start()
    proc.join(CHILD_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"the child did not finish in {CHILD_TIMEOUT_S} s")
    assert proc.exitcode == 0, f"the child died with exit code {proc.exitcode} (-7: SIGBUS)"
    report = json.loads(report_path.read_text())
    assert "raised" not in report, report["raised"]
    return report


@pytest.mark.parametrize("atomic", [False, True], ids=["in-place", "atomic"])
def test_shard_truncated_midway_is_a_reload_error_not_a_signal(checkpoints, tmp_path, atomic):
    source = _copy(checkpoints[0], tmp_path)
    report = _in_child(tmp_path, _reload_while_changing, checkpoints[2], source, checkpoints[0], _truncate, atomic)
    assert report["error"] == "ReloadError" and report["cause"] == "CheckpointChangedError", report
    shard = report["file"]
    assert os.path.dirname(shard) == str(source) and shard in report["message"]
    assert (
        f"size {os.path.getsize(checkpoints[0] / os.path.basename(shard))} -> {os.path.getsize(shard)} bytes"
        in (report["message"])
    )
    # the model stays usable: each module holds the reloaded values (listed) or its own, nothing else
    assert report["mismatches"] == [] and report["finite"]
    if atomic:
        assert report["updated"] == [] and report["unchanged"]
    else:
        assert report["updated"] and not report["unchanged"]  # the first modules were written before the cut


@pytest.mark.parametrize("how", ["overwritten in place", "replaced"])
def test_shard_rewritten_midway_with_another_checkpoint_is_refused(checkpoints, tmp_path, how):
    source = _copy(checkpoints[0], tmp_path)
    change = functools.partial(_overwrite if how == "overwritten in place" else _replace, checkpoints[1])
    report = _in_child(tmp_path, _reload_while_changing, checkpoints[2], source, checkpoints[0], change, False)
    assert report["error"] == "ReloadError" and report["cause"] == "CheckpointChangedError", report
    assert os.path.dirname(report["file"]) == str(source) and report["file"] in report["message"]
    assert ("mtime" if how == "overwritten in place" else "replaced by another file") in report["message"]
    # no module holds a mix: the updated ones hold the source as it was, every other its old values
    assert report["mismatches"] == [] and report["updated"]


def test_shard_rewritten_during_a_read_never_reaches_the_model(checkpoints, tmp_path):
    source = _copy(checkpoints[0], tmp_path)
    change = functools.partial(_overwrite, checkpoints[1])  # during the first read: embed_tokens, a module alone
    args = (checkpoints[2], source, checkpoints[0], change, False, _during_read, 1)
    report = _in_child(tmp_path, _reload_while_changing, *args)
    assert report["error"] == "ReloadError" and report["cause"] == "CheckpointChangedError", report
    assert "mtime" in report["message"] and report["mismatches"] == []  # embed_tokens kept its values


def test_shard_changed_after_its_last_read_is_refused_before_the_commit(checkpoints, tmp_path):
    source = _copy(checkpoints[0], tmp_path)
    last = len(Checkpoint(source).keys)  # a reload reads each tensor once: after this read, none is left
    args = (checkpoints[2], source, checkpoints[0], functools.partial(_overwrite, checkpoints[1]), True, _after_reads)
    report = _in_child(tmp_path, _reload_while_changing, *args, last)
    assert report["error"] == "ReloadError" and report["cause"] == "CheckpointChangedError", report
    assert "mtime" in report["message"] and report["updated"] == [] and report["unchanged"]  # atomic: no commit


def _short_read(source):
    """A shard truncated between the check before a read and the read itself."""
    ckpt = Checkpoint(source)
    key = "model.layers.1.mlp.down_proj.weight"
    real = os.preadv

    def preadv(fd, buffers, offset):
        os.truncate(ckpt.file_of(key), offset)  # the tensor's bytes are gone when the read starts
        return real(fd, buffers, offset)

    os.preadv = preadv
    try:
        dict(ckpt.iter_lazy())[key].materialize()
    except CheckpointChangedError as e:
        return {"error": str(e), "file": e.file, "expected_file": ckpt.file_of(key)}
    return {"error": None}


def test_short_read_is_an_error_naming_the_file(checkpoints, tmp_path):
    report = _in_child(tmp_path, _short_read, str(_copy(checkpoints[0], tmp_path)))
    assert report["error"] and "short read" in report["error"] and report["file"] == report["expected_file"]


def _same_bytes(model, reference):
    ref = reference.state_dict()
    return [n for n, t in model.state_dict().items() if not torch.equal(_bytes(t), _bytes(ref[n]))]


@pytest.mark.parametrize("quantization", ["fp8", None])
def test_ordinary_reload_equals_a_fresh_load(checkpoints, tmp_path, quantization):
    model = layerwise.load_model(checkpoints[2], quantization=quantization)
    layerwise.reload_weights(model, checkpoints[0])
    assert _same_bytes(model, layerwise.load_model(checkpoints[0], quantization=quantization)) == []
    # and equals a reload of safetensors' own memory-mapped tensors (a reader that shares none of this code)
    oracle = layerwise.load_model(checkpoints[2], quantization=quantization)
    layerwise.reload_weights(oracle, list(Checkpoint(checkpoints[0])))
    assert _same_bytes(model, oracle) == []
    # files replaced between two reloads are no change during one: the next reload reads the new files
    source = _copy(checkpoints[0], tmp_path)
    for name in os.listdir(source):
        if name.endswith(".safetensors"):
            _replace(checkpoints[1], str(source / name))
    layerwise.reload_weights(model, source, atomic=True)
    assert _same_bytes(model, layerwise.load_model(checkpoints[1], quantization=quantization)) == []


@pytest.mark.parametrize(
    "narrow",
    [[], [(0, 3, 5)], [(1, 16, 32)], [(0, 1, 4), (1, 0, 8)], [(1, 63, 1)]],
    ids=["whole", "rows", "columns", "block", "one column"],
)
def test_lazy_slices_read_only_their_bytes(checkpoints, narrow):
    ckpt = Checkpoint(checkpoints[0])
    key = "model.layers.0.self_attn.o_proj.weight"  # [64, 64]
    lazy, expected = dict(ckpt.iter_lazy())[key], ckpt.get_tensor(key)
    for dim, start, length in narrow:
        lazy, expected = lazy.narrow(dim, start, length), expected.narrow(dim, start, length)
    t = lazy.materialize()
    assert t.shape == expected.shape and t.is_contiguous() and torch.equal(_bytes(t), _bytes(expected.contiguous()))
    assert ckpt.bytes_read == expected.numel() * 2


def _load_while_truncating(path):
    _after_reads(3, _truncate)
    try:
        layerwise.load_model(path, mmap=False)  # the default memory map can SIGBUS here (Limitations 13)
    except CheckpointChangedError as e:
        return {"error": type(e).__name__, "message": str(e), "file": e.file}
    return {"error": None}


def test_first_load_of_a_shard_truncated_midway_is_a_checkpoint_error(checkpoints, tmp_path):
    source = _copy(checkpoints[0], tmp_path)
    report = _in_child(tmp_path, _load_while_truncating, source)
    assert report["error"] == "CheckpointChangedError" and os.path.dirname(report["file"]) == str(source)
    assert "size" in report["message"] and report["file"] in report["message"]


def test_read_buffers_are_reused_only_once_their_tensors_are_freed(checkpoints):
    ckpt = Checkpoint(checkpoints[0])
    lazy = dict(ckpt.iter_lazy())
    views = {k: ckpt.get_tensor(k) for k in lazy}
    keys = [k for k in ckpt.keys if k.endswith("proj.weight")][:6]
    held = [lazy[k].materialize() for k in keys[:3]]
    addresses = {t.data_ptr() for t in held}
    for k in keys[3:]:
        t = lazy[k].materialize()  # never over a held tensor's buffer
        assert t.data_ptr() not in addresses and torch.equal(_bytes(t), _bytes(views[k]))
        del t
    assert all(torch.equal(_bytes(t), _bytes(views[k])) for t, k in zip(held, keys, strict=False))
    del held
    assert addresses <= {b.ctypes.data for b in ckpt._buffers.free}  # freed: their buffers serve the next reads


def test_mmap_reads_are_views_and_are_checked_too(checkpoints, tmp_path):
    source = _copy(checkpoints[0], tmp_path)
    ckpt = Checkpoint(source, mmap=True)
    lazy = dict(ckpt.iter_lazy())
    key = "model.layers.0.mlp.up_proj.weight"
    assert not lazy[key].materialize().untyped_storage().resizable()  # a view of the file
    os.utime(ckpt.file_of(key), ns=(0, 0))  # the mtime changes, nothing else
    with pytest.raises(CheckpointChangedError, match="mtime") as e:
        lazy[key].materialize()
    assert e.value.file == ckpt.file_of(key) and e.value.key == key
