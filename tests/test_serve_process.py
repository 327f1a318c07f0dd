"""`python -m engine.serve` as a process: SIGTERM under load aborts what is in flight and exits
within seconds; and the checkpoint directory it serves loads in transformers (AutoConfig,
AutoTokenizer), as clients that point at the model directory expect."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def test_checkpoint_dir_loads_in_transformers(tiny_ckpt):
    from transformers import AutoConfig, AutoTokenizer

    from engine.model.config import ModelConfig
    from engine.tokenizer import Tokenizer

    path = tiny_ckpt("tiny", 0)
    cfg = AutoConfig.from_pretrained(path)
    ours = ModelConfig.from_file(path)
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    assert cfg.layer_types == [kinds.get(r, "heavily_compressed_attention") for r in ours.compress_ratios]
    assert cfg.compress_rates["heavily_compressed_attention"] == 16
    tok = AutoTokenizer.from_pretrained(path)
    assert tok("Hello world", add_special_tokens=False).input_ids == Tokenizer.from_dir(path).encode("Hello world")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_under_load_exits_within_seconds(tiny_ckpt):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--model", str(tiny_ckpt("tiny", 0)),
                             "--port", str(port), "--device", "cpu", "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError("server did not start")
        long = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}
        results = {}

        def streamed():
            with httpx.stream("POST", f"{base}/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                results["stream"] = "".join(r.iter_text())

        def plain():
            try:
                results["plain"] = httpx.post(f"{base}/v1/completions", json={**long, "n": 3}, timeout=60)
            except httpx.HTTPError as e:
                results["plain"] = e
        threads = [threading.Thread(target=f) for f in (streamed, plain)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # both are generating
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(timeout=10)
        assert elapsed < 8, elapsed
        assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
        stream = results["stream"]
        assert stream.endswith("data: [DONE]\n\n")
        last = json.loads(stream.split("\n\n")[-3][6:])
        assert last["error"]["code"] == "shutting_down"
        plain = results["plain"]
        assert isinstance(plain, httpx.HTTPError) or plain.json()["error"]["code"] == "shutting_down"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
