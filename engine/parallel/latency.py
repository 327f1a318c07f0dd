"""The collectives' assumed cost: an alpha-beta model of NCCL on one 8-GPU NVLink host.

No multi-GPU machine was lent to measure it, so these are assumptions, kept in one place:
bench/decode.py adds them to its rows analytically, and a simulated rank (engine.simulate)
spends them as device time (parallel.state.SimulatedGroup). Pure arithmetic on purpose:
bench/decode.py --baseline loads this file by path into a run of an older tree's engine.
"""
ALPHA_US = 8.0      # per call: launch + the ring's latency
# Bus bandwidth, GB/s. NCCL's ring collectives on 8 NVLink4 GPUs (H100; the H200 has the same
# NVLink) saturate at ~360 GB/s busBw from 128 MB messages up (all_gather_perf in
# NVIDIA/nccl-tests#326, where NCCL's maintainer calls 360 "exactly what we'd expect on H100";
# ~370 effective after protocol overhead, NVIDIA/nccl-tests#212; NVLink SHARP all-reduces reach
# ~480). 300 is taken for the prefill's 32-128 MB messages, below the saturating size. (150 until
# 2026-12-07, an unfounded guess; bench/levers.py's nccl_beta puts it back.)
BETA_GBS = 300.0


def _cost(bus_bytes: float, alpha_us: float | None, beta_gbs: float | None) -> float:
    """us for a call that moves bus_bytes over each link (the module's constants, read at call
    time so that a lever can change them, where alpha_us / beta_gbs are None)."""
    alpha = ALPHA_US if alpha_us is None else alpha_us
    return alpha + bus_bytes / ((BETA_GBS if beta_gbs is None else beta_gbs) * 1e3)


def all_reduce_us(nbytes: int, size: int, alpha_us: float | None = None, beta_gbs: float | None = None) -> float:
    """One ring all-reduce of an nbytes message over size ranks: each byte crosses 2(n-1)/n links."""
    return 0.0 if size == 1 else _cost(2 * (size - 1) / size * nbytes, alpha_us, beta_gbs)


def all_gather_us(out_bytes: int, size: int, alpha_us: float | None = None, beta_gbs: float | None = None) -> float:
    """One ring all-gather whose gathered output is out_bytes: each rank receives (n-1)/n of it."""
    return 0.0 if size == 1 else _cost((size - 1) / size * out_bytes, alpha_us, beta_gbs)


def reduce_scatter_us(in_bytes: int, size: int, alpha_us: float | None = None, beta_gbs: float | None = None) -> float:
    """One ring reduce-scatter of an in_bytes input: each rank sends and receives (n-1)/n of it
    (an all-reduce is a reduce-scatter and then an all-gather of the same bytes)."""
    return 0.0 if size == 1 else _cost((size - 1) / size * in_bytes, alpha_us, beta_gbs)
