"""Example plugin: a pipeline schedule of your own, ``gpipe-lifo``.

GPipe (every forward, then every backward) with the backwards newest microbatch first, so each
rank frees the activations it made last first. Only the compute order is written here:
``with_p2p`` places the sends and receives, and ``build_schedule`` proves the lists (no
deadlock, every message matched) before any rank runs them. Train with it::

    paratron train --set 'train.callbacks=["examples/plugins/custom_schedule.py:Registered"]' \\
        --set parallel.schedule=gpipe-lifo --set parallel.pipeline=2 ...
"""

from __future__ import annotations

from paratron.pipeline.actions import BW, F
from paratron.pipeline.registry import register_schedule
from paratron.pipeline.schedules import check_gpipe, with_p2p
from paratron.training.callbacks import Callback


def gpipe_lifo(p: int, m: int, v: int = 1):
    """``p`` ranks, one stage each, ``m`` microbatches: one action list per rank."""
    return with_p2p([[F(i, r) for i in range(m)] + [BW(i, r) for i in reversed(range(m))] for r in range(p)])


register_schedule("gpipe-lifo", gpipe_lifo, check=check_gpipe)


class Registered(Callback):
    """Does nothing per step; naming it in ``train.callbacks`` imports this file on every rank
    (and in the launcher, before the config is checked), which registers the schedule."""
