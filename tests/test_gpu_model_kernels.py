"""The tiny model with the Triton kernels on == with the torch references (GPU: pytest -m gpu)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from conftest import rel_err  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.kernels import set_kernels  # noqa: E402


def _greedy(llm, prompts):
    seen = {}

    def hook(seqs, logits):
        for s, row in zip(seqs, logits):
            seen[(tuple(s.prompt_ids), len(s.output_ids))] = row.float().clone()

    llm.engine.runner.logits_hook = hook
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    llm.engine.runner.logits_hook = None
    return [o.token_ids for o in outs], seen


@pytest.mark.parametrize("preset,numerics", [("tiny", "plain"), ("tiny", "reference"), ("flash", "plain")])
def test_kernels_match_references(tiny_ckpt, preset, numerics):
    g = torch.Generator().manual_seed(1)
    n = 300 if preset == "flash" else 60
    prompts = [torch.randint(2, 129280, (m,), generator=g).tolist() for m in (n, n // 3, 7)]
    llm = LLM(tiny_ckpt(preset, 0), device="cuda", dtype=torch.bfloat16, numerics=numerics, enforce_eager=True,
              max_model_len=1024)
    try:
        set_kernels("none")
        want, want_logits = _greedy(llm, prompts)
        set_kernels("all")
        got, got_logits = _greedy(llm, prompts)
    finally:
        set_kernels("all")
    errs = [rel_err(got_logits[k], want_logits[k]).item() for k in want_logits]
    print(f"{preset} {numerics}: kernels vs torch, max rel err {max(errs):.2e}, tokens equal {got == want}")
    assert max(errs) <= 1e-2
    assert got == want
