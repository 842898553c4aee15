"""One checkpoint directory: DCP tensor files, its ``.metadata``, and a plain-JSON manifest.

Layout of a checkpoint directory (a ``step_N/`` under a run's checkpoint root, or a standalone
directory written by :func:`save_model_full`)::

    .metadata            DCP metadata (pickled by torch; read only through safety.read_metadata_safely)
    __<rank>_<i>.distcp  tensor payloads, up to 2 files per writing rank (read with weights_only=True)
    paratron.json        manifest: format, version, config, step, what is inside, .metadata's sha256,
                         the checksum algorithm (XXH3-64), the checksum and size of every other file,
                         and its own CRC-32 (see integrity)
    config.toml          the config again, for people
    rank_<r>.json        per-rank state (RNG, layout coordinates), CheckpointManager only

Tensor keys: ``model/<logical_name>`` (full logical, unpadded shape) and
``optimizer/<kind>/<logical_name>`` (2-D view of the full tensor).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from paratron.config import from_dict, to_toml

from . import integrity, storage
from .checksummed import ChecksummingWriter
from .dcp_load import local_load
from .dcp_save import collective_save
from .items import MODEL_PREFIX, CheckpointError, StateItems, full_items, model_items
from .legacy import adapt_items, fuse_full
from .dcp_planners import ChunkLoadPlanner, ChunkSavePlanner
from .payload import ZipTemplates
from .safety import (METADATA_FILE, SafeFileSystemReader, check_same_base, check_same_model, file_sha256,
                     read_metadata_safely, refuse_pickle_files)

FORMAT = "paratron-checkpoint"
VERSION = 1
MANIFEST = "paratron.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")


# ---- plain files ---------------------------------------------------------------------------
def write_text_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write ``text`` to ``path`` through a temp file, fsync and ``os.replace`` (all or nothing)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """JSON-encode ``obj`` (plain values only) and write it atomically.

    Raises:
        CheckpointError: ``obj`` holds something JSON cannot encode (named in the message).
    """
    try:
        text = json.dumps(obj, indent=1, sort_keys=True, allow_nan=True)
    except TypeError as e:
        raise CheckpointError(f"{path}: checkpoint metadata must be plain JSON values: {e}") from None
    write_text_atomic(path, text)


def read_json(path: str | os.PathLike) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


# ---- tensors through DCP -------------------------------------------------------------------
def write_items(directory: str | os.PathLike, items: StateItems, *, process_group=None,
                single_process: bool = False, space_root: str | os.PathLike | None = None,
                other_sums: dict | None = None, refuse_nonfinite_at: int | None = None,
                on_commit: Callable[[dict, int], None] | None = None,
                templates: ZipTemplates | None = None) -> dict[str, list]:
    """Save ``items`` into ``directory`` with DCP (collective over ``process_group`` unless
    ``single_process``). Chunks already on the CPU are written straight from their storage, and
    checksummed from the written buffers (:class:`~paratron.checkpoint.checksummed.ChecksummingWriter`).

    Args:
        space_root: where the free space is checked during DCP's planning, before anything is
            written (every rank's, against the whole checkpoint's tensor bytes;
            :class:`~paratron.checkpoint.dcp_planners.ChunkSavePlanner`), and named in a full-disk
            error; None: no check, and ``directory`` is named.
        other_sums: manifest entries of this rank's other files, gathered with its payloads'.
        refuse_nonfinite_at: the step being saved: refuse (on every rank, before ``.metadata`` is
            written) a save whose tensors hold an inf or NaN; None: no check.
        on_commit: ``fn(every rank's sums, bytes of the checkpoint's tensors)``, run on the
            coordinator once ``.metadata`` is durable, inside DCP's last collective: its error
            fails the save on every rank, and when this returns on any rank it has run.
        templates: the zip headers learnt per tensor layout
            (:class:`~paratron.checkpoint.payload.ZipTemplates`), kept across a manager's saves;
            None: learnt afresh.

    Returns:
        ``{name: manifest entry}``: on the coordinator (rank 0 of the group) every rank's payloads
        and ``other_sums``, elsewhere this rank's.

    Raises:
        storage.OutOfSpaceError: not enough free space, or the disk filled up (naming
            ``space_root``, the bytes needed and the bytes free).
        CheckpointError: an inf or NaN (with ``refuse_nonfinite_at``); any other failure, with the
            first failing rank.
    """
    writer = ChecksummingWriter(directory, other_sums=other_sums, refuse_nonfinite_at=refuse_nonfinite_at,
                                on_commit=on_commit, templates=templates)
    planner = ChunkSavePlanner(items, space_root=space_root)
    where = space_root or directory
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process when asked for no_dist; that is the intent.
        warnings.simplefilter("ignore", UserWarning)
        try:
            if single_process:
                dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
            else:  # DCP's protocol in fewer collective rounds (dcp_save.py)
                collective_save(planner, writer, process_group or dist.group.WORLD)
        except CheckpointException as e:
            raise _unwrap(e, f"{directory}: saving failed", (where, planner.needed)) from None
        except OSError as e:  # a single-process save raises the OS error itself
            if storage.is_no_space(e):
                raise storage.OutOfSpaceError(storage.no_space_message(
                    where, planner.needed or 0, storage.free_bytes(where))) from None
            raise
    return writer.all_sums if writer.all_sums is not None else writer.sums


def _unwrap(e: CheckpointException, what: str, space: tuple | None = None) -> CheckpointError:
    """DCP wraps every rank's exception; surface the first one (ours as is; a full disk as
    :class:`storage.OutOfSpaceError` when ``space = (directory, bytes needed)``)."""
    for rank, (exc, _) in sorted(e.failures.items()):
        if isinstance(exc, CheckpointError):
            return exc
        if space is not None and storage.is_no_space(exc):
            directory, needed = space
            return storage.OutOfSpaceError(storage.no_space_message(directory, needed or 0,
                                                                    storage.free_bytes(directory))
                                           + f" (rank {rank}: {exc})")
        return CheckpointError(f"{what} on rank {rank}: {type(exc).__name__}: {exc}")
    return CheckpointError(f"{what}: {e}")


def read_items(directory: str | os.PathLike, items: StateItems, manifest: dict | None = None) -> None:
    """Fill every chunk of ``items`` in place from ``directory`` (any saving layout).

    Reads only the saved chunks that overlap this rank's, verifying each block it reads; needs no
    collective, so ranks may call it independently.

    Args:
        manifest: the directory's manifest when the caller just verified it
            (:func:`verify_directory`); verified here otherwise.

    Raises:
        CheckpointError: unsafe or malformed files, a missing key, a shape mismatch.
    """
    directory = Path(directory)
    if manifest is None:
        manifest = verify_directory(directory)
    md = read_metadata_safely(directory / METADATA_FILE)  # read once: for the keys, and by DCP
    items = adapt_items(items, set(tensor_entries(md)))
    reader_rank = integrity.reading_rank()
    reader = SafeFileSystemReader(str(directory), checksums=manifest.get(integrity.CHECKSUMS), rank=reader_rank,
                                  algorithm=integrity.manifest_algorithm(manifest, directory / MANIFEST), metadata=md)
    try:
        local_load(reader, ChunkLoadPlanner(items))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - named with the rank, as dcp.load's wrapped failures are
        raise CheckpointError(f"{directory}: reading the tensors failed on rank {reader_rank}: "
                              f"{type(e).__name__}: {e}") from None


def saved_tensors(directory: str | os.PathLike, *, verified: bool = False) -> dict[str, TensorStorageMetadata]:
    """Key -> DCP tensor metadata (full shape, dtype, saved chunks) of a checkpoint, verified
    first unless the caller just did (``verified``)."""
    if not verified:
        verify_directory(directory)
    return tensor_entries(read_metadata_safely(Path(directory) / METADATA_FILE))


def tensor_entries(md) -> dict[str, TensorStorageMetadata]:
    """The tensor entries of DCP metadata ``md``, by key."""
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# ---- the manifest --------------------------------------------------------------------------
def write_manifest(directory: str | os.PathLike, cfg, checksums: dict | None = None, **fields: Any) -> dict:
    """Write ``config.toml``, then ``paratron.json`` last: it records the sha256 of ``.metadata``
    (a directory whose metadata was swapped afterwards is refused), the checksum algorithm and
    the CRC and size of every file (:mod:`paratron.checkpoint.integrity`).

    Args:
        cfg: the run's :class:`paratron.config.Config`.
        checksums: ``{name: entry}`` (:func:`integrity.block_entry`) computed while the files were
            written, by the ranks that wrote them; every other file of the directory is checksummed
            here.
        fields: more plain-JSON entries (step, extra, ...).
    """
    directory = Path(directory)
    write_text_atomic(directory / "config.toml", to_toml(cfg))
    known = dict(checksums or {})
    rest = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST and p.name not in known)
    known.update(integrity.checksum_files(directory, rest))
    manifest = {"format": FORMAT, "version": VERSION, "config": cfg.to_dict(),
                "metadata_sha256": file_sha256(directory / METADATA_FILE), **fields,
                integrity.ALGORITHM_FIELD: integrity.CURRENT.name, integrity.CHECKSUMS: known}
    try:
        raw = integrity.seal_manifest(manifest)
    except TypeError as e:
        raise CheckpointError(f"{directory / MANIFEST}: checkpoint metadata must be plain JSON values: {e}") from None
    write_text_atomic(directory / MANIFEST, raw)
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a checkpoint directory, checked as plain JSON (no tensor file is read):
    its own checksum, format, version and model config. What the check before launch verifies
    (:func:`paratron.training.preflight.check_checkpoint_load`).

    Raises:
        CheckpointError: the directory missing, a pickle file inside, no manifest (not written by
            paratron, or a save that never finished), a corrupt manifest, another format or version,
            or no ``.metadata`` where the manifest names one.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    refuse_pickle_files(directory)
    if not (directory / MANIFEST).is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST}: not a paratron checkpoint, or a save that "
                              "never finished")
    rank = integrity.reading_rank()
    manifest, raw = _read_manifest(directory / MANIFEST, rank)
    integrity.check_manifest(directory / MANIFEST, raw, manifest, rank)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{directory / MANIFEST}: format is not {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{directory / MANIFEST}: version {manifest.get('version')!r}; this paratron "
                              f"reads version {VERSION}")
    if not isinstance(manifest.get("config"), dict) or not isinstance(manifest["config"].get("model"), dict):
        raise CheckpointError(f"{directory / MANIFEST}: holds no model config")
    if manifest.get("metadata_sha256") and not (directory / METADATA_FILE).is_file():
        raise CheckpointError(f"{directory} has no {METADATA_FILE} (the tensor index its {MANIFEST} names): "
                              "the checkpoint is incomplete")
    return manifest


def verify_directory(directory: str | os.PathLike) -> dict:
    """Check a checkpoint directory before DCP touches it; return its manifest.

    Raises:
        CheckpointError: as :func:`read_manifest`; or a small shared file (``.metadata``,
            ``config.toml``, this rank's ``rank_<r>.json``) changed since the save, or ``.metadata``
            not the one the manifest names.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    rank = integrity.reading_rank()
    sums = manifest.get(integrity.CHECKSUMS)
    if sums is not None:  # the small files every load reads; payloads are checked as they are read
        mine = f"rank_{rank:05d}.json"
        small = [n for n in (METADATA_FILE, "config.toml", mine) if n in sums or (directory / n).is_file()]
        algorithm = integrity.manifest_algorithm(manifest, directory / MANIFEST)
        integrity.verify_files(directory, sums, small, rank, algorithm)
    md_path = directory / METADATA_FILE
    if not md_path.is_file():
        raise CheckpointError(f"{directory} has no {METADATA_FILE}")
    if file_sha256(md_path) != manifest.get("metadata_sha256"):
        raise CheckpointError(f"{md_path} is not the metadata this checkpoint was written with "
                              f"(sha256 differs from {MANIFEST}); refusing to read it")
    return manifest


def _read_manifest(path: Path, rank: int) -> tuple[Any, bytes]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    try:
        return json.loads(raw), raw
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}; read by rank {rank}); the checkpoint's "
                              "manifest is corrupt") from None


def checkpoint_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the ``step_<N>`` directories of ``root`` that hold a manifest, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (STEP_DIR.match(p.name) for p in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m and (root / m.group(0) / MANIFEST).is_file())


def steps_note(root: str | os.PathLike, but: str | os.PathLike | None = None) -> str:
    """``checkpoints in ROOT: step_4, step_8`` (leaving out the directory ``but``), for messages."""
    steps = [f"step_{n}" for n in checkpoint_steps(root) if but is None or Path(root) / f"step_{n}" != Path(but)]
    if not steps:
        return f"no {'other ' if but is not None else ''}checkpoint in {root}"
    return f"checkpoints in {root}: {', '.join(steps)} (checkpoint.load_step=N loads one)"


def holds_no_checkpoint(root: str | os.PathLike) -> bool:
    """Nothing to resume from in ``root``: it is missing, or holds no manifest, ``latest`` or
    ``step_<N>`` directory (a resume from it is a fresh start)."""
    root = Path(root)
    if not root.is_dir():
        return not root.exists()  # a file is no fresh start: resolve() refuses it
    return not ((root / MANIFEST).exists() or (root / LATEST).exists()
                or any(STEP_DIR.match(p.name) for p in root.iterdir()))


def resolve(path: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint directory meant by ``path``: itself if it holds a manifest, else its
    ``step_<step>`` (when ``step`` is given) or the one its ``latest`` file names.

    Raises:
        CheckpointError: nothing loadable there; a missing step names the steps there are.
    """
    path = Path(path)
    if step is not None:
        d = path / f"step_{step}"
        if not d.is_dir():
            raise CheckpointError(f"no checkpoint for step {step} in {path}; {steps_note(path)}")
        return d
    if (path / MANIFEST).is_file():
        return path
    if (path / LATEST).is_file():
        name = (path / LATEST).read_text().strip()
        if not name or "/" in name or name.startswith("."):
            raise CheckpointError(f"{path / LATEST} names {name!r}, which is not a checkpoint directory name; "
                                  f"{steps_note(path)}")
        if not (path / name).is_dir():
            raise CheckpointError(f"{path / LATEST} names {name}, which does not exist; {steps_note(path)}")
        return path / name
    raise CheckpointError(f"{path} holds no checkpoint (no {MANIFEST} and no {LATEST} file)")


def resume_manifest(root: str | os.PathLike, step: int | None, model: dict, want_optimizer: bool,
                    verify=read_manifest) -> tuple[Path, dict] | None:
    """The directory and manifest that a resume from ``root`` loads, checked against this run:
    the rules of :meth:`paratron.checkpoint.manager.CheckpointManager.load` that plain files
    answer, so the check before launch and the load agree.

    Args:
        root, step: ``checkpoint.load`` and ``checkpoint.load_step``.
        model: this run's ``model`` config section as a dict.
        want_optimizer: the optimizer state will be loaded (``checkpoint.load_optimizer``).
        verify: reads the manifest: :func:`read_manifest` (plain JSON) or :func:`verify_directory`.

    Returns:
        None for a fresh start (``root`` holds no checkpoint and no step is asked for).

    Raises:
        CheckpointError: nothing to load where ``latest`` or ``step`` point, a missing or corrupt
            manifest (the steps there are named), a checkpoint of another model (the fields named),
            or no optimizer state when it is wanted.
    """
    if step is None and holds_no_checkpoint(root):
        return None
    directory = resolve(root, step)
    try:
        manifest = verify(directory)
        if int(model.get("lora_rank") or 0) > 0 and not manifest.get("adapter_only"):
            check_same_base(manifest["config"]["model"], model, str(directory))
            return directory, manifest  # a LoRA run's base: its weights only (checkpoint.adapters)
        check_same_model(manifest["config"]["model"], model, str(directory))
        if want_optimizer and not manifest.get("has_optimizer"):
            raise CheckpointError(
                f"{directory} holds no optimizer state (it was saved without one), but "
                "checkpoint.load_optimizer=true; set checkpoint.load_optimizer=false to start a fresh "
                "optimizer from these weights")
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {steps_note(root, but=directory)}") from None
    return directory, manifest


# ---- one process, full tensors -------------------------------------------------------------
def save_model_full(directory: str | os.PathLike, cfg, tensors: dict[str, torch.Tensor]) -> None:
    """Save full (unsharded, unpadded) model tensors from one process, no ``torch.distributed``.

    The result is a checkpoint like any other: any layout can load it (:func:`load_model_into`,
    or ``CheckpointManager.load`` with ``checkpoint.load_optimizer=false``).

    Args:
        directory: created if missing; must not already hold a checkpoint.
        cfg: the run's :class:`paratron.config.Config`.
        tensors: logical name (``layers.0.mlp.fc1.weight``) -> the full logical tensor.

    Raises:
        CheckpointError: ``directory`` already holds a checkpoint, or a value is not a tensor.
    """
    directory = Path(directory)
    if (directory / MANIFEST).exists() or (directory / METADATA_FILE).exists():
        raise CheckpointError(f"{directory} already holds a checkpoint; save into a new directory")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"tensors[{name!r}] is a {type(t).__name__}, not a tensor")
    directory.mkdir(parents=True, exist_ok=True)
    items = full_items({k: v.detach().cpu() for k, v in tensors.items()})
    sums = write_items(directory, items, single_process=True)
    write_manifest(directory, cfg, checksums=sums, kind="model", step=None, has_optimizer=False,
                   layout=None, extra={})


def load_tensors_full(directory: str | os.PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every saved tensor whose key starts with ``prefix``, as a full CPU tensor in its saved
    dtype, keyed without the prefix (e.g. ``prefix="optimizer/exp_avg/"`` gives the full Adam
    first moments in the 2-D view). One process; no ``torch.distributed`` needed.

    Raises:
        CheckpointError: unsafe or malformed checkpoint.
    """
    directory = resolve(directory)
    out = {key[len(prefix):]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
           for key, md in saved_tensors(directory).items() if key.startswith(prefix)}
    read_items(directory, full_items(out, prefix=prefix))
    return fuse_full(out)


def load_model_full(directory: str | os.PathLike) -> tuple[Any, dict[str, torch.Tensor]]:
    """Read every model tensor of a checkpoint as a full tensor, in one process.

    Args:
        directory: a checkpoint directory, or a checkpoint root (its ``latest`` is used).

    Returns:
        ``(Config, {logical_name: full tensor on the CPU, in the saved dtype})``.

    Raises:
        CheckpointError: unsafe or malformed checkpoint.
    """
    directory = resolve(directory)
    manifest = verify_directory(directory)
    tensors = load_tensors_full(directory, MODEL_PREFIX)
    return from_dict(manifest["config"], str(directory / MANIFEST)), tensors


def load_model_into(directory: str | os.PathLike, chunks, *, config=None, step: int | None = None) -> dict:
    """Fill the parameters of model chunks of any layout from a checkpoint of any layout.

    Args:
        directory: a checkpoint directory or root (``latest``, or ``step``).
        chunks: the model chunks of this rank (``nn.Module`` or a list of them), params marked.
        config: when given, the checkpoint's model config must match it (weight-relevant fields).

    Returns:
        The checkpoint's manifest (plain JSON dict).

    Raises:
        CheckpointError: unsafe files, another model, a missing tensor, a shape mismatch.
    """
    directory = resolve(directory, step)
    manifest = verify_directory(directory)
    if config is not None:
        check_same_model(manifest["config"]["model"], config.to_dict()["model"], str(directory))
    with torch.no_grad():
        read_items(directory, model_items(chunks, for_save=False), manifest)
    return manifest
