"""``python -m paratron ...`` (what torchrun runs with ``-m paratron``)."""

import sys

from paratron.cli import main

sys.exit(main())
