"""Loading a checkpoint never runs code from it, and never loads one made for another model.

``torch.distributed.checkpoint`` stores its ``.metadata`` with ``pickle`` and reads it back with
``pickle.load`` (``FileSystemReader.read_metadata``), which would run any callable a crafted file
names. :class:`SafeFileSystemReader` replaces that read with :class:`MetadataUnpickler`, which
resolves only the few DCP metadata classes, ``torch.Size``, dtypes and layouts, and refuses any
other global before anything is called (the same idea as ``torch.load(weights_only=True)``, which
DCP already uses for the tensor payloads). Files that paratron never writes (``.pt``, ``.pkl``, ...)
make the directory refused outright.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan
from torch.futures import Future

from paratron.config import ModelConfig

from .checksummed import BlockReader, ChunkLayouts, StreamedFile, VerifiedRange, direct_destination, read_streamed
from .integrity import Algorithm, entry_blocks, listed, verify_files
from .items import CheckpointError

METADATA_FILE = ".metadata"
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".tar")
"""Suffixes of files that carry pickles; paratron writes none, so a checkpoint holding one is refused."""

@functools.cache
def _allowlist() -> dict[tuple[str, str], Any]:
    """``(module, name)`` -> object, for every global DCP metadata may name."""
    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout

    out: dict[tuple[str, str], Any] = {}
    for cls in (metadata.Metadata, metadata.TensorStorageMetadata, metadata.ChunkStorageMetadata,
                metadata.TensorProperties, metadata.BytesStorageMetadata, metadata.MetadataIndex,
                metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo):
        out[(cls.__module__, cls.__name__)] = cls
    out[("torch", "Size")] = torch.Size
    out[("torch.serialization", "_get_layout")] = _get_layout  # looks a layout up by name
    # DCP records the checkpoint path it was written to; building a path object runs nothing.
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        out[("pathlib", name)] = pathlib.PurePosixPath
    for k, v in vars(torch).items():
        if isinstance(v, torch.dtype):
            out[("torch", k)] = v
    return out


def _allowed(module: str, name: str) -> Any:
    """The object an allowed ``(module, name)`` global resolves to, else None."""
    return _allowlist().get((module, name))


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, resolving only DCP metadata classes, ``torch.Size`` and dtypes.

    Raises:
        CheckpointError: the pickle names any other global (the payload is refused before anything
            it names is called).
    """

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise CheckpointError(f"{self.source} refers to {module}.{name}, which a checkpoint's metadata never "
                                  "holds; refusing to load it (a pickle payload that could run code)")
        return obj

    def persistent_load(self, pid) -> Any:
        raise CheckpointError(f"{self.source} holds a persistent reference, which DCP metadata never has; refused")


def read_metadata_safely(path: str | os.PathLike) -> Metadata:
    """Read a DCP ``.metadata`` file without running anything it names.

    Raises:
        CheckpointError: the file is missing, is not a pickle of a DCP ``Metadata``, or names a
            global outside the allowlist.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint metadata {path}: {e}") from None
    try:
        md = MetadataUnpickler(io.BytesIO(raw), str(path)).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle is a refused file
        raise CheckpointError(f"{path} is not valid checkpoint metadata: {type(e).__name__}: {e}") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path} holds a {type(md).__name__}, not checkpoint metadata")
    return md


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def refuse_pickle_files(directory: str | os.PathLike) -> None:
    """Refuse a checkpoint directory that holds files paratron never writes and that carry pickles.

    Raises:
        CheckpointError: naming the first such file.
    """
    for entry in sorted(os.listdir(directory)):
        if entry.lower().endswith(PICKLE_SUFFIXES):
            raise CheckpointError(f"{os.path.join(directory, entry)}: checkpoint directories hold no pickle files "
                                  f"({', '.join(PICKLE_SUFFIXES)}); paratron refuses to load it")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read replaced by :func:`read_metadata_safely`, and
    every payload byte it reads verified against its save-time checksums.

    Payloads with block checksums are read straight into the destination tensors where the
    wanted bytes are contiguous on both sides (:class:`~paratron.checkpoint.checksummed.StreamedFile`:
    one ``preadv`` per block, verified as read, on reader threads; each chunk's layout from a
    ``weights_only`` ``torch.load`` onto the meta device), otherwise by DCP's
    ``torch.load(weights_only=True)`` through a :class:`~paratron.checkpoint.checksummed.BlockReader`;
    either way each block is read once and verified, only for the saved chunks this rank's chunks
    overlap. Payloads of checkpoints written before block checksums are verified whole before
    DCP reads them.

    Args:
        path: the checkpoint directory.
        checksums: the manifest's ``{name: entry}`` (None: a checkpoint written before checksums
            existed; nothing verified).
        rank: the reading rank, named in errors.
        algorithm: the CRC of ``checksums`` (:func:`~paratron.checkpoint.integrity.manifest_algorithm`);
            required with them.
        metadata: the directory's ``.metadata`` when the caller just read it
            (:func:`read_metadata_safely`); read here otherwise.

    Raises:
        ValueError: ``checksums`` without ``algorithm``.
    """

    def __init__(self, path: str | os.PathLike, checksums: dict | None = None, rank: int = 0,
                 algorithm: Algorithm | None = None, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        if checksums is not None and algorithm is None:
            raise ValueError("SafeFileSystemReader: checksums need the algorithm they were computed with")
        self._checksums, self._algorithm = checksums, algorithm
        self._rank = rank
        self._verified: set[str] = set()
        self._readers: dict[str, BlockReader] = {}
        self._layouts = ChunkLayouts()

    def read_data(self, plan, planner):
        if self._checksums is None:
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        whole, rest, streamed = [], [], []
        try:
            for name, reqs in sorted(per_file.items()):
                entry = listed(self._checksums, Path(self.path) / name, self._rank)
                if entry_blocks(entry) is None:  # an old checkpoint: verified whole, read by DCP
                    whole.append(name)
                    rest += reqs
                    continue
                streamed.append(StreamedFile(Path(self.path) / name, entry, self._rank, self._algorithm))
                rest += self._plan_direct(streamed[-1], reqs, planner)
            read_streamed(streamed, self._threads(sum(len(f.runs(1)) for f in streamed)))
            for f in streamed:
                f.commit(planner)
            verify_files(self.path, self._checksums, [n for n in whole if n not in self._verified], self._rank,
                         self._algorithm)
            self._verified |= set(whole)
            if rest:  # reads DCP must reshape (resharding, strided views): through verified ranges
                self._readers = {f.path.name: BlockReader(f.path, self._checksums[f.path.name], self._rank,
                                                          self._algorithm) for f in streamed}
                return super().read_data(LoadPlan(rest), planner)
            done: Future = Future()
            done.set_result(None)
            return done
        except Exception:
            failed = next((r.failure for r in self._readers.values() if r.failure is not None), None)
            if failed is not None:
                raise failed from None
            raise
        finally:
            for f in streamed:
                f.close()
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()

    def _plan_direct(self, f: StreamedFile, reqs: list, planner) -> list:
        """Plan the reads of ``reqs`` from ``f`` whose bytes go straight into their destination
        (the saved chunk's sub-box is contiguous in the file, the destination a contiguous CPU
        tensor of the same dtype); return the others. Every byte of each saved chunk is verified."""
        rest = []
        for req in reqs:
            sinfo = self.storage_data[req.storage_index]
            dest = direct_destination(self._layouts, f.fd, sinfo, req, planner)
            if dest is None or not f.target(*dest):
                rest.append(req)
            else:
                f.want(sinfo.offset, sinfo.offset + sinfo.length)
        return rest

    @staticmethod
    def _threads(blocks: int) -> int:
        """Reader threads: the usable CPUs shared among this node's ranks (``LOCAL_WORLD_SIZE``,
        else ``WORLD_SIZE``), 1-4, and at most one per 4 blocks."""
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        return max(1, min(4, len(os.sched_getaffinity(0)) // max(1, ranks), blocks // 4))

    def _slice_file(self, file, sinfo):
        reader = self._readers.get(sinfo.relative_path)
        if reader is None:
            return super()._slice_file(file, sinfo)
        return VerifiedRange(reader, sinfo.offset, sinfo.length)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = self._metadata if self._metadata is not None and rank is None else \
            read_metadata_safely(self._get_metadata_path(rank))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


# Model fields that change how a run executes or trains, not what its weights mean.
EXECUTION_ONLY_MODEL_FIELDS = frozenset({
    "recompute", "hidden_dropout", "attention_dropout", "make_vocab_size_divisible_by",
    "moe_token_dispatcher", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor",
    "init_method_std", "seq_length", "moe_expert_gemm", "moe_router_bias_update_rate",
    "moe_token_drop_policy",
})


def _model_field_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(ModelConfig)
            if f.default is not dataclasses.MISSING}


def _effective(model: dict[str, Any]) -> dict[str, Any]:
    m = dict(model)
    if m.get("num_query_groups") is None:
        m["num_query_groups"] = m.get("num_attention_heads")
    if m.get("max_position_embeddings") is None:
        m["max_position_embeddings"] = m.get("seq_length")
    if m.get("position_embedding_type") == "rope":
        m.pop("max_position_embeddings", None)  # no table: the length limit is not in the weights
    return m


def model_config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``model.<field>: saved X, now Y`` for every weight-relevant model field that differs.

    Args:
        saved, current: the ``model`` sections of two configs, as dicts; a field missing from
            ``saved`` (a checkpoint older than the field) counts as its default.
    """
    # A field the checkpoint does not record was added to paratron after it was saved; its default
    # is what that run did (new fields default to the old behaviour).
    saved = {**{k: v for k, v in _model_field_defaults().items() if k not in saved}, **saved}
    a, b = _effective(saved), _effective(current)
    out = []
    for k in sorted(set(a) | set(b)):
        if k in EXECUTION_ONLY_MODEL_FIELDS:
            continue
        va, vb = a.get(k), b.get(k)
        if k == "vocab_size" and (va is None or vb is None):
            continue  # resolved from the tokenizer; tensor shapes are checked on load
        if va != vb:
            out.append(f"model.{k}: checkpoint {va!r}, this run {vb!r}")
    return out


def check_same_model(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint whose model config differs in a weight-relevant field.

    Raises:
        CheckpointError: listing every differing field.
    """
    diff = model_config_differences(saved, current)
    if diff:
        raise CheckpointError(f"{where} was saved for another model; differing fields: " + "; ".join(diff))


LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")


def check_same_base(saved: dict, current: dict, where: str) -> None:
    """:func:`check_same_model` on everything but the LoRA fields (a
    base checkpoint was saved without adapters, or with others).

    Raises:
        CheckpointError: a weight-relevant base field differs.
    """
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(ModelConfig) if f.name in LORA_FIELDS}
    check_same_model({**saved, **defaults}, {**current, **defaults}, where)
