"""How this process was started, decided once: paratron's launcher, a rank torchrun started, or alone.

* ``LAUNCHER``: ``paratron <command> --nproc-per-node N`` outside torchrun; it validates the
  config, then starts torchrun and waits (:mod:`.launch`).
* ``RANK``: a rank torchrun started (``WORLD_SIZE`` is set), either by paratron's launcher
  (``under_launcher``: its log directory is in :data:`LOG_DIR_ENV`) or by a bare ``torchrun``.
* ``ALONE``: one process, no torchrun.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Mapping

LOG_DIR_ENV = "PARATRON_LOG_DIR"
"""Set by paratron's launcher for the ranks it starts: where each writes its log and records."""


class Mode(enum.Enum):
    LAUNCHER = "launcher"
    RANK = "rank"
    ALONE = "alone"


@dataclass(frozen=True)
class Started:
    """This process's :class:`Mode`, and what its environment says about it.

    Attributes:
        mode: see the module docstring.
        rank: the global rank (``RANK``; 0 for the launcher and alone).
        world_size: torchrun's ``WORLD_SIZE``, or None outside torchrun.
        log_dir: the launcher's log directory for its ranks (:data:`LOG_DIR_ENV`), or None.
    """

    mode: Mode
    rank: int
    world_size: int | None
    log_dir: str | None

    @property
    def under_launcher(self) -> bool:
        """A rank started by paratron's launcher (not by a bare torchrun)."""
        return self.log_dir is not None

    @property
    def torchrun(self) -> bool:
        """Inside a torchrun job (``RANK`` mode)."""
        return self.mode is Mode.RANK


def started(nproc_per_node: int | None = None, env: Mapping[str, str] | None = None) -> Started:
    """The :class:`Started` of this process, from its environment (default ``os.environ``) and
    the command's ``--nproc-per-node`` (which makes a process outside torchrun the launcher)."""
    env = os.environ if env is None else env
    world = env.get("WORLD_SIZE")
    if world is not None:
        mode = Mode.RANK
    else:
        mode = Mode.LAUNCHER if nproc_per_node else Mode.ALONE
    return Started(mode, int(env.get("RANK", 0) or 0), None if world is None else int(world),
                   env.get(LOG_DIR_ENV) or None)
