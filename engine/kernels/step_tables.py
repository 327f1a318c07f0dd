"""A decode step's per-row tables, one kernel: RoPE angles, window rows, entry rows, visible entries.

Every layer of a decode step reads the same few tables derived from the rows' positions, slots
and block tables: cos/sin at the positions (two frequency sets) and at each compressor ratio's
entry positions, each row's window keys as ring rows, an HCA layer's entries as pool rows, an
indexer's count of visible entries. Made on first use by torch ops (StepInputs.once) they cost
~40 small launches a step; here one program per row writes them all (`plan` says which, as
step_tables_plan in engine.model.step builds it), and the step stores them where StepInputs.once
finds them. The references below are the torch code the step used (and the CPU still uses).
"""
import torch
import triton
import triton.language as tl

from .common import cos_sin, entry_loc, gdc_enter, pdl_args

# False: the torch references make the tables (bench/levers.py's lever)
STEP_TABLES = True
ENT_BLOCK = tl.constexpr(256)     # entry rows a program writes at a time


@triton.jit
def _step_tables_kernel(pos_ptr, slot_ptr, bt_ptr, stride_bt, n_blocks, block_tokens, invs, cos_outs, sin_outs,
                        win_ptr, ent_outs, ent_ns, vis_outs, ROPE: tl.constexpr, W: tl.constexpr, ENT: tl.constexpr,
                        VIS: tl.constexpr, USE_GDC: tl.constexpr = False):
    # ROPE: per angle table (entry ratio or 0, R/2, its power-of-two block); ENT: per entry-rows
    # table its ratio, and ent_ns its entry count n (a runtime int: n grows with the context, and
    # a constexpr would compile again each time it does); VIS: ratios; W: window (0: none)
    gdc_enter(USE_GDC)
    b = tl.program_id(0)
    p = tl.load(pos_ptr + b)
    for j in tl.static_range(len(ROPE)):              # cos_sin at p (or its entry's start)
        i = tl.arange(0, ROPE[j][2])
        m = i < ROPE[j][1]
        q = p
        if ROPE[j][0] > 0:
            q = p // ROPE[j][0] * ROPE[j][0]
        ang = q.to(tl.float32) * tl.load(invs[j] + i, mask=m, other=0.0)
        tl.store(cos_outs[j] + b * ROPE[j][1] + i, tl.cos(ang), mask=m)
        tl.store(sin_outs[j] + b * ROPE[j][1] + i, tl.sin(ang), mask=m)
    if W > 0:                                          # window_rows_ref
        k = p - W + 1 + tl.arange(0, W)
        slot = tl.load(slot_ptr + b)
        tl.store(win_ptr + b * W + tl.arange(0, W), tl.where(k >= 0, slot * W + k % W, -1))
    for j in tl.static_range(len(ENT)):               # entry_rows_ref, ENT_BLOCK entries at a time
        per_block = block_tokens // ENT[j]
        n = ent_ns[j]
        for e0 in range(0, n, ENT_BLOCK):
            e = e0 + tl.arange(0, ENT_BLOCK)
            blk = tl.minimum(e // per_block, n_blocks - 1)
            phys = tl.load(bt_ptr + b * stride_bt + blk, mask=e < n, other=0)
            rows = tl.where(e < (p + 1) // ENT[j], phys * per_block + e % per_block, -1)
            tl.store(ent_outs[j] + b * n + e, rows, mask=e < n)
    for j in tl.static_range(len(VIS)):               # visible entries
        tl.store(vis_outs[j] + b, (p + 1) // VIS[j])


def step_tables(positions, slots, block_table, block_tokens: int, plan) -> dict:
    """Decode: positions [B,1], slots [B], block_table [B, max_blocks] and the plan, a tuple of
    ("rope", key, inv_freq [R/2], entry ratio or None), ("window rows", W), ("entry rows", ratio,
    n), ("visible entries", ratio) -> {StepInputs.once key: table}, as step_tables_ref makes them."""
    if not STEP_TABLES:
        return step_tables_ref(positions, slots, block_table, block_tokens, plan)
    B, dev = positions.shape[0], positions.device
    out, invs, coss, sins, rope, ents, ent_k, ent_n, viss, vis_k, win, W = {}, [], [], [], [], [], [], [], [], [], None, 0
    for item in plan:
        if item[0] == "rope":
            _, key, inv, ratio = item
            half = inv.shape[-1]
            c, s = (torch.empty(B, 1, half, dtype=torch.float32, device=dev) for _ in range(2))
            out[("rope", key)] = (c, s)
            invs.append(inv.float().contiguous())
            coss.append(c)
            sins.append(s)
            rope.append((ratio or 0, half, triton.next_power_of_2(half)))
        elif item[0] == "window rows":
            W = item[1]
            win = out[item] = torch.empty(B, W, dtype=torch.long, device=dev)
        elif item[0] == "entry rows":
            _, ratio, n = item
            ents.append(torch.empty(B, n, dtype=torch.long, device=dev))
            out[item[:2]] = ents[-1]
            ent_k.append(ratio)
            ent_n.append(n)
        else:
            viss.append(torch.empty(B, dtype=torch.long, device=dev))
            out[item] = viss[-1]
            vis_k.append(item[1])
    if W & (W - 1):      # the kernel's window lanes are tl.arange(0, W): a power of two
        return step_tables_ref(positions, slots, block_table, block_tokens, plan)
    if B:
        bt = block_table.contiguous()
        _step_tables_kernel[(B,)](positions.reshape(B).contiguous(), slots.contiguous(), bt, bt.stride(0), bt.shape[1],
                                  block_tokens, tuple(invs), tuple(coss), tuple(sins), win if win is not None else bt,
                                  tuple(ents), tuple(ent_n), tuple(viss), ROPE=tuple(rope), W=W, ENT=tuple(ent_k),
                                  VIS=tuple(vis_k),
                                  num_warps=1, **pdl_args())
    return out


def window_rows_ref(positions: torch.Tensor, slots: torch.Tensor, W: int) -> torch.Tensor:
    """Decode: each row's window keys as flat rows of the [slots * W, Dh] ring, -1 before 0 -> [B,W]."""
    key_pos = positions[:, :1] - W + 1 + torch.arange(W, device=positions.device)          # [B,W]
    return torch.where(key_pos >= 0, slots[:, None] * W + key_pos % W, -1)


def entry_rows_ref(positions: torch.Tensor, table: torch.Tensor, block_tokens: int, ratio: int, n: int) -> torch.Tensor:
    """Every entry visible to each query as flat rows of the pool, -1 past it -> [B*S,n] (positions
    [B,S] with table [B, blocks], or [T,1] with a per-token table [T, blocks])."""
    ent = torch.arange(n, device=positions.device).expand(*positions.shape, n)
    rows = entry_loc(table, block_tokens, ent, ratio)
    return torch.where(ent < ((positions + 1) // ratio)[..., None], rows, -1).flatten(0, 1)


def step_tables_ref(positions, slots, block_table, block_tokens: int, plan) -> dict:
    """Torch reference: the tables as the step's torch code makes them."""
    out = {}
    for item in plan:
        if item[0] == "rope":
            _, key, inv, ratio = item
            out[("rope", key)] = cos_sin(positions if ratio is None else positions // ratio * ratio, inv)
        elif item[0] == "window rows":
            out[item] = window_rows_ref(positions, slots, item[1])
        elif item[0] == "entry rows":
            out[item[:2]] = entry_rows_ref(positions, block_table, block_tokens, item[1], item[2])
        else:
            out[item] = ((positions + 1) // item[1]).flatten()
    return out
