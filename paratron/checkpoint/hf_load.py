"""Start a run from a Hugging Face folder (``checkpoint.load_hf`` / ``paratron train --from-hf``),
each rank reading only its own slices of the safetensors files.

:func:`apply_load_hf` (before validation, on the launcher and every rank) takes the model config
from ``DIR/config.json`` (:func:`paratron.checkpoint.hf.hf_config_to_model`) and the tokenizer
from ``DIR/tokenizer.json``. :func:`load_hf_slices` fills the params of this rank's model chunks:
for each param it follows the converter's own :class:`~paratron.checkpoint.hf_recipe.Recipe`
(the one name/layout mapping), maps the rows of its ``ShardSpec`` to source rows with
:meth:`Recipe.row_origins`, and reads each run of consecutive source rows with
``safe_open(...).get_slice(name)[rows, cols]``, straight into the param. So a rank reads exactly
the elements of its shards (TP slices, its pipeline stage's layers, its experts under EP; CP and
ZeRO-1/2 replicate or shard nothing of the params here), and the loader's own tensors are one
run of rows at a time: no whole tensor is built, fused QKV and ``[gate; up]`` included (their
joins only reorder rows). Under ZeRO-3 the load, like a checkpoint load, fills the rank's full
TP/PP-local params inside ``full_params`` and writes the DP shards back.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from paratron.config import ConfigError, apply_overrides
from paratron.parallel.params import unique_params

from .hf import hf_config_to_model, hf_recipes, source_names, unmapped_sources
from .hf_recipe import Recipe
from .manager import full_params
from .items import iter_params


@dataclass
class LoadStats:
    """What :func:`load_hf_slices` read on this rank, in bytes of the tensors it created (each
    ``get_slice`` result; nothing else is allocated by the loader): ``read`` in all, ``largest``
    single read (the most the loader holds at once: each read is copied into its param and
    dropped), and ``params`` (the bytes of the params it filled, padding excluded)."""

    read: int = 0
    largest: int = 0
    params: int = 0
    tensors: int = 0

    def add(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.read += n
        self.largest = max(self.largest, n)


class SafetensorsFolder:
    """The safetensors files of a Hugging Face folder (``model.safetensors`` or the files of
    ``model.safetensors.index.json``), opened lazily; headers only until a slice is read.

    Raises:
        FileNotFoundError: neither file exists.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import safe_open

        hf_dir = Path(hf_dir)
        single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
        if single.is_file():
            files = {None: single}
        elif index.is_file():
            files = {f: hf_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))}
        else:
            raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json "
                                    "(only safetensors checkpoints are supported)")
        self._stack = ExitStack()
        self._handles = {}
        for path in files.values():
            h = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._handles.update({name: h for name in h.keys()})

    @property
    def names(self) -> list[str]:
        return list(self._handles)

    def slice(self, name: str):
        return self._handles[name].get_slice(name)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "SafetensorsFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_hf_config(hf_dir: str | Path) -> dict:
    """``DIR/config.json`` as a dict.

    Raises:
        ConfigError: no such file, or not JSON (the path named).
    """
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"checkpoint.load_hf={hf_dir}: no config.json (a Hugging Face model folder is expected)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None


def apply_load_hf(cfg, overrides: list[str]) -> None:
    """With ``checkpoint.load_hf`` set, replace ``cfg.model`` by the folder's model (then apply the
    ``model.*`` overrides again) and use its ``tokenizer.json`` unless a ``data.tokenizer_*``
    override names another. ``model.seq_length`` (the training context) stays the run's, at most
    the model's ``max_position_embeddings``.

    Raises:
        ConfigError: no config.json, or a model paratron does not support (named).
    """
    hf_dir = cfg.checkpoint.load_hf
    if not hf_dir:
        return
    seq = cfg.model.seq_length
    cfg.model = hf_config_to_model(read_hf_config(hf_dir), str(Path(hf_dir) / "config.json"))
    cfg.model.seq_length = min(seq, cfg.model.max_position_embeddings or seq)
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    apply_overrides(cfg, [o for o, k in zip(overrides, keys) if k.startswith("model.")])
    tok = Path(hf_dir) / "tokenizer.json"
    if tok.is_file() and not any(k.startswith("data.tokenizer") for k in keys):
        cfg.data.tokenizer_type, cfg.data.tokenizer_model = "HuggingFaceTokenizer", str(tok)


def hf_param_names(cfg) -> frozenset[str]:
    """The logical names of the params :func:`load_hf_slices` fills under ``cfg`` (empty without
    ``checkpoint.load_hf``), for ``layers.init.skip_draws``."""
    if not cfg.checkpoint.load_hf:
        return frozenset()
    return frozenset(hf_recipes(cfg.model, read_hf_config(cfg.checkpoint.load_hf)))


def load_hf_slices(chunks, hf_dir: str | Path, model_cfg) -> LoadStats:
    """Fill this rank's params of ``chunks`` (any TP/PP/EP layout) from a Hugging Face folder,
    reading only their slices. Params the folder has no tensor for (an expert bias) are left as
    they are.

    Returns: the :class:`LoadStats` of this rank.
    Raises:
        FileNotFoundError: no safetensors file.
        KeyError: a tensor the mapping needs is missing (named).
        ValueError: a tensor of the wrong shape, or tensors the mapping does not know (named).
    """
    hf = read_hf_config(hf_dir)
    where = str(hf_dir)
    recipes = hf_recipes(model_cfg, hf, where)
    stats = LoadStats()
    with SafetensorsFolder(hf_dir) as st, torch.no_grad():
        names = source_names(hf, st.names, where)
        left = unmapped_sources(model_cfg, recipes, names)
        if left:
            raise ValueError(f"{where}: tensors not mapped to paratron names: {left[:8]}"
                             f"{' ...' if len(left) > 8 else ''}")
        for p in unique_params(chunks):
            if p.meta.logical_name in recipes:
                _load_param(p, recipes[p.meta.logical_name], st, names, stats, where)
    return stats


def _source_shapes(recipe: Recipe, st: SafetensorsFolder, names: dict, where: str) -> list[tuple[int, ...]]:
    missing = [s for s in recipe.sources if s not in names]
    if missing:
        raise KeyError(f"{where}: tensor {missing[0]!r} is missing from the checkpoint")
    shapes = [tuple(st.slice(names[s]).get_shape()) for s in recipe.sources]
    return [s[::-1] if recipe.transposed else s for s in shapes]


def _load_param(p: torch.Tensor, recipe: Recipe, st: SafetensorsFolder, names: dict, stats: LoadStats,
                where: str) -> None:
    spec = p.meta.shard
    shapes = _source_shapes(recipe, st, names, where)
    full = (sum(s[0] for s in shapes),) + shapes[0][1:]
    if recipe.expect is not None and full != recipe.expect:
        raise ValueError(f"{recipe.sources[0]} has shape {full}; {recipe.rule}")
    if full != tuple(spec.global_shape):
        raise ValueError(f"{where}: {p.meta.logical_name} from {list(recipe.sources)} has shape {full}; the model "
                         f"config gives {tuple(spec.global_shape)}")
    which, row = recipe.row_origins([s[0] for s in shapes])
    index = spec.slices()
    rows = index[0] if isinstance(index[0], torch.Tensor) else torch.arange(index[0].start, index[0].stop)
    which, row, rest = which[rows], row[rows], index[1:]
    dst = spec.valid(p)
    # Runs of local rows that are consecutive rows of one source: one read each.
    cut = torch.nonzero((which[1:] != which[:-1]) | (row[1:] != row[:-1] + 1)).flatten() + 1
    bounds = [0] + cut.tolist() + [len(rows)] if len(rows) else []
    for i, j in zip(bounds[:-1], bounds[1:]):
        sl = st.slice(names[recipe.sources[int(which[i])]])
        a, b = int(row[i]), int(row[j - 1]) + 1
        if recipe.transposed:  # stored [in, out]: our rows are its columns
            piece = sl[(rest[0] if rest else slice(None), slice(a, b))].t()
        else:
            piece = sl[(slice(a, b),) + rest]
        stats.add(piece)
        dst[i:j].copy_(piece)
        del piece  # freed before the next read: one piece alive at a time
    stats.params += dst.numel() * dst.element_size()
    stats.tensors += 1


def load_hf_weights(cfg, chunks, optimizer) -> LoadStats:
    """:func:`load_hf_slices` from ``checkpoint.load_hf`` into a run's model, then the optimizer's
    fp32 main weights from the params (as a checkpoint load without optimizer state does); under
    ZeRO-3 inside the gathered params. Call on every rank."""
    with torch.no_grad(), full_params(optimizer, writeback=True):
        stats = load_hf_slices(chunks, cfg.checkpoint.load_hf, cfg.model)
        if optimizer is not None:
            optimizer.copy_params_into_main(iter_params(chunks))
    return stats
