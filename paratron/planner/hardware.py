"""Devices and links the planner costs against: peak rate, GEMM efficiency, memory bandwidth and
size, link bandwidth and latency.

Sources (vendor data sheets; bandwidths are per GPU and per direction):

* A100 SXM4 80GB (NVIDIA A100 data sheet): 312 TFLOP/s dense bf16, HBM2e 2,039 GB/s, 80 GB;
  NVLink 3 600 GB/s total = 300 GB/s per direction. DGX A100 / Selene: 8 x 200 Gb/s HDR
  InfiniBand per 8-GPU node = 25 GB/s per GPU (Narayanan et al. 2021, section 5).
* H100 SXM5 80GB (NVIDIA H100 data sheet): 989 TFLOP/s dense bf16, HBM3 3.35 TB/s; NVLink 4 900 GB/s
  = 450 GB/s per direction. DGX H100: 8 x 400 Gb/s NDR = 50 GB/s per GPU.
* H200 SXM 141GB (NVIDIA H200 data sheet): as H100 with HBM3e 4.8 TB/s and 141 GB.
* Latencies: about 5 us per NVLink collective step and 10 us across InfiniBand (NCCL's order of
  magnitude; the planner only needs them for small messages).

``gemm_efficiency`` is the fraction of peak a large, tile-aligned GEMM sustains inside training (see
:mod:`.compute`); it is the one efficiency parameter per GPU, set as described in
``docs/planner.md`` (A100: 0.76, chosen once against the whole of Megatron SC21 table 1, not per
row; H100/H200 take the same value, an assumption). The peak rates come from the MFU table of
:mod:`paratron.training.metrics`, so the planner's MFU and the training log's agree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratron.training.metrics import GPU_PEAK_BF16

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One device type.

    Attributes:
        name: ``a100``, ``h100``, ``h200`` or ``cpu``.
        peak_flops: dense peak FLOP/s of one device (bf16 on GPUs; fp32 per rank on CPU, measured).
        gemm_efficiency: fraction of ``peak_flops`` a large aligned GEMM reaches in training.
        mem_bandwidth: bytes/s of device memory (bounds the elementwise ops and small GEMMs).
        memory_bytes: device memory per rank.
        intra_bw / inter_bw: bytes/s per device and direction inside a node / across nodes.
        intra_latency / inter_latency: seconds per collective step.
        op_overhead: seconds of fixed cost per kernel (launch on GPU; dispatch and autograd on CPU).
        tile: GEMM tile ``(m, n, k)``; dimensions are rounded up to it (tile quantisation).
        act_bytes: bytes per activation element (2: bf16 on GPU; 4: fp32 on CPU).
        precision: the ``train.precision`` a plan for this device uses.
        sharing: how much faster one rank computes while the others idle than while all compute
            (ranks sharing cores: measured on CPU; 1 on GPUs, one device per rank).
    """

    name: str
    peak_flops: float
    gemm_efficiency: float
    mem_bandwidth: float
    memory_bytes: float
    intra_bw: float
    inter_bw: float
    intra_latency: float
    inter_latency: float
    op_overhead: float
    tile: tuple[int, int, int]
    act_bytes: int
    precision: str
    sharing: float = 1.0


A100_GEMM_EFFICIENCY = 0.76
"""Chosen once for the A100 against all rows of Megatron SC21 table 1 (docs/planner.md)."""

GPUS: dict[str, Hardware] = {
    "a100": Hardware("a100", GPU_PEAK_BF16["A100"], A100_GEMM_EFFICIENCY, 2039 * GB, 80 * GB, 300 * GB, 25 * GB,
                     5e-6, 10e-6, 3e-6, (128, 128, 64), 2, "bf16"),
    "h100": Hardware("h100", GPU_PEAK_BF16["H100"], A100_GEMM_EFFICIENCY, 3350 * GB, 80 * GB, 450 * GB, 50 * GB,
                     5e-6, 10e-6, 3e-6, (128, 128, 64), 2, "bf16"),
    "h200": Hardware("h200", GPU_PEAK_BF16["H200"], A100_GEMM_EFFICIENCY, 4800 * GB, 141 * GB, 450 * GB, 50 * GB,
                     5e-6, 10e-6, 3e-6, (128, 128, 64), 2, "bf16"),
}
DEVICE_TYPES = (*GPUS, "cpu")


def cpu_hardware(cal: dict, memory_bytes: float) -> Hardware:
    """The CPU as one rank sees it, from a calibration (:mod:`.calibrate`): keys ``gemm_flops``,
    ``mem_bandwidth``, ``op_overhead``, ``gloo_bandwidth``, ``gloo_latency`` (all measured with the
    calibrated number of ranks running at once, so they already hold each rank's share of the cores),
    and ``nproc`` and ``cores``, whose ratio (at least 1) is ``sharing``.
    """
    return Hardware("cpu", cal["gemm_flops"], 1.0, cal["mem_bandwidth"], memory_bytes, cal["gloo_bandwidth"],
                    cal["gloo_bandwidth"], cal["gloo_latency"], cal["gloo_latency"], cal["op_overhead"],
                    (1, 1, 1), 4, "fp32", max(1.0, cal.get("nproc", 1) / cal.get("cores", cal.get("nproc", 1))))


def device(name: str, *, memory_gb: float | None = None, intra_bw_gbs: float | None = None,
           inter_bw_gbs: float | None = None, calibration: dict | None = None) -> Hardware:
    """The :class:`Hardware` for ``--gpu NAME`` with the command line's overrides (GB = 1e9 bytes).

    Raises:
        ValueError: an unknown device name (the message lists the known ones), or ``cpu`` without a
            calibration.
    """
    if name not in DEVICE_TYPES:
        raise ValueError(f"--gpu={name!r} is not a known device type; choose one of {', '.join(DEVICE_TYPES)}")
    if name == "cpu":
        if calibration is None:
            raise ValueError("--gpu=cpu needs a calibration: run `paratron plan --calibrate` first")
        hw = cpu_hardware(calibration, (memory_gb or 8.0) * GB)
    else:
        hw = GPUS[name]
    changes = {}
    if memory_gb is not None:
        changes["memory_bytes"] = memory_gb * GB
    if intra_bw_gbs is not None:
        changes["intra_bw"] = intra_bw_gbs * GB
    if inter_bw_gbs is not None:
        changes["inter_bw"] = inter_bw_gbs * GB
    return replace(hw, **changes)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` devices of one type."""

    nodes: int
    gpus_per_node: int
    hw: Hardware

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def link(self, size: int, stride: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a group of ``size`` ranks ``stride`` apart in rank order:
        inside a node when the group's span fits in one node, else across nodes."""
        if size * stride <= self.gpus_per_node:
            return self.hw.intra_bw, self.hw.intra_latency
        return self.hw.inter_bw, self.hw.inter_latency
