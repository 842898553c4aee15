"""``paratron plan``: enumerate the layouts the config validator accepts, cost each with a small
analytic model (one module per term), and write the best one as a config ``paratron train`` runs.

Modules: :mod:`.hardware` (device and link figures), :mod:`.shape` (the model's sizes),
:mod:`.compute` (seconds per microbatch per stage), :mod:`.communication` (bytes per axis, as the
comm ledger counts them, and their seconds), :mod:`.pipeline` (makespan and in-flight microbatches
from :mod:`paratron.pipeline.simulator`), :mod:`.memory` (bytes per rank), :mod:`.layouts`
(enumeration through :func:`paratron.rules.validate`), :mod:`.estimate` (one plan's cost),
:mod:`.search` (the ranked plans), :mod:`.calibrate` (CPU figures), :mod:`.report` and
:mod:`.command` (the CLI).
"""
