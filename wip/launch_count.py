"""Count the launches of one prefill step of the tiny flash model on CPU, kernels interpreted.
usage: TRITON_INTERPRET=1 python .scratch/launch_count.py T [--by-site N]"""
import collections, os, sys, traceback
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import interp
interp.patch_interpreter()
import engine.kernels as K
K.CPU_INTERPRETED = True
from engine.kernels import proj_gemm
from engine.parallel import sequence
import engine.kernels.compressor as KC
if hasattr(KC, 'FINISH_KERNEL'): KC.FINISH_KERNEL = os.environ.get('FINISH', '1') == '1'
T = int(sys.argv[1]) if len(sys.argv) > 1 else 64
proj_gemm.UNFUSED_M = 32
sequence.SP_MIN_T = 32
sequence.split = lambda n: sequence.SeqSplit(n, 1, 0) if n >= 32 else None
from weights.make_tiny import make_tiny
from engine import LLM, SamplingParams
ck = "/tmp/tiny-flash-0"
if not os.path.exists(ck + "/config.json"):
    make_tiny(ck, preset="flash", seed=0)
llm = LLM(ck, device="cpu", dtype=torch.bfloat16, numerics="reference", enforce_eager=True, max_model_len=512,
          max_num_seqs=4, skip_tokenizer_init=True)
VIEW = {"view", "_unsafe_view", "as_strided", "slice", "select", "t", "transpose", "permute", "expand",
        "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow",
        "view_as_real", "view_as_complex", "_reshape_alias", "unflatten", "flatten", "reshape", "diagonal",
        "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
        "sym_size", "sym_stride", "is_same_size", "sym_numel", "sym_storage_offset", "resolve_conj", "resolve_neg"}
ops, sites = collections.Counter(), collections.Counter()
HOST = collections.Counter()
def site():
    for fr in reversed(traceback.extract_stack()[:-3]):
        if "/engine/" in fr.filename:
            return f"{fr.filename.split('/engine/')[1]}:{fr.lineno} {fr.name}"
    return "?"
INSIDE = [0]
class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        out = func(*args, **(kwargs or {}))
        same = isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor) and \
            out.data_ptr() == args[0].data_ptr() and out.dtype == args[0].dtype and name in ("to", "contiguous", "clone_noop")
        if name not in VIEW and not INSIDE[0] and not same:     # a no-op .to() / .float() launches nothing
            ops[name] += 1
            sites[site()] += 1
        return out
import triton.runtime.interpreter as ti
base = ti.InterpretedFunction.run
def run(self, *a, **k):
    if not INSIDE[0]:
        ops["TRITON " + self.fn.__name__] += 1; sites[site()] += 1
    INSIDE[0] += 1
    try:
        return base(self, *a, **k)
    finally:
        INSIDE[0] -= 1
ti.InterpretedFunction.run = run
runner = llm.engine.runner
execute = runner.execute
counting = {"on": False}
def ex(step, *a):
    if step.get("starts") and sum(len(i) for i in step["ids"]) >= 32 and not counting["on"]:
        counting["on"] = True
        with Count():
            return execute(step, *a)
    return execute(step, *a)
runner.execute = ex
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(2, 129280, (T,), generator=g).tolist()]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
print("TOTAL", sum(ops.values()), "triton", sum(v for k, v in ops.items() if k.startswith("TRITON")))
for k, v in ops.most_common(60): print(f"{v:5d} {k}")
print("--- sites")
n = int(sys.argv[sys.argv.index("--by-site") + 1]) if "--by-site" in sys.argv else 80
for k, v in sites.most_common(n): print(f"{v:5d} {k}")
