"""Device profiles: what one rank computes per second and how fast its groups talk.

A profile is a plain record: peak matmul throughput per dtype, memory bandwidth, per-op launch
overhead, and an alpha-beta model (latency ``alpha`` seconds per collective step, bandwidth ``beta``
bytes/s per rank) inside a node and across nodes. Numbers for clusters come from vendor datasheets;
``cpu-gloo`` was measured on this 2-core machine (see ``probe``). Planning for a cluster means
naming its profile: ``ComputeConfig(plan_ngpus=32, profile="h100")``.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field


class ProfileError(ValueError):
    """A device profile that does not exist."""


@dataclass(frozen=True)
class ClusterConstants:
    """What the cluster cost model (:mod:`nnscaler.cluster.cost`) needs beyond the datasheet: peak
    dense throughput and the constants fitted against published runs (``bench/calibration/calibrate.py --fit``).

    A GEMM of ``m x k`` by ``k x n`` runs at ``matmul_max * I / (I + matmul_half)`` of ``peak``, where
    ``I = 1 / (1/m + 1/n + 1/k)`` is its arithmetic intensity in FLOP per byte of bf16 operands (a
    smoothed roofline: small or skinny GEMMs are bound by memory, large ones saturate at
    ``matmul_max``); fused attention runs at ``attention * F / (F + attention_half)`` of peak (half its scores skipped
    when causal), ``F`` the full-score forward FLOPs of one call on one rank (batch x heads x queries x keys x head
    dim x 4): short sequences and few heads per rank leave the kernel's tiles underfilled (measured H100 flash
    attention: 0.15 of peak at 4,096 tokens and 4 heads, 0.45 at 8,192 and 16; ``attention_half`` 0: a constant).
    Memory-bound operators move ``fusion`` times the bytes their inputs and outputs hold at the compute
    dtype: eager PyTorch (the code nnscaler emits) upcasts norms to fp32 and runs one kernel per operator;
    ``fusion_fused`` is the same for stacks with fused kernels (Megatron-LM, Llama 3's), used only to hold
    the model against published runs of such stacks.
    ``score_passes``: passes over an attention's score matrix (batch x heads x queries x keys, at the compute
    dtype) that go through device memory per forward; 0 for flash attention (what SDPA runs, and the code nnscaler
    emits); ``score_passes_materialized`` is the fitted value for stacks that write the scores (Megatron-LM 2021:
    a batched GEMM, a fused scale-mask-softmax, dropout, a second GEMM), used only for published runs of such stacks.
    ``tp_exposed``: the part of tensor-parallel collectives not hidden behind compute; ``dp_overlap``: the
    part of a micro-batch's backward that hides data-parallel collectives; ``zero3_overlap``: the part of
    ZeRO-3's (FSDP's) parameter gathers and reduce-scatters its prefetch hides behind compute (at most the step's
    compute) when its group stays inside a node (NVLink copies run by the SMs, competing with the GEMMs),
    ``zero3_overlap_across`` when the group leaves it (NIC-driven transfers; None: the same); ``pp_exposed``: the same for
    pipeline sends; ``usable``: the part of device memory plans may fill (allocator, NCCL, CUDA context).
    ``weight_casts``: bf16-mixed keeps, per micro-batch in flight, the bf16 copy autocast casts of each fp32 weight
    for its backward (what the code nnscaler emits does); False for stacks that compute with bf16 parameters
    (Megatron-LM's bf16 weights beside fp32 main weights, FSDP's bf16 gathers), used only for published runs.
    ``sac_alternate_linears``: what ``selective`` recompute recomputes. False (nnscaler's, Megatron-LM's): the
    attention core. True (torchtitan's per-op selective AC, used only for its published runs): every second linear of
    a block in execution order and every memory-bound operator, the attention kernel's output saved.
    ``tp_comm_overlap``: the stack pipelines its sequence-parallel all-gathers and reduce-scatters with the GEMMs in tp
    chunks (Megatron-Core's ``--tp-comm-overlap``, Transformer Engine userbuffers): one chunk of tp stays exposed, so
    ``tp_exposed`` counts 1/tp of them (counted, not fitted: no other source ran it). The code nnscaler emits does not
    overlap them, so plans never set it; used only for published runs that state it.
    ``overlap_slowdown``: a data-parallel collective hidden behind compute (ZeRO 0-2: ``dp_overlap``) is not free;
    the compute it overlaps runs slower (its kernels share the SMs and the memory bandwidth with the collective's), by
    this part of the hidden time. Counted, not fitted: 0.189, the mean compute slowdown measured under overlapped
    collectives on H100, A100, MI250 and MI210 with GPT and Llama models ("Characterizing Compute-Communication
    Overlap in GPU-Accelerated Distributed Deep Learning: Performance and Power Implications", arXiv:2507.03114, 2025:
    18.9% on average, 40.0% at most, against the same compute with no communication beside it). ZeRO-3's
    ``zero3_overlap`` and ``tp_exposed`` are fitted totals that already hold it.
    """

    peak: float  # dense bf16 FLOP/s, datasheet
    matmul_max: float
    matmul_half: float
    attention: float
    fusion: float
    tp_exposed: float
    dp_overlap: float
    fusion_fused: float = 1.0  # ``fusion`` of a stack with fused kernels (calibration rows that ran one)
    attention_half: float = 0.0  # full-score forward FLOPs of one attention call at half ``attention`` (0: constant)
    score_passes: float = 0.0  # attention score passes through memory per forward (0: flash attention)
    score_passes_materialized: float = 0.0  # ``score_passes`` of a stack that writes the scores (calibration rows)
    sp_comm: float = 1.0  # sequence-parallel tp collectives vs the all-reduces they replace (gloo: no reduce-scatter)
    zero3_overlap: float = 0.3
    zero3_overlap_across: float | None = None  # ``zero3_overlap`` of a ZeRO-3 group that leaves its node (None: same)
    pp_exposed: float = 0.5
    usable: float = 0.9
    weight_casts: bool = True  # bf16-mixed saves autocast's bf16 weight copies per micro-batch (calibration rows: off)
    sac_alternate_linears: bool = False  # selective recompute as torchtitan's per-op AC (its calibration rows)
    tp_comm_overlap: bool = False  # sequence-parallel tp collectives pipelined with the GEMMs (Megatron-Core's rows)
    overlap_slowdown: float = 0.0  # compute slowed while a hidden data-parallel collective runs beside it
    fitted: str = ""

    def attention_efficiency(self, flops: float) -> float:
        """The fraction of peak an attention call of ``flops`` full-score forward FLOPs runs at."""
        return self.attention * flops / (flops + self.attention_half) if self.attention_half else self.attention

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """Fraction of ``peak`` a GEMM of these dims reaches (see the class docstring)."""
        if min(m, n, k) <= 0:
            return self.matmul_max
        intensity = 1.0 / (1.0 / m + 1.0 / n + 1.0 / k)
        return self.matmul_max * intensity / (intensity + self.matmul_half)


@dataclass(frozen=True)
class DeviceProfile:
    """Throughput and links of one kind of device. ``flops`` maps a dtype name to achievable
    multiply-add throughput (FLOP/s, already scaled by a realistic efficiency); ``cores`` (CPU
    only) caps how many ranks of one node compute at full speed."""

    name: str
    flops: dict[str, float]
    mem_bw: float  # bytes/s, achievable
    op_overhead: float  # seconds per operator launch
    intra_alpha: float  # seconds per collective step inside a node
    intra_beta: float  # bytes/s per rank inside a node (bus bandwidth)
    inter_alpha: float
    inter_beta: float  # bytes/s per rank across nodes
    ranks_per_node: int
    memory: int  # bytes of device memory
    cores: int | None = None
    source: str = field(default="", compare=False)
    cluster: ClusterConstants | None = field(default=None, compare=False)

    def share(self, ranks_here: int) -> float:
        """The fraction of a device one rank gets when ``ranks_here`` ranks share a node (an
        oversubscribed CPU: ranks take turns on its cores)."""
        return min(1.0, self.cores / ranks_here) if self.cores is not None and ranks_here > 0 else 1.0

    def throughput(self, dtype: str, ranks_here: int) -> float:
        """FLOP/s one rank gets when ``ranks_here`` ranks share its node."""
        return self.flops.get(dtype, self.flops["float32"]) * self.share(ranks_here)

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """(alpha, beta) of a group inside one node or across nodes."""
        return (self.inter_alpha, self.inter_beta) if spans_nodes else (self.intra_alpha, self.intra_beta)


_GIB = 2**30
MFU = 0.5  # fraction of peak matmul throughput large training runs achieve (Megatron-LM reports 40-55%)
OVERLAP_SLOWDOWN = 0.189  # ClusterConstants.overlap_slowdown on GPUs (arXiv:2507.03114's mean; counted, not fitted)
BUS = 0.8  # fraction of link bandwidth NCCL's ring collectives reach (nccl-tests busbw)

# Fitted by ``python bench/calibration/calibrate.py --holdout`` (its "fitted on every row" line) against the 41 rows of
# nnscaler/cluster/published_runs.csv (Megatron-LM SC'21 Table 1 on 32-3,072 A100; Megatron-Core r0.8.0 on 48-6,144
# H100; Llama 3 405B on 8k/16k H100 and its 128k stage; torchtitan Llama 2/3 on 64 A100 and 8-256 H100; MosaicML MPT
# 7B/13B on 8 A100): a grid over the A100 matmul_max, the H100 GEMM curve (the first fit's 0.9 / 60, or the one fitted
# to bench/results/h100_kernels.csv with its attention curve, 0.482 of peak at half for 64 GFLOP calls: chosen),
# attention, fusion, fusion_fused, dp_overlap, the part of ZeRO-3's traffic its prefetch hides inside a node (0.1) and
# across nodes (0.5), and tp_exposed, minimising the mean, then the worst |log(estimate / published step time)|;
# score_passes_materialized (6) and overlap_slowdown (0.189) counted, not fitted. Held out (leave one source out): median
# 5.9%, 41/41 rows within 15%, worst 13.2% (bench/results/calibrate_holdout.md).
_FIT = ("fitted by bench/calibration/calibrate.py --holdout against nnscaler/cluster/published_runs.csv (grid on matmul_max, "
        "attention, fusion, fusion_fused, dp_overlap, zero3_overlap inside / across nodes, tp_exposed; H100 GEMM curve "
        "from measured kernels)")
CALIBRATED = {
    "a100": ClusterConstants(peak=312e12, matmul_max=0.90, matmul_half=60.0, attention=0.40, fusion=3.0,
                             tp_exposed=1.0, dp_overlap=0.9, zero3_overlap=0.1, zero3_overlap_across=0.5,
                             fusion_fused=2.0, overlap_slowdown=OVERLAP_SLOWDOWN,
                             score_passes_materialized=6.0, fitted=_FIT),
    "h100": ClusterConstants(peak=989.4e12, matmul_max=0.766, matmul_half=140.4, attention=0.482,
                             attention_half=64e9, fusion=3.0,
                             tp_exposed=1.0, dp_overlap=0.9, zero3_overlap=0.1, zero3_overlap_across=0.5,
                             fusion_fused=2.0, overlap_slowdown=OVERLAP_SLOWDOWN,
                             score_passes_materialized=6.0, fitted=_FIT),
}

# This machine (one fp32 thread per rank, gloo over 127.0.0.1), fitted by a grid search on bench/calibration/calibrate.py's
# cpu-gloo table (estimated vs measured step time of 14 configurations on real gloo ranks, maximising the Spearman
# rank correlation; latency and launch overhead held at the profile's measured alpha and op_overhead; results in
# bench/results/calibrate.md): GEMMs reach 40 GFLOP/s when large (matmul_half 30), gloo collectives block the rank
# (tp_exposed 1, no data-parallel overlap, pipeline sends exposed), and sequence parallelism's collectives cost 6
# all-reduces (gloo has no reduce-scatter: an all-to-all and a local sum, plus the layout conversions around the
# norms it splits). Ranks beyond the cores share them (``DeviceProfile.share``).
CPU_GLOO = ClusterConstants(peak=40e9, matmul_max=1.0, matmul_half=30.0, attention=0.3, fusion=2.0, tp_exposed=1.0,
                            dp_overlap=0.0, zero3_overlap=0.0, pp_exposed=1.0, sp_comm=6.0,
                            fitted="grid search against bench/calibration/calibrate.py's cpu-gloo table (Spearman, in-sample)")

PROFILES: dict[str, DeviceProfile] = {
    "cpu-gloo": DeviceProfile(
        "cpu-gloo", {"float32": 20e9, "float64": 10e9, "bfloat16": 5e9, "float16": 5e9}, mem_bw=4e9,
        op_overhead=20e-6, intra_alpha=300e-6, intra_beta=0.7e9, inter_alpha=300e-6, inter_beta=0.7e9,
        ranks_per_node=1 << 20, memory=24 * _GIB, cores=os.cpu_count() or 1, cluster=CPU_GLOO,
        source="measured here (torch 2.13 CPU, 1 thread per rank): 512^3 fp32 matmul ~22 GFLOP/s; gloo "
               "all-reduce on 127.0.0.1 at W=2: 64 KiB ~0.26 ms, 4 MiB ~6.3 ms (alpha ~0.3 ms, ~0.7 GB/s)"),
    "a100": DeviceProfile(
        "a100", {"float32": MFU * 156e12, "bfloat16": MFU * 312e12, "float16": MFU * 312e12, "float64": MFU * 19.5e12},
        mem_bw=0.8 * 2039e9, op_overhead=5e-6, intra_alpha=10e-6, intra_beta=BUS * 300e9, inter_alpha=20e-6,
        inter_beta=BUS * 25e9, ranks_per_node=8, memory=80 * _GIB, cluster=CALIBRATED["a100"],
        source="NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, 156 TF32, 2039 GB/s HBM2e, NVLink3 600 GB/s "
               "(300 GB/s each way); DGX A100: 8 GPUs per node, one 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s)"),
    "h100": DeviceProfile(
        "h100", {"float32": MFU * 494.7e12, "bfloat16": MFU * 989.4e12, "float16": MFU * 989.4e12, "float64": MFU * 67e12},
        mem_bw=0.8 * 3350e9, op_overhead=4e-6, intra_alpha=8e-6, intra_beta=BUS * 450e9, inter_alpha=15e-6,
        inter_beta=BUS * 50e9, ranks_per_node=8, memory=80 * _GIB, cluster=CALIBRATED["h100"],
        source="NVIDIA H100 SXM5 datasheet: 989 TFLOPS bf16 dense, 495 TF32, 3.35 TB/s HBM3, NVLink4 900 GB/s "
               "(450 GB/s each way); DGX H100: 8 GPUs per node, one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s)"),
}


def get_profile(name: str | DeviceProfile | None) -> DeviceProfile:
    """The named profile (``None``: ``cpu-gloo``); an unknown name is a :class:`ProfileError`
    naming the closest one."""
    if isinstance(name, DeviceProfile):
        return name
    if name is None:
        return PROFILES["cpu-gloo"]
    if name not in PROFILES:
        close = difflib.get_close_matches(name, PROFILES, n=1, cutoff=0.0)
        raise ProfileError(f"unknown device profile {name!r}; known: {', '.join(sorted(PROFILES))}"
                           + (f" (closest: {close[0]!r})" if close else ""))
    return PROFILES[name]
