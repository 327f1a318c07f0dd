"""The collectives' assumed cost: an alpha-beta model of NCCL on one 8-GPU NVLink host.

No multi-GPU machine was lent to measure it, so these are assumptions, kept in one place:
bench/decode.py adds them to its rows analytically, and a simulated rank (engine.simulate)
spends them as device time (parallel.state.SimulatedGroup). Pure arithmetic on purpose:
bench/decode.py --baseline loads this file by path into a run of an older tree's engine.
"""
ALPHA_US = 8.0      # per call: launch + the ring's latency
BETA_GBS = 150.0    # bus bandwidth, GB/s


def all_reduce_us(nbytes: int, size: int, alpha_us: float = ALPHA_US, beta_gbs: float = BETA_GBS) -> float:
    """One ring all-reduce of an nbytes message over size ranks: each byte crosses 2(n-1)/n links."""
    if size == 1:
        return 0.0
    return alpha_us + 2 * (size - 1) / size * nbytes / (beta_gbs * 1e3)


def all_gather_us(out_bytes: int, size: int, alpha_us: float = ALPHA_US, beta_gbs: float = BETA_GBS) -> float:
    """One ring all-gather whose gathered output is out_bytes: each rank receives (n-1)/n of it."""
    if size == 1:
        return 0.0
    return alpha_us + (size - 1) / size * out_bytes / (beta_gbs * 1e3)


def reduce_scatter_us(in_bytes: int, size: int, alpha_us: float = ALPHA_US, beta_gbs: float = BETA_GBS) -> float:
    """One ring reduce-scatter of an in_bytes input: each rank sends and receives (n-1)/n of it
    (an all-reduce is a reduce-scatter and then an all-gather of the same bytes)."""
    if size == 1:
        return 0.0
    return alpha_us + (size - 1) / size * in_bytes / (beta_gbs * 1e3)
