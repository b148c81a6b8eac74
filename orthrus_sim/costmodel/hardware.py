"""Hardware catalogue: the figures a roofline needs, each from its public spec sheet."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
MB = 1024**2  # cache sizes are binary megabytes
GIB = 1024**3
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU socket share).

    peak_flops: dense bf16 FLOP/s (no sparsity); mem_bw: bytes/s; mem_capacity: bytes;
    interconnect_bw: bytes/s one GPU can send to another (KV transfer in disaggregated serving);
    cache_bytes: the last-level (L2) cache, where a repeated kernel's small working set stays
    (``OpCoeffs.cache_gain``; 0: none modelled).
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_capacity: float
    interconnect_bw: float
    source: str = ""
    cache_bytes: float = 0.0


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        # NVIDIA A100 Tensor Core GPU datasheet (2021): SXM4 40GB: BF16 312 TFLOPS dense,
        # 1,555 GB/s HBM2, NVLink 600 GB/s; L2 40 MB (NVIDIA Ampere architecture whitepaper).
        Hardware("a100-40gb", 312 * TFLOPS, 1555 * GB, 40 * GB, 600 * GB,
                 "NVIDIA A100 datasheet, SXM4 40GB", 40 * MB),
        # Same datasheet, SXM4 80GB: 2,039 GB/s HBM2e; the same 40 MB L2.
        Hardware("a100-80gb", 312 * TFLOPS, 2039 * GB, 80 * GB, 600 * GB,
                 "NVIDIA A100 datasheet, SXM4 80GB", 40 * MB),
        # NVIDIA H100 Tensor Core GPU datasheet: SXM5 BF16 1,979 TFLOPS with sparsity
        # (989.5 dense), 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s; L2 50 MB (Hopper whitepaper).
        Hardware("h100-sxm", 989.5 * TFLOPS, 3350 * GB, 80 * GB, 900 * GB,
                 "NVIDIA H100 datasheet, SXM5", 50 * MB),
        # NVIDIA H200 Tensor Core GPU datasheet: SXM BF16 1,979 TFLOPS sparse (989.5 dense),
        # 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s; the H100's die and its 50 MB L2.
        Hardware("h200", 989.5 * TFLOPS, 4800 * GB, 141 * GB, 900 * GB,
                 "NVIDIA H200 datasheet, SXM", 50 * MB),
        # NVIDIA A40 datasheet: BF16 149.7 TFLOPS dense (299.4 sparse), 696 GB/s GDDR6, 48 GB,
        # NVLink bridge 112.5 GB/s (PCIe Gen4 x16: 64 GB/s without the bridge); L2 6 MB (GA102).
        Hardware("a40", 149.7 * TFLOPS, 696 * GB, 48 * GB, 112.5 * GB,
                 "NVIDIA A40 datasheet", 6 * MB),
        # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 sparse), 864 GB/s GDDR6, 48 GB,
        # PCIe Gen4 x16 64 GB/s (no NVLink); L2 96 MB (Ada whitepaper, AD102).
        Hardware("l40s", 362.05 * TFLOPS, 864 * GB, 48 * GB, 64 * GB,
                 "NVIDIA L40S datasheet", 96 * MB),
        # This project's 2-core x86-64 machines (AVX-512 with bf16), measured with torch 2.13
        # CPU, 2 threads: a 4096^2 bf16 matmul ran at ~0.75 TFLOP/s, a tensor copy at ~46 GB/s.
        # 24 GiB RAM. There is no second device, so "interconnect" is the memory bus.
        # `orthrus-real calibrate` refines the efficiencies on top of these figures.
        Hardware("cpu-2core", 0.75 * TFLOPS, 46 * GB, 24 * GIB, 46 * GB,
                 "measured on the project's 2-core CPU machines (see comment)"),
    )
}


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(
            f"hardware: unknown name {name!r}; known: {', '.join(sorted(HARDWARE))}"
        ) from None
