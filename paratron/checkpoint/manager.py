"""``CheckpointManager``: atomic, rotating, optionally asynchronous checkpoints of a training run.

A save of step N (on every rank):

1. capture everything that is not a big tensor, synchronously: per-rank RNG states, the
   optimizer's scalar state (step count, loss scaler), the LR scheduler's state, ``extra``
   (consumed train/valid samples, ...); with an async save also copy the tensors to CPU buffers;
2. write the tensors with DCP into ``ROOT/tmp.step_N.<pid of rank 0>/`` (replicated chunks once,
   spread over the ranks that hold them), and each rank's ``rank_<r>.json``; each rank checksums
   its payload as it writes it, and its ``rank_<r>.json`` (:mod:`~paratron.checkpoint.checksummed`);
3. rank 0 writes ``paratron.json`` (the manifest, holding the sha256 of ``.metadata`` and every
   file's checksum), renames the
   directory to ``ROOT/step_N/``, then rewrites ``ROOT/latest`` (temp file + ``os.replace``), and
   deletes all but the last ``checkpoint.keep_last`` checkpoints (in a thread of its own, joined
   by the next save, load or :meth:`CheckpointManager.wait`).

A crash at any point before the rename leaves a ``tmp.*`` directory that nothing loads (it has no
manifest) and ``latest`` naming the previous, complete checkpoint; the next manager removes it
(:func:`~paratron.checkpoint.storage.remove_stale_temporaries`). A save first checks that the disk
has room for the whole checkpoint, and a failed save removes its temporary directory, so a full
disk costs the save, never the previous checkpoint or a manual clean-up. Steps 2-3 run in a background
thread with ``async_`` (``checkpoint.async_save``); :meth:`CheckpointManager.wait` joins it.

Loading reshards every tensor to this rank's layout (see :mod:`paratron.checkpoint.dcp_planners`), then
restores the scalars, and the RNG per rank (see :mod:`paratron.checkpoint.rng`). The data position
(consumed samples) is global, so it carries over to any layout unchanged.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from paratron.parallel.comm import Group

from paratron.parallel.context import ParallelContext
from . import integrity, rng, storage
from .adapters import base_weights, lora_on, only_adapters
from .async_save import BackgroundWriter, Staging
from .io import (LATEST, STEP_DIR, holds_no_checkpoint, read_items, read_json, resolve, resume_manifest,
                 saved_tensors, verify_directory, write_items, write_json_atomic, write_manifest, write_text_atomic)
from .items import (MODEL_PREFIX, CheckpointError, PeerCheckpointError, StateItems, iter_params, merge, model_items,
                    naming_the_save, optimizer_items, shared_embedding_names)
from .payload import ZipTemplates
from .plainjson import decode, encode
from .safety import check_same_base

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_checkpoint_config(ckpt_cfg) -> None:
    """The rules of :class:`paratron.config.CheckpointConfig` the manager relies on; pure, so the
    config validator runs it before any process group exists and the constructor runs it again.

    Raises:
        CheckpointError: ``checkpoint.keep_last`` < 0; ``checkpoint.load_step`` without
            ``checkpoint.load``.
    """
    if int(ckpt_cfg.keep_last) < 0:
        raise CheckpointError(f"checkpoint.keep_last={ckpt_cfg.keep_last} must be >= 0 "
                              "(0 keeps every checkpoint)")
    if ckpt_cfg.load_step is not None and not ckpt_cfg.load:
        raise CheckpointError(f"checkpoint.load_step={ckpt_cfg.load_step} needs checkpoint.load (the directory "
                              "holding step_<N>/)")


class CheckpointManager:
    """Saves and loads the whole training state of every rank, in any layout.

    Build it on every rank (with more than one rank it creates a gloo process group over all
    ranks, collectively, for the checkpoint's own collectives).

    Args:
        ckpt_cfg: :class:`paratron.config.CheckpointConfig` (``save``, ``load``, ``load_step``,
            ``keep_last``, ``async_save``, ``load_optimizer``).
        ctx: the :class:`~paratron.parallel.context.ParallelContext`.
        config: the run's :class:`paratron.config.Config`; stored in every checkpoint, and compared
            with a loaded checkpoint's model config.

    Attributes:
        on_phase: optional ``fn(phase, directory)`` called on rank 0 once every rank's tensors
            are written, before the commit (``"tensors_written"``), and on every rank after the
            commit (``"committed"``); a test hook.
        last_stall_s: seconds the last :meth:`save` call blocked the caller.
        last_write_s: seconds the last save took from start to commit (async included).

    Raises:
        CheckpointError: a rule of :func:`check_checkpoint_config`.
    """

    def __init__(self, ckpt_cfg, ctx: ParallelContext, config) -> None:
        check_checkpoint_config(ckpt_cfg)
        self.cfg, self.ctx, self.config = ckpt_cfg, ctx, config
        self.on_phase: Callable[[str, Path], None] | None = None
        self.last_stall_s = 0.0
        self.last_write_s = 0.0
        self._staging = Staging()
        self._writer = BackgroundWriter()
        self._pruner = BackgroundWriter()  # deletes old checkpoints off the training path
        self._templates = ZipTemplates()  # torch.save's bytes around a storage, per tensor layout
        self._group = self._checkpoint_group(ctx)
        # Rank 0's pid names the temporary directory of every save (and lets a later manager
        # tell a crashed save's leftovers from a live one's); it is learnt once, here.
        self._pid0 = self._group.all_gather_object(os.getpid())[0] if self.saving else None
        if self.saving and ctx.rank == 0:
            storage.remove_stale_temporaries(ckpt_cfg.save)

    @staticmethod
    def _checkpoint_group(ctx: ParallelContext):
        world = ctx.world_size
        if world == 1:
            return Group("checkpoint", [0], 0, None, ctx.ledger)
        # A group of its own: an async save's collectives run in a background thread and must not
        # interleave with the training step's collectives on the training groups.
        pg = dist.new_group(ranks=list(range(world)), backend="gloo")
        return Group("checkpoint", list(range(world)), ctx.rank, pg, ctx.ledger)

    # ---- paths -----------------------------------------------------------------------------
    @property
    def saving(self) -> bool:
        """Whether ``checkpoint.save`` names a directory (else :meth:`save` does nothing)."""
        return bool(self.cfg.save)

    def should_save(self, step: int, *, final: bool) -> bool:
        """The save rule of the training loop: after every ``checkpoint.interval``-th step, and
        after the ``final`` one (the last step, or a stop request); never without
        ``checkpoint.save``."""
        interval = int(self.cfg.interval or 0)
        return self.saving and (final or bool(interval and step % interval == 0))

    def directory_for(self, step: int) -> Path | None:
        """Where the checkpoint of ``step`` ends up (``ROOT/step_<step>``); None when not saving."""
        return Path(self.cfg.save) / f"step_{int(step)}" if self.saving else None

    # ---- save ------------------------------------------------------------------------------
    def save(self, step: int, chunks, optimizer, scheduler, extra: dict | None = None, *,
             async_: bool | None = None) -> None:
        """Save the model chunks, optimizer state, scheduler, RNG and ``extra`` as step ``step``.

        Call on every rank. With ``async_`` (default ``checkpoint.async_save``) it returns once the
        tensors are copied to CPU memory; the write continues in the background. Without
        ``checkpoint.save`` (a run that only loads) it does nothing.

        Args:
            step: the iteration count (names the directory).
            chunks: this rank's model chunks (``nn.Module`` or list), params marked.
            optimizer: the :class:`paratron.optim.optimizer.Optimizer`, or None (weights only).
            scheduler: an LR scheduler with ``state_dict()``, or None.
            extra: plain values (ints, floats, strings, lists, dicts; tensors allowed), e.g.
                ``{"iteration": ..., "consumed_train_samples": ..., "consumed_valid_samples": ...}``.

        Raises:
            CheckpointError: ``extra`` not plain; a previous async save failed (raised here, before
                the new save starts); a sharding inconsistency; an inf or NaN in the model or
                optimizer state of any rank (the partial directory is removed before anything
                is committed: a poisoned state never becomes ``latest``; with ``async_`` raised
                by :meth:`wait` or the next save).
        """
        t0 = time.perf_counter()
        self.wait()
        if not self.saving:
            return
        root = Path(self.cfg.save)
        asynchronous = self.cfg.async_save if async_ is None else bool(async_)
        with naming_the_save(step), full_params(optimizer):
            self._save_items(root, int(step), chunks, optimizer, scheduler, extra, asynchronous, t0)

    def _save_items(self, root: Path, step: int, chunks, optimizer, scheduler, extra, asynchronous: bool,
                    t0: float) -> None:
        first = self.ctx.is_first_stage
        items = model_items(chunks, is_first_stage=first, for_save=True)
        if lora_on(self.config):  # adapter-only: the frozen base is loaded from elsewhere
            items = only_adapters(items)
        if optimizer is not None:
            # The last stage's tied-embedding copy is saved by the first stage (same values).
            skip = set() if first else shared_embedding_names(chunks)
            items = merge(items, optimizer_items(optimizer, skip_names=skip))
        tmp = root / f"tmp.step_{step}.{self._pid0}"
        rank_state = {"rank": self.ctx.rank, "layout": rng.layout_signature(self.ctx, self.config),
                      "coordinates": rng.rank_coordinates(self.ctx), "rng": encode(rng.capture(chunks))}
        fields = {
            "kind": "training", "step": int(step), "has_optimizer": optimizer is not None,
            "adapter_only": lora_on(self.config),
            "layout": rng.layout_signature(self.ctx, self.config),
            "zero": int(self.config.parallel.zero),
            "optimizer": encode(optimizer.scalar_state()) if optimizer is not None else None,
            "scheduler": encode(scheduler.state_dict()) if scheduler is not None else None,
            "extra": encode(dict(extra or {}), "extra"),
        }
        if asynchronous:
            items = self._staging.stage(items)

        def job() -> None:
            with naming_the_save(step):  # an async save's error surfaces later, in wait()
                self._write_and_commit(root, tmp, int(step), items, rank_state, fields)
            self.last_write_s = time.perf_counter() - t0

        if asynchronous:
            self._writer.start(job, name=f"paratron-checkpoint-step-{step}")
            self.last_stall_s = time.perf_counter() - t0
        else:
            with torch.no_grad():
                job()
            self.last_stall_s = time.perf_counter() - t0

    @property
    def writing(self) -> bool:
        """An asynchronous save is still writing (training may go on)."""
        return self._writer.running

    def wait(self) -> None:
        """Finish the asynchronous save in flight, if any (call before exiting).

        Raises:
            CheckpointError: the background save failed.
        """
        self._writer.wait()
        self._pruner.wait()

    def _write_and_commit(self, root: Path, tmp: Path, step: int, items: StateItems, rank_state: dict,
                          fields: dict) -> None:
        try:
            self._write_files(root, tmp, step, items, rank_state, fields)
        except BaseException:
            if self.ctx.rank == 0:  # a failed save leaves nothing behind to clean up by hand
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._phase("committed", root / f"step_{step}")

    def _write_files(self, root: Path, tmp: Path, step: int, items: StateItems, rank_state: dict,
                     fields: dict) -> None:
        """Every rank writes its files into ``tmp``, checksummed; rank 0 then commits (manifest,
        rename, ``latest``) inside DCP's last collective (:meth:`_commit_on_rank0`), so when this
        returns on any rank the checkpoint is committed (or the save failed on every rank)."""
        g = self._group
        tmp.mkdir(parents=True, exist_ok=True)
        state = f"rank_{self.ctx.rank:05d}.json"
        write_json_atomic(tmp / state, rank_state)

        def commit(sums: dict, needed: int | None) -> None:
            self._commit_on_rank0(root, tmp, step, sums, fields, needed)

        # The sums of every rank's files (its rank_<r>.json included) reach rank 0 with DCP's
        # write results, after every rank's files are durable.
        write_items(tmp, items, process_group=g.pg, single_process=g.size == 1, space_root=root,
                    other_sums=integrity.checksum_files(tmp, [state]), refuse_nonfinite_at=step, on_commit=commit,
                    templates=self._templates)

    def _commit_on_rank0(self, root: Path, tmp: Path, step: int, sums: dict, fields: dict,
                         needed: int | None) -> None:
        """Rank 0, once every rank's files and ``.metadata`` are durable: the manifest, then the
        rename and ``latest`` (:meth:`_commit`); old checkpoints are then deleted in the background."""
        self._phase("tensors_written", tmp)
        try:
            write_manifest(tmp, self.config, checksums=sums, world_size=self.ctx.world_size,
                           saved_at=time.time(), **fields)
        except OSError as e:
            if storage.is_no_space(e):
                raise storage.OutOfSpaceError(storage.no_space_message(root, needed or 0,
                                                                       storage.free_bytes(root))) from None
            raise
        final = self._commit(root, tmp, step)
        # Deleting old checkpoints does not hold up the ranks; the next save or wait() joins it.
        self._pruner.start(lambda: self._prune(root, final), name="paratron-checkpoint-prune")

    def _phase(self, name: str, path: Path) -> None:
        if self.on_phase is not None:
            self.on_phase(name, path)

    @staticmethod
    def _commit(root: Path, tmp: Path, step: int) -> Path:
        """Rename ``tmp`` to ``step_<step>`` and point ``latest`` at it. ``latest`` names a complete
        directory at every instant, also while an existing ``step_<step>`` is replaced."""
        _fsync_dir(tmp)
        final = root / f"step_{step}"
        if final.exists():
            staged = root / f"{final.name}.{os.getpid()}"
            os.rename(tmp, staged)
            _fsync_dir(root)
            write_text_atomic(root / LATEST, staged.name + "\n")
            shutil.rmtree(final)
            tmp = staged
        os.rename(tmp, final)
        _fsync_dir(root)
        write_text_atomic(root / LATEST, final.name + "\n")
        _fsync_dir(root)
        return final

    def _prune(self, root: Path, keep: Path) -> None:
        """Delete all but the ``keep_last`` highest steps (never ``keep``), and leftovers of
        saves that crashed before their rename."""
        k = int(self.cfg.keep_last)
        steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
        if k > 0:
            for _, p in steps[:-k]:
                if p != keep:
                    shutil.rmtree(p, ignore_errors=True)
        # Only leftovers of dead writers: this job's next save may already be writing its tmp
        # dir (the other ranks leave the commit's collective before this runs).
        storage.remove_stale_temporaries(root)

    # ---- load ------------------------------------------------------------------------------
    def load(self, chunks, optimizer, scheduler) -> dict | None:
        """Resume from ``checkpoint.load`` (its ``latest``, or ``checkpoint.load_step``).

        Fills the params (any saved layout), and with ``checkpoint.load_optimizer`` the optimizer's
        fp32 main weights, moments and scalars and the scheduler; restores or re-derives the RNG.
        With ``checkpoint.finetune`` only the params are filled and None is returned (a new run
        from step 0). Call on every rank.

        Returns:
            The ``extra`` dict given to :meth:`save`, or None when ``checkpoint.load`` is unset or
            an empty directory (a fresh start).

        Raises:
            CheckpointError: unsafe or malformed files; a checkpoint of another model (the differing
                fields named); optimizer state requested but absent from the checkpoint.
        """
        self.wait()
        lora = lora_on(self.config)
        if lora and self.cfg.pretrained_checkpoint:
            self._load_base(resolve(self.cfg.pretrained_checkpoint), None, chunks)
        if not self.cfg.load:
            return None
        finetune = bool(self.cfg.finetune)
        want_optimizer = bool(self.cfg.load_optimizer) and optimizer is not None and not finetune
        found = resume_manifest(self.cfg.load, self.cfg.load_step, self.config.to_dict()["model"], want_optimizer,
                                verify=verify_directory)
        if found is None:
            return None
        directory, manifest = found
        if lora and not manifest.get("adapter_only"):
            self._load_base(directory, manifest, chunks)  # a base to fine-tune: fresh adapters, step 0
            return None
        if manifest.get("adapter_only") and not (self.cfg.pretrained_checkpoint or getattr(self.cfg, "load_hf", None)):
            raise CheckpointError(f"{directory} holds only LoRA adapters: set checkpoint.pretrained_checkpoint "
                                  "(or load the base from Hugging Face) for the frozen base weights")
        with torch.no_grad():
            with full_params(optimizer, writeback=True):
                items = model_items(chunks, for_save=False)
                if lora:
                    items = only_adapters(items)
                if want_optimizer:
                    items = merge(items, optimizer_items(optimizer))
                read_items(directory, items, manifest)
                if not want_optimizer and optimizer is not None:
                    optimizer.copy_params_into_main(iter_params(chunks))
            if want_optimizer:
                optimizer.load_scalar_state(decode(manifest["optimizer"]))
                optimizer.reload_model_params()
                if scheduler is not None and manifest.get("scheduler") is not None:
                    scheduler.load_state_dict(decode(manifest["scheduler"]))
        if finetune:  # weights only: the run starts at step 0 with its own seed's RNG
            return None
        self._restore_rng(chunks, directory, manifest)
        return decode(manifest.get("extra") or {})

    def _load_base(self, directory: Path, manifest: dict | None, chunks) -> None:
        """Fill the frozen base params of a LoRA run from a checkpoint's model weights (frozen
        params are never sharded by ZeRO-3, so no gather is needed)."""
        manifest = manifest or verify_directory(directory)
        if manifest.get("adapter_only"):
            raise CheckpointError(f"{directory} holds only LoRA adapters; the base weights come from "
                                  "checkpoint.pretrained_checkpoint (a full checkpoint of the base model)")
        check_same_base(manifest["config"]["model"], self.config.to_dict()["model"], str(directory))
        with torch.no_grad():
            read_items(directory, base_weights(model_items(chunks, for_save=False)), manifest)

    def load_everywhere(self, chunks, optimizer, scheduler) -> dict | None:
        """:meth:`load` on every rank, then one collective over the ranks' outcomes: it returns
        only once every rank has loaded and verified its part, so no rank reports a resume that
        another refused. Call on every rank.

        Raises:
            CheckpointError: this rank's own error; on the others :class:`PeerCheckpointError`
                naming the lowest failing rank and its error.
        """
        try:
            extra, error = self.load(chunks, optimizer, scheduler), None
        except Exception as e:  # noqa: BLE001 - re-raised below, after every rank has told the others
            extra, error = None, e
        outcomes = self._group.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        for rank, failed in enumerate(outcomes):
            if failed is not None:
                raise PeerCheckpointError(f"rank {rank} could not load the checkpoint: {failed}")
        return extra

    def _restore_rng(self, chunks, directory: Path, manifest: dict) -> None:
        same = manifest.get("layout") == rng.layout_signature(self.ctx, self.config)
        path = directory / f"rank_{self.ctx.rank:05d}.json"
        if same and path.is_file():
            rng.restore(chunks, decode(read_json(path)["rng"]))
        else:
            rng.rederive(chunks, self.ctx, self.config.train.seed, int(manifest.get("step") or 0))


def params_to_load(cfg) -> frozenset[str]:
    """The logical names of the params that :meth:`CheckpointManager.load` will fill under the
    checkpoint config ``cfg`` (``checkpoint.load``/``load_step``, and a LoRA run's
    ``pretrained_checkpoint``), read from the DCP metadata alone
    (the load verifies the directory); empty when there is nothing to load, or when the metadata
    cannot be read: the params are then drawn as usual and the load itself reports the problem
    with its own checks and message. The model is built without drawing these
    (:func:`paratron.layers.init.skip_draws`)."""
    names = frozenset()
    for root, step in ((cfg.load, cfg.load_step), (getattr(cfg, "pretrained_checkpoint", None), None)):
        if not root:
            continue
        try:
            if step is None and holds_no_checkpoint(root):
                continue
            keys = saved_tensors(resolve(root, step), verified=True)
        except Exception:  # noqa: BLE001 - any fault here is the load's to report, after its checks
            continue
        names |= frozenset(k[len(MODEL_PREFIX):] for k in keys if k.startswith(MODEL_PREFIX))
    return names


def full_params(optimizer, writeback: bool = False):
    """The optimizer's DDP :meth:`~paratron.optim.ddp.DistributedDataParallel.full_params`
    context (ZeRO-3 gathers every param for the block; otherwise nothing happens)."""
    ddp = getattr(optimizer, "ddp", None)
    return ddp.full_params(writeback) if ddp is not None else nullcontext()
