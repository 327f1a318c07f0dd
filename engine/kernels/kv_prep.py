"""A decode step's attention jobs between its projections and its top-k and attention, one launch.

rope_qkv (q and kv norms, RoPE, the ring write), the compressor's step (compress_decode), and in
CSA layers the indexer compressor's step and the indexer queries' RoPE, Hadamard and FP4 (rope_q):
independent jobs (none reads another's output) that took a launch each, two of them on the aux
stream. Inside `together()` their launchers hold their launches back (common.hold); at the block's
end one kernel runs every job's programs, a range of program ids per job, each running the job's
own program function (the code its own kernel runs: rope_qkv_program, compress_program,
rope_q_program), so the jobs cost one launch instead of up to four. Each job keeps its own
tickets (the compressors'). The jobs' outputs, allocated by their launchers, are valid after the
block: nothing inside it may read them. The references (torch) run at once, as before.
"""
import contextlib

import triton
import triton.language as tl

from . import common
from .common import gdc_enter, pdl_args
from .compressor import _compress_kernel, compress_program
from .rope_kv import _rope_qkv_kernel, rope_qkv_program
from .rope_q import _rope_q_kernel, rope_q_program

# False: the jobs launch one by one, as before (bench/levers.py's lever)
KV_PREP = True


@triton.jit
def _kv_prep_kernel(rope, comp, comp2, ropeq, n_rope, n_comp, n_comp2,
                    KR: tl.constexpr, KC: tl.constexpr, KC2: tl.constexpr, KQ: tl.constexpr,
                    GR: tl.constexpr, GC: tl.constexpr, GC2: tl.constexpr, GQ: tl.constexpr,
                    HAS2: tl.constexpr, HASQ: tl.constexpr, USE_GDC: tl.constexpr = False):
    # program ids: rope_qkv's n_rope (grid [*, GR] row-major), the compressor's n_comp, then, when
    # present, the second compressor's n_comp2 and rope_q's programs
    gdc_enter(USE_GDC)
    p = tl.program_id(0)
    if p < n_rope:
        rope_qkv_program(p // GR, p % GR, rope, KR)
    elif p < n_rope + n_comp:
        c = p - n_rope
        compress_program(c // GC, c % GC, comp, KC)
    else:
        c = p - n_rope - n_comp
        if HAS2:
            if c < n_comp2:
                compress_program(c // GC2, c % GC2, comp2, KC2)
            elif HASQ:
                q = c - n_comp2
                rope_q_program(q // GQ, q % GQ, ropeq, KQ)
        elif HASQ:
            rope_q_program(c // GQ, c % GQ, ropeq, KQ)


def fuses(on: bool) -> bool:
    """Would together(on) make one launch of the jobs (on, and the lever KV_PREP)?"""
    return on and KV_PREP


@contextlib.contextmanager
def together(on: bool = True):
    """The rope_qkv, compress_decode and rope_q kernel launches inside run as one launch at the
    block's end (one rope_qkv, one or two compressors, at most one rope_q; any other mix launches
    one by one, in order). on False (or KV_PREP off): a plain block."""
    if not (on and KV_PREP):
        yield
        return
    jobs = []
    before = common.held(jobs)
    try:
        yield
    finally:
        common.held(before)
    launch(jobs)


def launch(jobs: list):
    """Held (kernel, grid, args, K) launches -> one _kv_prep_kernel launch (or each its own)."""
    rope = [j for j in jobs if j[0] is _rope_qkv_kernel]
    comp = [j for j in jobs if j[0] is _compress_kernel]
    ropeq = [j for j in jobs if j[0] is _rope_q_kernel]
    if len(jobs) == 1 or len(rope) != 1 or not 1 <= len(comp) <= 2 or len(ropeq) > 1 or \
            len(rope) + len(comp) + len(ropeq) != len(jobs):
        for kernel, grid, args, K in jobs:
            kernel[grid](args, K=K, num_warps=4, **pdl_args())
        return
    (_, gr, ar, kr), (_, gc, ac, kc) = rope[0], comp[0]
    (_, gc2, ac2, kc2) = comp[1] if len(comp) == 2 else (None, (0, 1), ac, kc)
    (_, gq, aq, kq) = ropeq[0] if ropeq else (None, (0, 1), (), ())
    n = [g[0] * g[1] for g in (gr, gc, gc2, gq)]
    _kv_prep_kernel[(sum(n),)](ar, ac, ac2, aq, n[0], n[1], n[2], KR=kr, KC=kc, KC2=kc2, KQ=kq, GR=gr[1], GC=gc[1],
                               GC2=gc2[1], GQ=gq[1], HAS2=len(comp) == 2, HASQ=bool(ropeq), num_warps=4,
                               **pdl_args())
