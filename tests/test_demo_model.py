"""The bundled demo model: it loads with no path, stays within its size budget, goes through
the same loader as any container, and still models its held-out text after quantization."""

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import colibri_mlx
from colibri_mlx.cli import main
from colibri_mlx.container import Container
from colibri_mlx.models import DEMO_MODEL_DIR

HELDOUT = Path(__file__).parent / "data" / "demo_heldout_2049.npy"  # first 2049 held-out tokens


@pytest.fixture(scope="module")
def demo():
    return colibri_mlx.load()


def test_container_size_and_formats():
    files = [f for f in os.listdir(DEMO_MODEL_DIR) if f.endswith(".safetensors")]
    assert sum(os.path.getsize(os.path.join(DEMO_MODEL_DIR, f)) for f in files) <= 25 * 2**20
    c = Container(DEMO_MODEL_DIR)
    assert c.tensor("model.layers.1.mlp.experts.0.gate_proj.weight").fmt == 6
    assert c.tensor("model.layers.1.self_attn.q_a_proj.weight").fmt == 4
    assert c.tensor("model.layers.0.mlp.down_proj.weight").fmt == 4
    assert c.tensor("model.embed_tokens.weight").fmt == 1
    assert c.tensor("lm_head.weight").fmt == 1


def test_heldout_perplexity(demo):
    # docs/demo-model.md: 42.4 over the whole held-out slice; this 2048-token prefix must stay
    # far below the 4096-token vocabulary's uniform perplexity and near the measured figure.
    model, _ = demo
    ids = np.load(HELDOUT).astype(np.int32)
    x = mx.array(ids[:-1].reshape(8, 256))
    y = mx.array(ids[1:].reshape(8, 256))
    logits = model(x).astype(mx.float32)
    nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
    ppl = float(mx.exp(nll.mean()))
    assert 10 < ppl < 60, ppl


def test_generation_reads_as_english(demo):
    model, tokenizer = demo
    text = colibri_mlx.generate(model, tokenizer, "And the LORD said unto Moses,", max_tokens=40)
    words = text.split()
    assert len(words) >= 15
    common = {"the", "and", "of", "unto", "LORD", "he", "I", "that", "thou", "shall", "said"}
    assert sum(w.strip(",.;:") in common for w in words) >= 5, text


def test_cli_without_model_uses_demo_and_says_so():
    result = CliRunner().invoke(main, ["generate", "-p", "In the beginning", "--max-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert "bundled demo model" in result.stderr
    assert result.stdout.strip()
