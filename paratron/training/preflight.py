"""Checks of the file system that must pass before any process group exists."""

from __future__ import annotations

from pathlib import Path

from paratron.config import Config, ConfigError


def data_prefixes(paths: list[str]) -> list[tuple[float, str]]:
    """Parse Megatron's ``[w1, p1, w2, p2]`` or ``[p1, p2]`` into (weight, prefix) pairs."""
    if not paths:
        return []
    try:
        float(paths[0])
        weighted = True
    except ValueError:
        weighted = False
    if not weighted:
        return [(1.0, p) for p in paths]
    if len(paths) % 2:
        raise ConfigError(f"data.data_path={paths} mixes weights and prefixes; give pairs 'w1 p1 w2 p2'")
    return [(float(paths[i]), paths[i + 1]) for i in range(0, len(paths), 2)]


def check_paths(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the field and path when an input file is missing."""
    d = cfg.data
    if d.corpus is not None and not Path(d.corpus).is_file():
        raise ConfigError(f"data.corpus={d.corpus!r}: no such file")
    for _, prefix in data_prefixes(d.data_path):
        if d.corpus is not None:
            continue  # created from the corpus on first use
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise ConfigError(f"data.data_path: {prefix + ext!r} does not exist "
                                  "(run `paratron preprocess` or set data.corpus)")
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        v = getattr(d, name)
        if v is not None and not Path(v).is_file():
            raise ConfigError(f"data.{name}={v!r}: no such file")
    if cfg.checkpoint.load is not None and not Path(cfg.checkpoint.load).exists():
        raise ConfigError(f"checkpoint.load={cfg.checkpoint.load!r}: no such directory")


def import_plugins(cfg: Config) -> None:
    """Import the modules named in ``train.callbacks``, so that the schedules, dispatchers and
    blocks they register exist before the config is checked against the registries."""
    from paratron.training.callbacks import import_callback_module

    for spec in cfg.train.callbacks:
        import_callback_module(spec)
