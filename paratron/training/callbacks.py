"""Training-loop callbacks: the extension point for research systems (docs/DESIGN.md principle 7).

A plugin subclasses :class:`Callback` and overrides any hook. The config lists plugins in
``train.callbacks`` as ``"package.module:ClassName"`` or ``"path/to/file.py:ClassName"``; each is
built with ``ClassName(state)`` (or ``ClassName()`` when it takes no argument) on every rank.

Hooks run on every rank, in the listed order. ``state`` is the :class:`TrainState` of the run:
the config, the parallel context, the model chunks, the optimizer, the current iteration and the
run directory. A hook may issue collectives, as long as every rank calls the same ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainState:
    """What callbacks can see and use. ``iteration`` counts completed optimizer steps."""

    config: Any
    ctx: Any
    chunks: list = field(default_factory=list)
    optimizer: Any = None
    scheduler: Any = None
    run_dir: Path | None = None
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    consumed_train_tokens: int = 0
    """Valid (labelled) tokens trained on so far; the ``consumed_tokens`` of token-balanced runs
    (``data.microbatch_tokens``), whose samples are documents of varying length."""
    metrics: list[dict] = field(default_factory=list)
    should_stop: bool = False
    """A callback may set this to end training after the current step (a save follows)."""
    exit_code: int = 0
    """The exit code of the rank processes once training ends (0: a normal end). A callback that
    sets ``should_stop`` may set it, the same on every rank, to tell a launcher why (e.g. the
    fail-slow plugin's restart request, :mod:`paratron.plugins.failslow_escalate`)."""
    dp_microbatches: list[int] | None = None
    """Microbatches per DP rank for the next steps (None: the even split). A callback may set it,
    the same on every rank, summing to ``global_batch_size / micro_batch_size``: the data loader
    then hands each DP replica that many microbatches of the same global batch, and the loss stays
    the global token mean (e.g. fail-slow mitigation, :mod:`paratron.plugins.failslow`)."""
    relayout_request: list[int] | None = None
    """A layout (layers per pipeline stage) to switch to at the next step boundary, in memory
    (:meth:`request_relayout`, :mod:`paratron.elastic.relayout`)."""

    def request_relayout(self, layout) -> None:
        """Ask for ``parallel.pipeline_layout = layout`` after the current step, without a
        checkpoint on disk (:mod:`paratron.elastic.relayout`). One rank asking is enough; a layout
        that does not fit is refused with a warning and the run goes on unchanged."""
        self.relayout_request = [int(x) for x in layout]


class Callback:
    """Base class: every hook is a no-op."""

    def on_train_start(self, state: TrainState) -> None: ...

    def on_step_start(self, state: TrainState) -> None: ...

    def on_step_end(self, state: TrainState, metrics: dict, timings: dict[str, float]) -> None:
        """After each optimizer step. ``metrics`` is the step's record (loss, lr, grad_norm, ...,
        the same on every rank); ``timings`` are this rank's seconds: ``step``, ``forward_backward``,
        ``optimizer``, ``data``."""

    def on_evaluate(self, state: TrainState, metrics: dict) -> None: ...

    def on_save_start(self, state: TrainState, path: str) -> None: ...

    def on_save_end(self, state: TrainState, path: str) -> None: ...

    def on_exception(self, state: TrainState, exc: BaseException) -> None: ...

    def on_train_end(self, state: TrainState) -> None: ...


class CallbackList(Callback):
    """Calls each callback's hook in order."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            cbs = object.__getattribute__(self, "callbacks")

            def fan_out(*args, **kwargs):
                for cb in cbs:
                    getattr(cb, name)(*args, **kwargs)

            return fan_out
        return object.__getattribute__(self, name)


def load_callback(spec: str, state: TrainState) -> Callback:
    """Import ``"module:Class"`` or ``"file.py:Class"`` and instantiate it.

    Raises:
        ValueError: the spec is malformed, the module/file or class is missing, or the class is not
            a :class:`Callback`.
    """
    module = import_callback_module(spec)
    where, _, cls_name = spec.rpartition(":")
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ValueError(f"train.callbacks entry {spec!r}: {where!r} has no {cls_name!r}")
    if not (inspect.isclass(cls) and issubclass(cls, Callback)):
        raise ValueError(f"train.callbacks entry {spec!r}: {cls_name} is not a paratron Callback subclass")
    params = inspect.signature(cls).parameters
    return cls(state) if params else cls()


def import_callback_module(spec: str):
    """Import the module of ``"module:Class"`` or ``"file.py:Class"`` (a file is imported once per
    process, under a stable name, so registrations in it happen once)."""
    if ":" not in spec:
        raise ValueError(f"train.callbacks entry {spec!r} must look like 'module:Class' or 'file.py:Class'")
    where = spec.rpartition(":")[0]
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"train.callbacks entry {spec!r}: file {where!r} does not exist")
        name = f"paratron_plugin_{path.stem}"
        if name in sys.modules:
            return sys.modules[name]
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise ValueError(f"train.callbacks entry {spec!r}: cannot import {where!r} ({e})") from None
