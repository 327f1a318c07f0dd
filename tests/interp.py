"""Running Triton kernels on CPU under TRITON_INTERPRET=1, for the kernel tests.

triton reads TRITON_INTERPRET when it decorates a kernel, so the interpreted checks run in a
child process (`run_child`) and the variable never leaks into the parent's other modules.
`patch_interpreter` fixes three triton 3.6 interpreter bugs the kernels hit:
  - in-kernel scalars are 1-element numpy arrays, which numpy >= 2.4 refuses as loop bounds
    (triton-lang/triton#9171);
  - a bf16 tl.dot multiplies the uint16 bit patterns (#11584): widen to fp32 first;
  - an fp32 -> bf16 cast truncates, where the GPU (and torch) round to nearest even.
"""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def patch_interpreter():
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp

    base_patch = interp._patch_lang_tensor

    def patch_tensor(tensor, scope):
        base_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    base_dot = interp.InterpreterBuilder.create_dot
    base_cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interp.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return base_cast(self, src, dst_type)

    interp._patch_lang_tensor = patch_tensor
    interp.InterpreterBuilder.create_dot = lambda self, a, b, *rest: base_dot(self, widen(a), widen(b), *rest)
    interp.InterpreterBuilder.cast_impl = cast_impl


def child_env() -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)}


@contextlib.contextmanager
def started(script: str, names):
    """One interpreter child of `script` (its __main__ with one name) per name, all started at
    once: each is single-threaded Python, so a 2-core machine runs a module in about half its
    serial time. -> {name: Popen}; await one with finished(). Children still running at exit
    are killed."""
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    procs = {n: subprocess.Popen([sys.executable, script, n], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in names}
    try:
        yield procs
    finally:
        for p in procs.values():
            p.kill()


def finished(proc, timeout: int) -> str:
    """Wait for a started() child; assert it exited 0 -> its output."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-12000:]
    return out


def run_child(script: str, *args: str, timeout: int = 900) -> str:
    """Run `script` (a test file's __main__) under the interpreter; assert it exits 0 -> stdout."""
    r = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    return r.stdout
