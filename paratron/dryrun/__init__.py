"""``paratron dryrun``: one training step of any layout, rank by rank, on torch's fake process
group with meta tensors (:mod:`.rehearse`), measured the same way as a real run (:mod:`.measure`)
and set beside the planner's prediction (:mod:`.predict`); :mod:`.run` chooses the ranks and
checks memory. See docs/ARCHITECTURE.md, "Dry runs"."""
