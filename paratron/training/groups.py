"""The process-group kinds a training run communicates on, from its config.

:meth:`~paratron.parallel.context.ParallelContext.build` creates process groups only for these
kinds, so a group the run never uses is never created. Every rank computes the same tuple from the
same config, and ``build`` creates the groups in one fixed order, so the collective
``new_group`` calls cannot deadlock. A kind left out by mistake is not a silent hang: its first
collective raises :class:`~paratron.parallel.comm.GroupNotCreated` naming this module.

Who uses which kind (every collective goes through a :class:`~paratron.parallel.comm.Group`):

====================  =====================================================  ==================
kind                  users                                                  when
====================  =====================================================  ==================
``tp``                TP layers, vocab-parallel loss, SP grads, MoE stats     always
``cp``                ring / Ulysses attention, MoE stats                    always
``pp``                pipeline p2p, the step's loss stats                    always
``dp_cp``             DDP / ZeRO dense buckets, token count and loss stats   always
``world``             optimizer norm, stop flag, object gathers, barriers    always (default)
``embedding``         tied input/output embedding grads                      ``tie_embeddings``
``ep``                MoE token dispatch                                     MoE
``expert_tp``         expert-TP MLPs, their token counts                     MoE
``expert_dp``         expert-param buckets                                   MoE
``tp_cp``             MoE router stats under SP with CP                      MoE and SP
``dp``                sequence count of the sequence-level aux loss          MoE, ``seq`` loss
``mp``, ``tp_dp_cp``, no collective in paratron                              never
``expert_tp_ep``,
``position_embedding``
====================  =====================================================  ==================

A kind whose groups have one rank (``cp`` at ``parallel.context=1``) or equal another kind's
(``dp_cp`` and ``dp`` without CP) costs nothing more: ``build`` makes one process group per
distinct rank set of more than one rank.
"""

from __future__ import annotations

from paratron.config import Config
from paratron.parallel.context import ParallelContext
from paratron.parallel.grid import GROUP_KINDS

ALWAYS = ("tp", "cp", "pp", "dp_cp", "world")
MOE = ("ep", "expert_tp", "expert_dp")


def groups_used(cfg: Config) -> tuple[str, ...]:
    """The group kinds a training run of ``cfg`` communicates on (see the module docstring), in
    :data:`~paratron.parallel.grid.GROUP_KINDS` order."""
    m = cfg.model
    kinds = set(ALWAYS)
    if m.tie_embeddings or m.mtp_num_layers:  # MTP shares the word embedding with the last stage
        kinds.add("embedding")
    if m.num_experts > 0:
        kinds.update(MOE)
        if cfg.parallel.sequence_parallel:
            kinds.add("tp_cp")
        if m.moe_aux_loss_type == "seq":
            kinds.add("dp")
    return tuple(k for k in GROUP_KINDS if k in kinds)


def context_for(cfg: Config) -> ParallelContext:
    """The run's :class:`ParallelContext` in the current default group: its layout, with the
    process groups of :func:`groups_used` only (collective over the world)."""
    p = cfg.parallel
    return ParallelContext.build(tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline,
                                 expert_tp=p.expert_tensor, order=p.order, kinds=groups_used(cfg))
