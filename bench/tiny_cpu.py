"""Decode tok/s of the tiny model through the whole engine on CPU, at batch 1 and 16.

    python bench/tiny_cpu.py [--model DIR] [--tokens 64]

A figure to track, not a goal: the tiny model is ~80M parameters, mostly the 129280-row
embedding and head, so the head GEMV dominates and this measures the engine's Python and
torch overheads more than the model."""
import argparse
import time

import torch

from engine import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", dtype=torch.float32, max_num_seqs=16, numerics="plain")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([[5] * 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    print(f"torch threads: {torch.get_num_threads()}")
    for batch in (1, 16):
        prompts = [[7 + i] * 16 for i in range(batch)]
        eng = llm.engine
        for p in prompts:
            eng.add_request(p, params)
        steps, t_decode, n_decode = 0, 0.0, 0
        while eng.has_unfinished():
            plan_decoding = sum(s.in_decode for s in eng.scheduler.running)
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            if plan_decoding == batch and not eng.scheduler.waiting:  # pure decode steps only
                t_decode += dt
                n_decode += batch
            steps += 1
        print(f"batch {batch:3d}: {n_decode / t_decode:8.1f} decode tok/s ({1e3 * t_decode / (n_decode / batch):.1f} ms/step)")


if __name__ == "__main__":
    main()
