"""Pipeline actions: the vocabulary of schedules (docs/DESIGN.md principle 3).

A schedule is one list of :class:`Action` per pipeline rank. The runtime executes the lists, the
simulator costs them and the timeline draws them; nothing else describes a schedule.

Stages are numbered in model order: ``stage`` is the virtual pipeline stage (model chunk) index in
``[0, p*v)``; stage 0 holds the input embedding and stage ``p*v-1`` computes the loss. Which pipeline
rank holds which stages is the schedule's *placement* (:mod:`paratron.pipeline.placement`). On one
rank, the model chunks are ordered by ascending stage, so local chunk ``c`` is the ``c``-th smallest
stage of that rank.

Kinds (Qi et al. 2023, section 2, split the backward into B and W):

==========  ==========================================================================
``F``       forward of one microbatch through one stage
``B``       backward for the input grad only; linear layers defer their weight grads
``W``       the deferred weight grads of one earlier ``B`` of the same stage
``BW``      full backward (input and weight grads)
``R``       recompute the forward of one microbatch through one stage with grad, keeping its
            activations for the coming ``B``/``BW``; with an ``R`` in the list, that
            ``F`` runs without saving activations (only its input is kept)
``SEND_F``  send the output activation of ``F(microbatch, stage)`` to the rank of ``stage+1``
``RECV_F``  receive the input activation of ``F(microbatch, stage)`` from the rank of ``stage-1``
``SEND_B``  send the input grad of ``B/BW(microbatch, stage)`` to the rank of ``stage-1``
``RECV_B``  receive the output grad of ``B/BW(microbatch, stage)`` from the rank of ``stage+1``
``FB``      a pair: ``F(microbatch, stage)`` and its ``partner``, a ``B`` or ``BW`` of another
            microbatch, run interleaved so that one half's MoE all-to-alls travel while the
            other half computes (DeepSeek-V3's DualPipe overlap; :mod:`.overlap`)
``EF``      encoder forward of part ``part`` of one microbatch's images (multimodal models;
            Optimus, Feng et al. 2025): on any rank, which keeps the part's graph
``EB``      encoder backward of that part, on the rank of its ``EF``
``SEND_E``  send the encoder output of ``EF(microbatch, part)`` to the rank of stage 0
``RECV_E``  stage 0's rank receives it (before ``F(microbatch, 0)``)
``SEND_EG`` stage 0's rank sends the grad of that output, after the backward of ``(microbatch, 0)``
``RECV_EG`` the part's owner receives it (before ``EB(microbatch, part)``)
==========  ==========================================================================

Encoder actions have ``stage == 0`` (the stage they feed) and carry ``part``; they are not a
stage of the rank (:func:`stages_of` skips them). Their messages travel on their own channel
(:func:`channel`): they match in order among themselves, apart from the stages' messages, and a
batch never mixes the two channels (:mod:`.encoder_schedule`).

``peer`` is the pipeline-group rank of the other side of a send or recv (None for compute).
Consecutive send/recv actions in one rank's list form one batch (see :mod:`.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE_KINDS = ("F", "B", "W", "BW", "R", "FB")
P2P_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
ENCODER_COMPUTE_KINDS = ("EF", "EB")
ENCODER_P2P_KINDS = ("SEND_E", "RECV_E", "SEND_EG", "RECV_EG")
ENCODER_KINDS = ENCODER_COMPUTE_KINDS + ENCODER_P2P_KINDS
KINDS = COMPUTE_KINDS + P2P_KINDS + ENCODER_KINDS
BACKWARD_KINDS = ("B", "W", "BW", "SEND_B", "RECV_B")
TRAINING_ONLY_KINDS = BACKWARD_KINDS + ("R", "EB", "SEND_EG", "RECV_EG")


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank.

    Attributes:
        kind: one of :data:`KINDS`.
        microbatch: microbatch index in ``[0, m)``.
        stage: virtual pipeline stage (model chunk in model order) in ``[0, p*v)``.
        peer: pipeline-group rank of the other side, for send/recv kinds only.
        partner: for ``FB`` only, the backward half (a ``B`` or ``BW`` action); ``microbatch``
            and ``stage`` are then the forward half's.
        part: for encoder kinds only, which part of the microbatch's images (``>= 0``).

    Raises:
        ValueError: unknown kind, negative ids, a peer missing on send/recv (or given on compute),
            or an ``FB`` without a ``B``/``BW`` partner (or a partner on another kind), or an
            encoder kind without a part (or a part on another kind).
    """

    kind: str
    microbatch: int
    stage: int
    peer: int | None = None
    partner: "Action | None" = None
    part: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action.kind={self.kind!r} must be one of {', '.join(KINDS)}")
        if self.microbatch < 0 or self.stage < 0:
            raise ValueError(f"Action microbatch={self.microbatch} and stage={self.stage} must be >= 0")
        if self.is_p2p != (self.peer is not None):
            raise ValueError(f"Action {self.kind}: peer={self.peer} must be given exactly for send/recv kinds")
        if (self.kind == "FB") != (self.partner is not None):
            raise ValueError(f"Action {self.kind}: a partner is given exactly for FB (got {self.partner})")
        if self.partner is not None and self.partner.kind not in ("B", "BW"):
            raise ValueError(f"Action FB: the partner must be a B or BW action, not {self.partner}")
        if (self.kind in ENCODER_KINDS) != (self.part is not None and self.part >= 0):
            raise ValueError(f"Action {self.kind}: part={self.part} must be given (>= 0) exactly for encoder kinds")

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P_KINDS or self.kind in ENCODER_P2P_KINDS

    @property
    def is_encoder(self) -> bool:
        return self.kind in ENCODER_KINDS

    def __str__(self) -> str:
        if self.partner is not None:
            return f"F{self.microbatch}@s{self.stage}+{self.partner}"
        peer = f"->{self.peer}" if self.kind.startswith("SEND") else f"<-{self.peer}" if self.is_p2p else ""
        where = f"p{self.part}" if self.is_encoder else f"s{self.stage}"
        return f"{self.kind}{self.microbatch}@{where}{peer}"

    __repr__ = __str__


def F(mb: int, stage: int) -> Action:
    return Action("F", mb, stage)


def B(mb: int, stage: int) -> Action:
    return Action("B", mb, stage)


def W(mb: int, stage: int) -> Action:
    return Action("W", mb, stage)


def BW(mb: int, stage: int) -> Action:
    return Action("BW", mb, stage)


def R(mb: int, stage: int) -> Action:
    return Action("R", mb, stage)


def FB(forward: Action, backward: Action) -> Action:
    """The pair of ``forward`` (an ``F``) and ``backward`` (a ``B`` or ``BW``), run interleaved.

    Raises:
        ValueError: ``forward`` is not an ``F`` or ``backward`` not a ``B``/``BW``.
    """
    if forward.kind != "F":
        raise ValueError(f"FB pairs a forward F with a backward; the first half is {forward}")
    return Action("FB", forward.microbatch, forward.stage, partner=backward)


def EF(mb: int, part: int) -> Action:
    return Action("EF", mb, 0, part=part)


def EB(mb: int, part: int) -> Action:
    return Action("EB", mb, 0, part=part)


def channel(a: Action) -> str:
    """The message stream of a p2p action: ``"encoder"`` for the encoder kinds, else ``"stage"``."""
    return "encoder" if a.kind in ENCODER_KINDS else "stage"


def halves(a: Action) -> tuple[Action, ...]:
    """The plain actions an action stands for: ``(F, B|BW)`` for an ``FB``, else ``(a,)``."""
    return (F(a.microbatch, a.stage), a.partner) if a.kind == "FB" else (a,)


def expand(actions: list[Action]) -> list[Action]:
    """One rank's list with every ``FB`` replaced by its two halves, forward first."""
    return [h for a in actions for h in halves(a)]


def batches(actions: list[Action]) -> list[list[Action]]:
    """Split one rank's list into steps: each compute action alone, each maximal run of
    consecutive send/recv actions of one :func:`channel` as one batch (posted together with
    ``batch_isend_irecv``)."""
    out: list[list[Action]] = []
    for a in actions:
        if a.is_p2p and out and out[-1][0].is_p2p and channel(out[-1][0]) == channel(a):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def forward_only(actions: list[Action]) -> list[Action]:
    """The same list without backward work, recomputes and grad transfers (for evaluation); an
    ``FB`` keeps its forward half."""
    return [a for a in expand(actions) if a.kind not in TRAINING_ONLY_KINDS]


def recomputed(actions: list[Action]) -> set[tuple[int, int]]:
    """The (microbatch, stage) pairs of one rank's list that have an ``R``: their ``F`` keeps
    only its input."""
    return {(a.microbatch, a.stage) for a in actions if a.kind == "R"}


def activation_peak(actions: list[Action]) -> int:
    """Most full activations one rank holds at once, in list order: a (microbatch, stage) holds
    them from its ``F`` (or its ``R`` when it is recomputed) until the end of its ``BW`` or ``W``.
    A recomputed ``F`` keeps only its input, which is not counted (it is ``1/layers`` of the
    activations of a stage; Korthikanti et al. 2022, section 4)."""
    again = recomputed(actions)
    alive = peak = 0
    for a in expand(actions):
        if a.kind == "R" or a.kind == "F" and (a.microbatch, a.stage) not in again:
            alive += 1
            peak = max(peak, alive)
        elif a.kind in ("BW", "W"):
            alive -= 1
    return peak


def last_backward_actions(actions: list[Action]) -> dict[int, Action]:
    """For each stage of one rank's list, its last ``B``, ``W`` or ``BW`` action: after it, that
    stage's chunk receives no more grads in the step (a ``W`` always follows its ``B``). When that
    backward is the half of an ``FB``, the ``FB`` is returned."""
    last = {}
    for a in actions:
        for h in halves(a):
            if h.kind in ("B", "W", "BW"):
                last[h.stage] = a
    return last


def stages_of(actions: list[Action]) -> list[int]:
    """The stages this rank's list touches, ascending: local chunk ``c`` is ``stages_of(...)[c]``
    (encoder actions are not a stage's)."""
    return sorted({h.stage for a in actions for h in halves(a) if not h.is_encoder})
