"""The non-finite policy (``train.nonfinite``): what the loop does after a step whose loss or
grads held an inf or NaN.

The decision itself is global and already made when this module sees it: the loss is summed
over the pipeline and data-parallel groups in the step, and the optimizer's one all-reduce of
``[squared grads, non-finite flag]`` covers every rank's grads
(:meth:`paratron.optim.optimizer.Optimizer.step`), so every rank holds the same
:class:`~paratron.optim.optimizer.StepResult` and takes the same branch. A non-finite step has
changed no param, optimizer moment or step counter on any rank. Under ``"skip"`` the loop goes on
(the data position advances, the LR schedule does not: Megatron's rule for skipped iterations);
under ``"stop"``, or after ``train.max_consecutive_skips`` such steps in a row, it raises
:class:`NonFiniteStop` on every rank, before any save, so the last checkpoint stays the last
good one.
"""

from __future__ import annotations


class NonFiniteStop(RuntimeError):
    """The run stops on a non-finite step; the message names the step, the first param with a
    non-finite grad and its rank, when one was found."""


class NonFiniteGuard:
    """Counts non-finite steps in a row and applies ``train.nonfinite``.

    Args:
        policy: ``"skip"`` or ``"stop"``.
        max_consecutive: under ``"skip"``, the number of non-finite steps in a row that ends
            the run.
    """

    def __init__(self, policy: str, max_consecutive: int) -> None:
        self.policy, self.max_consecutive = policy, int(max_consecutive)
        self.in_a_row = 0

    def state_dict(self) -> dict:
        """The non-finite steps in a row so far (``consecutive_nonfinite_steps``): a checkpoint
        may follow a skipped step, and the skips of a resumed run continue that count against
        ``train.max_consecutive_skips``."""
        return {"consecutive_nonfinite_steps": self.in_a_row}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (a checkpoint written before it was saved: 0)."""
        self.in_a_row = int(d.get("consecutive_nonfinite_steps", 0))

    def check(self, iteration: int, nonfinite: bool, where) -> str | None:
        """After step ``iteration`` (1-based): None when it was finite; else a warning line for
        a skipped step.

        Args:
            where: called only for a non-finite step, on every rank (it may run a collective):
                returns a short "first non-finite grad: ..." description.

        Raises:
            NonFiniteStop: under ``"stop"``, or at ``max_consecutive`` non-finite steps in a row.
        """
        if not nonfinite:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        what = f"iteration {iteration}: non-finite loss or grads ({where()})"
        if self.policy == "stop":
            raise NonFiniteStop(f"{what}; stopped before the update (train.nonfinite='stop'); "
                                "nothing was saved after the last good checkpoint")
        if self.in_a_row >= self.max_consecutive:
            raise NonFiniteStop(f"{what}; {self.in_a_row} non-finite steps in a row reached "
                                f"train.max_consecutive_skips={self.max_consecutive}: stopped; "
                                "nothing was saved after the last good checkpoint")
        return f"{what}; step skipped ({self.in_a_row} in a row, limit {self.max_consecutive})"
