"""A GGUF file on the transformers path is read one tensor at a time (backend/runner/
transformers_gguf.py): its linears go into blocks as they are read, never all float32 at once
as transformers' own reader would have them. Measured in a process of its own: the peak of
its anonymous memory (sampled every millisecond) over the load, against the float32 size of
the model's weights. transformers' reader holds every tensor in float32 before the model takes
them, which this bound fails (2026-12-07, on this Q4_0 file: 2.1x the float32 size; one tensor
at a time 0.76x: the float32 embedding, the blocks and their tiles, the tensor at hand)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers.gguf_files import VOCAB, write_from_hf

ROOT = Path(__file__).resolve().parents[3]
HIDDEN, FFN, LAYERS = 512, 16384, 8  # wide linears: 142M of the model's 167M weights
# the child: prepares the file's folder, then loads it on the transformers path while a
# thread samples RssAnon; prints the peak's growth over the load, in bytes
_MEASURE = """
import sys, threading, time, torch
from pathlib import Path
from backend.runner import gguf_model
from backend.runner.gguf_model import model_folder
from backend.runner.loader import load_model
from backend.runner.quant.apply import QuantSpec

def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) * 1024

gguf_model.cache_dir = lambda: Path(sys.argv[2])  # the prepared folder; the kernels where they are
folder = model_folder(sys.argv[1])
base, peak, done = anon(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)
thread = threading.Thread(target=sample)
thread.start()
model = load_model(folder, torch.float32, torch.device("cpu"), QuantSpec(kind="auto"), impl="transformers")
done.set()
thread.join()
print("PEAK", max(peak[0], anon()) - base)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_a_gguf_file_loads_without_its_weights_all_in_float32(tmp_path):
    torch.manual_seed(0)
    config = AutoConfig.for_model("starcoder2", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                  num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=8,
                                  max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    float32_bytes = sum(p.numel() for p in model.parameters()) * 4
    settings = {"block_count": LAYERS, "context_length": 1024, "embedding_length": HIDDEN,
                "feed_forward_length": FFN, "head_count": 8, "head_count_kv": 8, "layer_norm_eps": 1e-5}  # fmt: skip
    source = write_from_hf(tmp_path / "wide.Q4_0.gguf", model, "starcoder2", "Q4_0", settings)
    del model
    # freed tensors leave the heap at once (glibc otherwise keeps some, and the peak measures that)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(source), str(tmp_path / "cache")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "49 of 49 linears in the GGUF file's own block formats" in done.stderr
    peak = int(done.stdout.split("PEAK")[-1])
    assert peak < float32_bytes, (peak, float32_bytes)
