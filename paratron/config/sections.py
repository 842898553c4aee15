"""The seven sections of a run's configuration, one dataclass each, a docstring under each field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional


@dataclass
class ModelConfig:
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 256
    """Model width h."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = None
    """KV groups for grouped-query attention; None means multi-head (= num_attention_heads)."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width; None means 4h (GELU) or Llama's rounded 8h/3 (SwiGLU)."""
    vocab_size: Optional[int] = None
    """Vocabulary size before padding; None takes it from the tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocab is a multiple of this times parallel.tensor."""
    seq_length: int = 256
    """Tokens per sample."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position table; None means seq_length."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """LayerNorm (GPT-2) or RMSNorm (Llama) before attention, MLP and the output layer."""
    norm_epsilon: float = 1e-5
    """Epsilon added to the variance inside each norm."""
    position_embedding_type: Literal["learned", "rope"] = "learned"
    """A learned position table (GPT-2) or rotary embeddings on q and k (RoPE, Llama)."""
    rope_theta: float = 10000.0
    """RoPE base: the rotation frequencies are rope_theta ** (-2i / head_dim)."""
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    """gelu (erf), gelu_tanh (the tanh approximation GPT-2 uses), or swiglu (gated, Llama)."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linears."""
    add_qkv_bias: Optional[bool] = None
    """Bias on the fused QKV projection; None follows ``add_bias_linear`` (Qwen2: only QKV)."""
    kv_channels: Optional[int] = None
    """Width of one attention head (Megatron's name); None means hidden_size / num_attention_heads.
    Qwen3 sets it apart from the hidden size (e.g. h=1024, 16 heads of 128)."""
    qk_layernorm: bool = False
    """QK-norm (Qwen3, OLMo 2; Megatron's ``--qk-layernorm``): the config's norm over each head's
    query and key, before RoPE, one ``kv_channels``-wide weight per layer for q and one for k."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer."""
    hidden_dropout: float = 0.0
    """Dropout probability on the attention and MLP outputs and the embeddings."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal init of the weights; output projections use std / sqrt(2 num_layers) (GPT-2)."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recompute (Korthikanti et al. 2022): whole layer, or the attention core only."""
    compile: bool = False
    """``torch.compile`` each transformer layer (opt-in; the first steps pay for compilation); in a
    one-process CPU run with inductor's C++ wrapper, which needs a C++ compiler as inductor's CPU
    kernels do."""
    activation_offload: list[str] = field(default_factory=list)
    """Submodules of every transformer layer whose saved activations go to host memory after the
    layer's forward and come back (one layer ahead) for its backward: any of ``input_norm``,
    ``attention``, ``post_attention_norm``, ``mlp``, or ``layer`` (all of it). No-op on CPU runs;
    not with ``recompute = "full"`` (paratron/models/offload.py)."""
    block: str = "transformer"
    """Name of the transformer block in the block registry."""
    # Multi-head latent attention (DeepSeek-V2 section 2.1; Megatron-Core's MLATransformerConfig names).
    multi_latent_attention: bool = False
    """MLA instead of multi-head/grouped-query attention (paratron/models/mla.py)."""
    q_lora_rank: Optional[int] = None
    """MLA: rank of the query down-projection; None projects the queries at full rank (V2-Lite)."""
    kv_lora_rank: int = 512
    """MLA: rank of the joint key/value latent (the KV cache per token, with the RoPE key)."""
    qk_head_dim: int = 128
    """MLA: per-head width of the query/key part without position (DeepSeek's qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head width of the decoupled RoPE part of q; its key part is one head shared by all."""
    v_head_dim: int = 128
    """MLA: per-head width of the values."""
    # Multi-token prediction (DeepSeek-V3 section 2.2; paratron/models/mtp.py).
    mtp_num_layers: int = 0
    """D sequential MTP modules on the last stage; module k (1-based) predicts token i + k + 1 at position i."""
    mtp_loss_scaling_factor: float = 0.1
    """lambda: the MTP loss (mean over the D modules) is added to the LM loss times this."""
    # Mixture of experts (num_experts = 0 means dense).
    num_experts: int = 0
    """Routed experts per MoE layer; 0 means a dense model."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts (Mixtral), or a sigmoid per expert (DeepSeek-V3)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss (Switch Transformer); 0 turns it off."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss on the logits' log-sum-exp (ST-MoE); 0 turns it off."""
    moe_capacity_factor: Optional[float] = None
    """None means dropless."""
    moe_layer_freq: int = 1
    """Every k-th layer is an MoE layer (1 = every layer)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of one expert; None means ffn_hidden_size."""
    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    """Inner width of the shared expert; None means no shared expert."""
    moe_token_dispatcher: str = "alltoall"
    """Token dispatcher registry name: alltoall, allgather, alltoall_chunked or prefetch."""
    moe_dispatch_chunks: int = 2
    """alltoall_chunked: token chunks per microbatch (k >= 1); chunk i+1's dispatch and chunk
    i-1's combine are in flight while chunk i's experts compute."""
    moe_prefetch_policy: Literal["auto", "pull", "push"] = "auto"
    """prefetch dispatcher (PopFetcher): per remote expert, pull its weights when its predicted
    pairs times the hidden size exceed its parameter count ("auto"), or always pull / always
    push (all-to-all) the tokens."""
    moe_prefetch_window: int = 4
    """prefetch dispatcher: forwards of routing history its hot-expert predictor keeps."""
    moe_pad_to_capacity: bool = False
    """With a capacity factor, pad every expert's rows to its capacity (static shapes)."""
    moe_aux_loss_type: Literal["micro_batch", "seq"] = "micro_batch"
    """Load balance over the whole microbatch (Switch), or per sequence (DeepSeek-V2's
    sequence-wise balance loss; each packed document is its own sequence), averaged over the
    sequences of the global batch."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Over capacity, keep each expert's highest-scoring (token, expert) pairs ("probs"), or its
    earliest ones in the microbatch ("position")."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for the
    top-k choice only, moved by ``moe_router_bias_update_rate`` against the load error each step."""
    moe_router_bias_update_rate: float = 1e-3
    """Step size of the expert-bias update under ``moe_router_enable_expert_bias``."""
    moe_expert_gemm: Literal["auto", "grouped_mm", "bmm", "loop"] = "auto"
    """How the local experts run: grouped GEMMs (torch._grouped_mm, padded bmm), one GEMM per
    expert (loop), or auto (grouped on CUDA, the loop on CPU where it measured faster)."""
    moe_router_norm_topk_prob: bool = True
    """With top-k > 1, renormalise the chosen experts' scores to sum to 1 (Mixtral); false keeps
    the raw softmax probabilities (Qwen1.5/2-MoE's ``norm_topk_prob = false``)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x . w)``, one learned gate per token (Qwen2-MoE)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing (DeepSeek-V2/V3): experts in this many equal groups (e.g. one per
    node); each token picks among the experts of its ``moe_router_group_topk`` best groups."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token chooses among under group-limited routing (with ``moe_router_num_groups``)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the combine weights of the chosen experts (DeepSeek-V3's ``routed_scaling_factor``,
    2.5 there, which offsets sigmoid scores normalised over the top-k); None means 1."""
    first_k_dense_replace: int = 0
    """The first this many layers have a dense MLP (of ``ffn_hidden_size``) instead of an MoE one
    (DeepSeek-V3: 3); the later layers follow ``moe_layer_freq``."""
    lora_rank: int = 0
    """LoRA (Hu et al. 2021): the rank r of the adapters on the ``lora_targets`` linears; 0 means no
    LoRA. With r > 0 every other parameter is frozen (no grad, no optimizer state)."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter output is multiplied by ``lora_alpha / lora_rank``."""
    lora_dropout: float = 0.0
    """Dropout probability on the adapters' input (the base linear sees the input undropped)."""
    lora_targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])
    """The linears that get adapters, by paratron's module names: ``qkv`` (fused attention input;
    HF q_proj, k_proj, v_proj), ``proj`` (attention output; o_proj), ``fc1`` (MLP input, SwiGLU's
    fused gate and up; gate_proj, up_proj), ``fc2`` (MLP output; down_proj). MoE experts get none."""
    low_rank: int = 0
    """Low-rank (CoLA) projections: every attention and MLP linear ``W`` becomes ``B silu(A x)`` with
    ``A [r, in]``, ``B [out, r]`` and this ``r``; 0 means full rank (docs/boost.md)."""
    low_rank_tp: Literal["naive", "bottleneck"] = "naive"
    """Tensor-parallel plan of the low-rank projections: ``naive`` (A column-, B row-parallel,
    sequence parallelism allowed) or ``bottleneck`` (BOOST: hidden-sharded residual stream, A
    row-, B column-parallel, one all-reduce of the r-wide bottleneck; docs/boost.md)."""
    low_rank_recompute: bool = False
    """Under ``low_rank_tp = "bottleneck"``: recompute inside each layer so that only the r-wide
    bottleneck activations (and the residual stream) are kept for the backward."""


@dataclass
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size."""
    pipeline: int = 1
    """Pipeline-parallel size."""
    virtual_pipeline: int = 1
    """Virtual pipeline stages (model chunks) per rank."""
    context: int = 1
    """Context-parallel size C: each sequence is split over C ranks (see context_algorithm)."""
    context_algorithm: Literal["ring", "all2all"] = "ring"
    """ring: K/V blocks circulate over the CP ranks, load-balanced split into 2C chunks (Liu et al.
    2023); all2all: DeepSpeed-Ulysses head/sequence all-to-all (Jacobs et al. 2023)."""
    expert: int = 1
    """Expert-parallel size."""
    expert_tensor: int = 1
    """Tensor-parallel size of expert layers."""
    sequence_parallel: bool = False
    """Split the activations outside the TP regions along the sequence over the TP ranks (tensor > 1)."""
    zero: int = 0
    """ZeRO stage over DP: 0 plain DDP; 1 optimizer state sharded; 2 also grads; 3 also params."""
    zero3_reshard_after_forward: bool = True
    """ZeRO-3: free a layer's gathered params after its forward (gather again for backward);
    false keeps them gathered until the end of the step's backward (one all-gather per step)."""
    zero3_prefetch: bool = True
    """ZeRO-3: start the next layer's all-gather while the current layer computes."""
    schedule: str = "1f1b"
    """Pipeline schedule registry name: gpipe, 1f1b, interleaved, zb-h1, zbv, dualpipev, or a registered one."""
    pipeline_layout: Optional[list[int]] = None
    """Transformer layers per pipeline stage (virtual stages in order); None splits evenly."""
    pipeline_link_latency_ms: Optional[list[float]] = None
    """Extra latency (ms) of each link between pipeline ranks k and k+1 (pipeline-1 entries), for
    the simulator and the ``1f1b-delay`` schedule's warm-ups (CrossPipe); None: all links equal."""
    pipeline_microbatch_time_ms: Optional[float] = None
    """Forward plus backward of one microbatch on one stage (ms), which ``1f1b-delay`` divides the
    link latencies by; None: measured over the first training step (which runs plain 1F1B)."""
    overlap_moe_expert_parallel_comm: bool = False
    """Pair forward and backward actions of different microbatches on each pipeline rank (``FB``,
    :func:`paratron.pipeline.overlap.overlap_fb`; one rank without PP pairs them all), so that each
    MoE all-to-all of one microbatch's forward runs while a layer of another microbatch's backward
    computes (DeepSeek-V3's DualPipe overlap). Needs MoE layers and a dispatcher that calls the
    in-flight hook (``alltoall``)."""
    encoder_placement: Literal["stage0", "optimus"] = "stage0"
    """Where a multimodal model's encoder runs (:mod:`paratron.pipeline.encoder_schedule`):
    ``stage0`` on pipeline stage 0's rank (Megatron), ``optimus`` replicated on every pipeline
    rank, its forward and backward parts placed in the schedule's bubbles by the simulator's costs
    and its grads summed over pp x dp (Optimus, USENIX ATC 2025; docs/optimus.md). Read by the
    pipeline API (``place_encoder``, ``run_pipeline(encoder=)``); ``paratron train`` builds no
    multimodal model yet."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying axis first."""
    overlap_grad_reduce: bool = True
    """Start each gradient bucket's reduction as soon as its grads are ready."""
    bucket_size_mb: float = 40.0
    """Gradient bucket size in MiB."""
    timeout_s: float = 600.0
    """Collective timeout; a hang becomes an error after this long."""
    hang_timeout_s: float = 300.0
    """Seconds one collective or p2p op may stay pending before the hang watchdog dumps every
    rank's recent ops to RUN_DIR/hang/ and ends the job; 0 turns the watchdog off."""
    check_collectives: bool = False
    """Before every collective, the members of its group exchange its signature (op, group,
    reduce op, dtype, element count) on the host and stop with CollectiveMismatch, naming each
    rank's op, when they differ; one extra host round trip per collective. Off, the stop
    agreement that ends every step still compares a fingerprint of each group's collectives
    (paratron/parallel/collcheck.py). Needs the hang watchdog's flight recorder
    (parallel.hang_timeout_s > 0)."""


@dataclass
class TrainConfig:
    train_iters: int = 200
    """Optimizer steps to train for."""
    seed: int = 1234
    """Seed of the init, the data order and dropout."""
    micro_batch_size: int = 4
    """Samples per microbatch on one DP rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all DP ranks (microbatch x DP x microbatches)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision; bf16 and fp16 keep fp32 main weights and grads (fp16 with loss scaling)."""
    deterministic: bool = False
    """Bitwise-repeatable CPU fp32 runs."""
    keep_host_memory: bool = True
    """On a CPU device, let glibc keep freed heap memory mapped for reuse (mmap threshold 32 MiB,
    no trimming), so each step reuses the last step's pages instead of faulting fresh ones in
    (on the main job's layout-(1) step, with another process sharing the cores: 2-9 thousand page
    faults and up to 15 ms of system time a step; docs/ARCHITECTURE.md). The process keeps its
    peak heap. False keeps glibc's defaults."""
    elastic_relayout: bool = False
    """Take re-layout requests (``paratron resize``, a callback's ``state.request_relayout``) at
    each step boundary: one host all-reduce per step more (docs/elastic.md). Off, none is taken."""
    failslow_relayout: bool = False
    """Greyhound level 3 for the fail-slow plugin (``paratron.plugins.failslow:FailSlow`` in
    ``train.callbacks``): apply its proposed ``parallel.pipeline_layout`` online when a ski-rental
    budget says it pays (needs ``train.elastic_relayout``; docs/elastic.md)."""
    failslow_relayout_cost_s: Optional[float] = None
    """Seconds one online re-layout is taken to cost until one is measured (then the measured
    one); None: twice the measured step time."""
    failslow_restart: bool = False
    """Greyhound level 4: after a level-3 re-layout, when the slow rank keeps costing more than a
    restart, save and exit with code 75 for ``paratron train --auto-restart N`` (needs
    ``train.failslow_relayout``; saves to ``checkpoint.save``, by default ``RUN_DIR/checkpoints``)."""
    failslow_restart_cost_s: float = 120.0
    """Seconds a checkpoint, exit and restart are taken to cost (level 4's budget)."""
    elastic_spares: int = 0
    """Launched processes that stand by outside the training world (the last ranks of the launch)
    until a pipeline grow calls them in (``paratron resize --pipeline``, docs/elastic.md); the
    parallel layout is that of the other ranks. Needs ``train.elastic_relayout``."""
    replace_dead_ranks: bool = False
    """``paratron train --nproc-per-node N`` (one node): paratron's launcher starts the ranks itself
    and serves their store; when a rank dies, with a DP replica of its state (DP >= 2,
    ``parallel.zero = 0``), a replacement takes its rank and the survivors keep training, else
    every rank restarts from the last checkpoint (docs/elastic.md, "Replacing a dead rank")."""
    eval_interval: int = 50
    """Evaluate every this many steps and after the last; 0 only after the last."""
    eval_iters: int = 4
    """Global batches of the validation split per evaluation."""
    callbacks: list[str] = field(default_factory=list)
    """Import paths ``module:Class`` of training-loop callbacks (plugins)."""
    peak_flops_per_device: Optional[float] = None
    """Peak FLOP/s of one device for MFU; None looks it up (GPU) or measures it (CPU)."""
    sample_prompt: Optional[str] = "auto"
    """The prompt rank 0 continues in the text sample printed after training (from the checkpoint
    saved at the last step; where none was saved, from the in-memory model of a one-process run):
    "auto" takes the start of a validation document; none (or an empty string) prints no sample."""
    sample_tokens: int = 64
    """Tokens of the text sample printed after training (``sample_prompt``)."""
    export_hf_at_end: bool = False
    """After the last step, write the model as a Hugging Face folder (``checkpoint.save_hf``, else
    ``RUN_DIR/hf``) from the final checkpoint, and print whether paratron and ``transformers``
    agree on a few greedy tokens (needs ``checkpoint.save``; ``--save-hf DIR`` sets both keys)."""
    nonfinite: Literal["skip", "stop"] = "skip"
    """A step whose loss or grads hold an inf or NaN (decided globally) changes nothing; "skip"
    goes on with the next batch, "stop" ends the run with an error naming the step."""
    max_consecutive_skips: int = 5
    """Under ``nonfinite = "skip"``, stop after this many non-finite steps in a row."""
    profile_steps: list[int] = field(default_factory=list)
    """``[start, end]``: run ``torch.profiler`` from the start of step ``start`` to the end of step
    ``end`` (1-based iterations, both included) and write one Chrome trace per rank to
    ``RUN_DIR/profile/rank_N.json``, with ranges named by paratron's actions (``F mb3 stage1``),
    DP bucket reductions and MoE all-to-alls. Empty: no profiler (Megatron's
    ``--profile-step-start/--profile-step-end``, ``--use-pytorch-profiler``)."""
    profile_ranks: list[int] = field(default_factory=list)
    """Global ranks that run the profiler of ``profile_steps``; empty: every rank
    (Megatron's ``--profile-ranks``)."""
    memory_snapshot_steps: list[int] = field(default_factory=list)
    """Steps after which each rank writes its memory: on a GPU ``torch.cuda.memory._snapshot()``
    (``RUN_DIR/memory/rank_N_step_S.pickle``, for pytorch.org/memory_viz; allocation history is
    recorded from the start), on CPU an inventory of live tensors by device, dtype and shape
    (``rank_N_step_S.json``)."""
    timeline_steps: list[int] = field(default_factory=list)
    """Steps whose measured timeline (every pipeline action's start and end per rank, the intervals
    recorded inside them: MoE all-to-alls and expert compute; DP bucket reductions) rank 0 writes
    as Chrome trace-event JSON to ``RUN_DIR/timeline/step_N.json``, one track per global rank
    (``paratron simulate --trace`` writes the planned one in the same format)."""
    wandb_project: Optional[str] = None
    """Weights & Biases project: rank 0 logs the records it writes to TensorBoard, with the config
    (needs ``pip install 'paratron[wandb]'``; ``WANDB_MODE=offline`` writes locally). None: off
    (Megatron's ``--wandb-project``)."""
    wandb_exp_name: Optional[str] = None
    """The Weights & Biases run name; None: wandb picks one (Megatron's ``--wandb-exp-name``)."""
    fp8: Optional[Literal["tensorwise", "rowwise"]] = None
    """FP8 matmuls in the column/row-parallel linears (paratron/layers/fp8.py): dynamic scales, one
    per tensor ("tensorwise") or one per row along the contraction dim ("rowwise"), from amaxes
    reduced over every group that splits them, so every layout casts the same values. The
    embedding, output head, router, norms and MoE experts stay in ``precision``. None: off, unless
    ``fp8_format`` is set (then "tensorwise"). Not with ``parallel.context > 1``. Megatron's
    ``--fp8-recipe``."""
    fp8_format: Optional[Literal["e4m3", "hybrid"]] = None
    """FP8 formats: "e4m3" everywhere, or "hybrid" (e4m3 activations and weights, e5m2 grads; the
    default when FP8 is on). Setting it turns FP8 on. Megatron's ``--fp8-format``."""
    fp8_param_gather: bool = False
    """Under ``parallel.zero = 3``, all-gather the FP8 linears' weights as FP8 (one byte an
    element, with a scale reduced over DP and TP) instead of in ``precision``. Tensorwise only."""


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "sgd", "muon"] = "adamw"
    """AdamW, SGD (with ``sgd_momentum``), or ``muon``: Muon for the 2-D hidden weights, AdamW (the
    ``adam_*`` fields) for embeddings, the output head, norms and biases (:mod:`paratron.optim.muon`)."""
    lr: float = 3e-4
    """Peak learning rate, reached after the warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay; norms and biases get none."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's epsilon in the denominator."""
    sgd_momentum: float = 0.0
    """SGD momentum; 0 means plain SGD (no momentum buffer)."""
    clip_grad: float = 1.0
    """Max global grad norm; 0 disables clipping."""
    lr_decay_style: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Decay after the warmup: cosine, linear, constant, or warmup-stable-decay (wsd)."""
    lr_warmup_iters: int = 0
    """Steps of linear warmup from 0 to lr."""
    lr_decay_iters: Optional[int] = None
    """None means train.train_iters."""
    lr_wsd_decay_iters: Optional[int] = None
    """Length of WSD's final decay; None means 10% of lr_decay_iters."""
    initial_loss_scale: float = 65536.0
    """fp16: the loss scale of the first step."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never drops below this."""
    loss_scale_window: int = 1000
    """fp16: clean steps in a row before the loss scale doubles."""
    hysteresis: int = 2
    """fp16: overflowing steps before the loss scale halves (each one is skipped)."""
    adam_impl: Literal["auto", "fused", "foreach"] = "auto"
    """AdamW kernels on the flat fp32 buffers: ``fused`` (``torch._fused_adamw_``, one kernel per
    group of views), ``foreach`` (``torch._foreach_*``); ``auto`` is fused (on CUDA and CPU) where
    the state allows it (fp32 moments, not offloaded), else foreach."""
    muon_momentum: float = 0.95
    """Muon's momentum EMA coefficient."""
    muon_use_nesterov: bool = True
    """Nesterov momentum: the update orthogonalises ``lerp(grad, momentum, muon_momentum)``."""
    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations."""
    muon_scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    """The shape-based scale of the orthogonalised update (Megatron-Core's names)."""
    muon_extra_scale_factor: float = 0.2
    """Times the scale: 0.2 with ``spectral`` matches AdamW's update RMS (Moonshot's Muon), so
    ``lr`` and ``weight_decay`` tuned for AdamW carry over."""
    muon_split_qkv: bool = True
    """Orthogonalise Q, K and V of the fused QKV weight separately."""
    exp_avg_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage of AdamW's first moment (and Muon's or SGD's momentum); bf16 halves it, the step's
    arithmetic stays fp32 (Megatron's precision-aware optimizer)."""
    exp_avg_sq_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage of AdamW's second moment."""
    cpu_offload: bool = False
    """Keep the fp32 main weights and optimizer state in host memory and step them there
    (:mod:`paratron.optim.offload`; AdamW and SGD)."""
    offload_fraction: float = 1.0
    """The share of this rank's optimizer state that ``cpu_offload`` moves to the host."""


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)
    """Indexed-dataset prefixes, optionally weighted Megatron-style: ["0.7", "a", "0.3", "b"]."""
    corpus: Optional[str] = None
    """A JSONL or text corpus preprocessed into data_path on first use."""
    json_key: str = "text"
    """Key of the text in each JSONL line of data.corpus."""
    tokenizer_type: Literal["GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelBPE"] = "GPT2BPETokenizer"
    """GPT-2's BPE (vocab_file, merge_file), a tokenizer.json, or a byte-level BPE trained on data.corpus."""
    vocab_file: Optional[str] = None
    """GPT-2 vocab.json; None means the bundled one."""
    merge_file: Optional[str] = None
    """GPT-2 merges.txt; None means the bundled one."""
    tokenizer_model: Optional[str] = None
    """A tokenizer.json (HuggingFaceTokenizer)."""
    tokenizer_vocab_size: int = 8192
    """Vocab size when training a byte-level BPE on the corpus."""
    split: str = "969,30,1"
    """Train, validation and test weights of the documents, Megatron-style ("969,30,1")."""
    num_workers: int = 1
    """Preprocessing worker processes."""
    cache_dir: Optional[str] = None
    """Where sample-index files go; None means next to the data."""
    reset_position_ids: bool = False
    """Positions restart after each end-of-document token (Megatron's --reset-position-ids)."""
    reset_attention_mask: bool = False
    """No attention across end-of-document tokens: block-diagonal causal attention over the packed
    documents (Megatron's --reset-attention-mask)."""
    eod_mask_loss: bool = False
    """No loss where the input token is the end-of-document token (Megatron's --eod-mask-loss)."""
    microbatch_tokens: Optional[int] = None
    """Token-balanced variable-length microbatches (FlexPipe): each microbatch is one packed row of
    whole documents holding at most this many positions, and ``train.global_batch_size`` counts
    documents (``train.micro_batch_size`` is unused). Documents longer than ``model.seq_length``
    positions are split. Rule and layout: :mod:`paratron.data.token_batches`. None: fixed-length
    samples."""
    format: Literal["text", "chat"] = "text"
    """``"chat"``: SFT records (``{"messages": [{"role", "content"}, ...]}`` or prompt/completion
    pairs) rendered with a chat template, the loss on the assistant's tokens only
    (:mod:`paratron.data.chat`; Megatron's ``--sft``). Read from ``data.corpus`` (a JSONL file) or
    ``data.hf_dataset``."""
    chat_template: Optional[str] = None
    """A built-in template name (``"simple"``, ``"chatml"``) or a ``.jinja`` file; None: the
    tokenizer's own beside ``data.tokenizer_model``, else ``"simple"``."""
    messages_key: str = "messages"
    """The field of a chat record that holds its messages."""
    hf_dataset: Optional[str] = None
    """A Hugging Face ``datasets`` input: a local Parquet / Arrow / JSON(L) file or folder, a
    ``save_to_disk`` folder, or a dataset name (:mod:`paratron.data.hf_datasets`). Text records
    use ``data.text_key`` (= ``data.json_key``)."""
    hf_split: str = "train"
    """The split of ``data.hf_dataset`` to train on (``data.split`` still cuts it into train and
    validation rows when not streaming)."""
    streaming: bool = False
    """Read ``data.hf_dataset`` lazily, in order, as an ``IterableDataset`` (no validation split)."""


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to save checkpoints into."""
    load: Optional[str] = None
    """Directory to resume from (its ``latest``, or load_step)."""
    load_step: Optional[int] = None
    """Step to resume from under checkpoint.load; None means its latest."""
    interval: int = 0
    """Save every N iterations (0: only at the end)."""
    keep_last: int = 3
    """Checkpoints kept in checkpoint.save; older ones are deleted."""
    async_save: bool = False
    """Write checkpoints in a background thread while training goes on."""
    load_optimizer: bool = True
    """Also restore the optimizer state on load; false starts a fresh optimizer."""
    finetune: bool = False
    """Load only the model weights of ``checkpoint.load`` and start a new run from them: step 0,
    no samples consumed, a fresh optimizer, LR schedule and RNG (Megatron's ``--finetune``)."""
    load_hf: Optional[str] = None
    """A Hugging Face folder (``config.json``, safetensors, ``tokenizer.json``) to start from: the
    model config and the tokenizer come from it, and each rank reads only its own slices of the
    weights (``paratron train --from-hf DIR``). A checkpoint in ``checkpoint.load`` wins (resume)."""
    save_hf: Optional[str] = None
    """Where ``train.export_hf_at_end`` writes the Hugging Face folder (default ``RUN_DIR/hf``)."""
    save_peft: Optional[str] = None
    """LoRA runs: with ``train.export_hf_at_end``, also write the adapters as a ``peft`` folder here
    (``adapter_model.safetensors``, ``adapter_config.json``) and the frozen base as a Hugging Face
    folder in its ``base/``, which ``adapter_config.json`` names (``paratron train --save-peft DIR``)."""
    pretrained_checkpoint: Optional[str] = None
    """LoRA (``model.lora_rank > 0``): a paratron checkpoint whose model weights fill the frozen
    base before ``checkpoint.load`` (an adapter-only checkpoint of the run) is loaded; its own
    optimizer state, step and adapters are ignored (Megatron-Bridge's name)."""


@dataclass
class LoggingConfig:
    log_interval: int = 10
    """Print the step line every this many steps (and at step 1)."""
    tensorboard: bool = True
    """Write TensorBoard events to RUN_DIR/tensorboard/."""
    progress: bool = True
    """Show a progress bar (on a terminal, not in a log) while the corpus is tokenised on first use."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the model and batch are split over ranks."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop: steps, batch, precision, evaluation."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer, learning-rate schedule and loss scaling."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets, corpus and tokenizer."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console, TensorBoard and progress output."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}

KEY_ALIASES: dict[str, str] = {
    "model.moe_router_score_function": "model.moe_router_score",
    "model.moe_router_topk": "model.moe_top_k",
    "model.moe_shared_expert_intermediate_size": "model.moe_shared_expert_ffn_hidden_size",
    "data.text_key": "data.json_key",
    "parallel.cp_comm_type": "parallel.context_algorithm",
}
"""Megatron-Core's ``TransformerConfig`` names of fields paratron spells otherwise: a config file
or ``--set`` may use either."""

VALUE_ALIASES: dict[str, dict[str, str]] = {
    # Megatron-Core's cp_comm_type: "p2p" is the ring of KV exchanges, "a2a" Ulysses' all-to-all.
    "parallel.context_algorithm": {"p2p": "ring", "a2a": "all2all"},
}
"""Megatron-Core's spellings of a field's values, by the paratron key they are given for."""
