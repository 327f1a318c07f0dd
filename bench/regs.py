"""Do the decode step's kernels spill? Registers, spills and shared memory of every Triton launch,
and so how many of its programs an SM can hold, without a GPU.

A child process (TRITON_INTERPRET=1) builds one simulated TP=8 rank at the real dims (--layers
blocks, random weights in the real formats, the kernels interpreted on the CPU) and runs a short
prompt and a few decode steps; every launch is recorded with its arguments' types, 16-byte
divisibility (as Triton specialises a launch) and constexprs. This process then compiles each
distinct launch for sm_90 (triton.compile with a GPUTarget: no driver needed) and runs the
wheel's ptxas -v on it. The interpreter's own settings are put back to the GPU's first (USE_GDC on,
no software rounding, the fused MoE's asm decode, bf16 math).

    python bench/regs.py --layers 4 [--out bench/results/regs-sm90.json]     # ~15 min on 2 cores

Static facts only (registers, spills, stack, shared memory, programs an SM holds by them: Hopper's
64K registers, 228 KB of shared memory with 1 KB reserved a program, 64 warps, 32 programs): speed
still needs the GPU (bench/decode.py).
"""
import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the interpreter's settings -> the GPU's (kernels read them as constexprs)
ON_GPU = {"USE_GDC": True, "SW_ROUND": False, "ASM": True, "F32": False}


def _type(v):
    """-> (Triton signature type, 16-byte divisible) of one launch argument, as Triton's JIT types
    and specialises it."""
    import torch
    from triton.runtime.jit import mangle_type

    if isinstance(v, tuple):    # a tuple argument (kv_prep.py's segments): (types, divisible element indices)
        parts = [_type(e) for e in v]
        return tuple(t for t, _ in parts), [j for j, (_, d) in enumerate(parts) if d]
    if isinstance(v, torch.Tensor):
        return mangle_type(v), v.data_ptr() % 16 == 0
    if isinstance(v, (bool, int, float)):
        return mangle_type(v), not isinstance(v, bool) and isinstance(v, int) and v != 0 and v % 16 == 0
    return None, False


def record_launches(run) -> list[dict]:
    """run() under TRITON_INTERPRET=1 -> one spec per distinct launch (module, kernel name,
    signature, divisible argument indices, constexprs, num_warps / num_stages, calls)."""
    import triton.runtime.interpreter as interp

    specs, orig = {}, interp.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kw):
        params = inspect.signature(self.fn).parameters
        sig, div = {}, []
        for i, (name, v) in enumerate(zip(self.arg_names, args)):
            sig[name], d = _type(v)
            if isinstance(d, list):     # a tuple argument: the paths of its divisible elements
                div += [[i, j] for j in d]
            elif d:
                div.append(i)
        const = {n: kw.get(n, params[n].default) for n in self.arg_names[len(args):]}
        sig.update({n: "constexpr" for n in const})
        opts = {k: kw[k] for k in ("num_warps", "num_stages") if k in kw}
        key = json.dumps([self.fn.__module__, self.fn.__name__, sig, div, const, opts], sort_keys=True, default=str)
        spec = specs.setdefault(key, dict(module=self.fn.__module__, name=self.fn.__name__, sig=sig, div=div,
                                          const=const, opts=opts, calls=0))
        spec["calls"] += 1
        return orig(self, *args, grid=grid, warmup=warmup, **kw)

    interp.InterpretedFunction.run = recording
    try:
        run()
    finally:
        interp.InterpretedFunction.run = orig
    return list(specs.values())


def _tuples(v):
    """A recorded signature type or constexpr, its tuples back from JSON's lists."""
    return tuple(_tuples(e) for e in v) if isinstance(v, (list, tuple)) else v


def ptxas_report(spec: dict, arch: int = 90) -> dict:
    """Compile one recorded launch for sm_<arch> -> {registers, spill_stores, spill_loads, stack,
    shared (bytes a program), per_sm (programs an SM can hold)}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    const = {k: ON_GPU.get(k, v) if k in ON_GPU else _tuples(v) for k, v in spec["const"].items()}
    src = ASTSource(fn=fn, signature={k: _tuples(v) for k, v in spec["sig"].items()}, constexprs=const,
                    attrs={tuple(i) if isinstance(i, list) else (i,): [["tt.divisibility", 16]] for i in spec["div"]})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(spec["opts"]))
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        err = subprocess.run([str(ptxas), "-v", "--gpu-name", f"sm_{arch}a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    out = {}      # from ptxas's info lines only (its advisories, e.g. on wgmma, mention registers too)
    for m in re.finditer(r"Used (\d+) registers", err):
        out["registers"] = int(m[1])
    for m in re.finditer(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err):
        out.update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
    out["shared"] = k.metadata.shared
    out["per_sm"] = per_sm(out.get("registers", 0), k.metadata.shared, spec["opts"].get("num_warps", 4))
    return out


def per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs of one kernel an sm_90 SM can hold at once (the CUDA occupancy limits)."""
    by_regs = 65536 // max(1, -(-registers // 8) * 8 * 32 * warps)       # registers go by 8 a thread
    by_shared = 228 * 1024 // (shared + 1024)
    return min(by_regs, by_shared, 64 // warps, 32)


def _child(layers: int, path: str):
    """The recording side: one simulated rank at the real dims, kernels interpreted."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from interp import patch_interpreter

    patch_interpreter()
    import engine.kernels as K

    K.CPU_INTERPRETED = True
    from engine import SamplingParams
    from engine.llm import LLM

    llm = LLM(simulate_tp=8, num_layers=layers, device="cpu", dtype=torch.bfloat16)
    specs = record_launches(lambda: llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0)))
    Path(path).write_text(json.dumps(specs, default=str))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="blocks of the simulated rank (4: every kind of layer)")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)        # the child
    args = ap.parse_args(argv)
    if args.record:
        return _child(args.layers, args.record)
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "launches.json")
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--record", path], env=env, check=True)
        specs = json.loads(Path(path).read_text())
    rows = []
    print(f"{'calls':>5} {'kernel':<22} {'regs':>4} {'spill st/ld':>11} {'smem KB':>7} {'/SM':>3}  constexprs (as on the GPU)")
    for s in specs:
        r = {**s, **ptxas_report(s)}
        rows.append(r)
        c = {k: ON_GPU.get(k, v) for k, v in s["const"].items() if k.isupper() and k != "USE_GDC"}
        print(f"{s['calls']:>5} {s['name']:<22} {r.get('registers', '?'):>4} "
              f"{r.get('spill_stores', 0):>5}/{r.get('spill_loads', 0):<5} {r['shared'] / 1024:>7.1f} {r['per_sm']:>3}  "
              f"{s['opts']} {c}")
    if args.out:
        Path(args.out).write_text(json.dumps({"arch": "sm_90", "layers": args.layers, "rows": rows}, indent=1,
                                             default=str))


if __name__ == "__main__":
    main()
