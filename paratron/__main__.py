"""``python -m paratron ...`` (what torchrun runs with ``-m paratron``).

The first lines stamp this process's start and the end of ``import torch`` for the start-up
breakdown (:mod:`paratron.launch.startup`); nothing else may come before them.
"""

import os
import time

os.environ["PARATRON_PROCESS_START"] = repr(time.time())
import torch  # noqa: E402,F401  (timed: the breakdown's ``import_torch``)

os.environ["PARATRON_TORCH_IMPORTED"] = repr(time.time())

import sys  # noqa: E402

from paratron.cli import main  # noqa: E402

sys.exit(main())
