"""A real OpenAI-compatible server for the regional tier's tests: llama-cpp-python's
``llama_cpp.server`` on the CPU, serving a tiny llama model written here with the ``gguf``
package (random weights, so gibberish; nothing is downloaded).

The model: 2 layers, hidden size 64, 4 heads, a sentencepiece-style vocabulary of 328 tokens
(3 control tokens, 256 byte tokens, 69 pieces), a 512-token context. It generates thousands
of tokens a second on one core, so a stream of a few dozen tokens lasts a few milliseconds
and the server (which runs one request at a time) is busy whenever the balancer sends it
work. Built from a fixed seed, so every run serves the same model.

Install the extra to run these tests: ``pip install -e '.[llamacpp]'`` (llama-cpp-python
compiles llama.cpp from source, about ten minutes on two cores).
"""

from __future__ import annotations

import os
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

ALIAS = "tiny-llama"
N_EMBD, N_LAYER, N_HEAD, N_FF, N_CTX = 64, 2, 4, 128, 512
PIECES = ["▁", *string.ascii_lowercase, *string.ascii_uppercase, *".,!?'-", "▁the", "▁a"]


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types (1 normal, 2 unknown, 3 control, 6 byte), in the
    layout of a sentencepiece llama vocabulary: <unk>, <s>, </s>, the 256 bytes, pieces."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
    types = [2, 3, 3, *([6] * 256), *([1] * len(PIECES))]
    scores = [0.0] * 259 + [-float(k) for k in range(len(PIECES))]
    return tokens, scores, types


def write_model(path: Path, seed: int = 0) -> Path:
    import gguf  # the llamacpp extra

    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("gtm tiny random llama")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all F32
    w.add_pooling_type(gguf.PoolingType.MEAN)  # one embedding per input, as OpenAI's
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    # numpy shapes are (rows, columns): ggml's (ne1, ne0) reversed.
    w.add_tensor("token_embd.weight", weights(n_vocab, N_EMBD))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", weights(n_vocab, N_EMBD))
    for b in range(N_LAYER):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{b}.{name}.weight", weights(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{b}.ffn_gate.weight", weights(N_FF, N_EMBD))
        w.add_tensor(f"blk.{b}.ffn_up.weight", weights(N_FF, N_EMBD))
        w.add_tensor(f"blk.{b}.ffn_down.weight", weights(N_EMBD, N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(
    model: Path, *args: str, api_key: str | None = None, within: float = 120.0
) -> Iterator[str]:
    """``python -m llama_cpp.server`` on a free loopback port; yields its base URL once it
    lists its model. ``args``: more server options (``--interrupt_requests False``)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--model_alias",
        ALIAS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(N_CTX),
        "--n_threads",
        "1",
        "--embedding",
        "True",
        *args,
    ]
    if api_key is not None:
        cmd += ["--api_key", api_key]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        deadline = time.monotonic() + within
        while True:
            try:
                if httpx.get(f"{url}/v1/models", headers=headers, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("llama_cpp.server did not start")
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
