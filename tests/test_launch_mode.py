"""How a process was started is decided in one place (``launch.mode.started``): the launcher
(``--nproc-per-node`` outside torchrun), a torchrun rank (by paratron's launcher or a bare
torchrun) or one process alone."""

from __future__ import annotations

from paratron.launch.mode import LOG_DIR_ENV, Mode, started


def test_started_tells_the_launcher_a_rank_and_alone_apart():
    alone = started(None, {})
    assert (alone.mode, alone.rank, alone.world_size, alone.under_launcher) == (Mode.ALONE, 0, None, False)
    launcher = started(2, {})
    assert launcher.mode is Mode.LAUNCHER and not launcher.torchrun
    bare = started(2, {"RANK": "3", "WORLD_SIZE": "4"})  # --nproc-per-node inside torchrun: a rank
    assert (bare.mode, bare.rank, bare.world_size, bare.under_launcher) == (Mode.RANK, 3, 4, False)
    ours = started(None, {"RANK": "1", "WORLD_SIZE": "2", LOG_DIR_ENV: "/tmp/logs"})
    assert ours.torchrun and ours.under_launcher and ours.log_dir == "/tmp/logs"
