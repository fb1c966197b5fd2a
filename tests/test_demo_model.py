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


# ------------------------------------------------------------------ the MTP head

MTP_FILE = "out-mtp-00000.safetensors"


def test_mtp_head_is_stored_as_upstream_writes_it():
    """`colibri convert --mtp` output: layer num_hidden_layers only, int8 per-row matrices and
    float32 norms/router, no own embedding or head copy (the main ones are shared)."""
    import json

    config = json.loads((Path(DEMO_MODEL_DIR) / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    c = Container(DEMO_MODEL_DIR)
    mtp = [n for n in c.shard_tensors(os.path.join(DEMO_MODEL_DIR, MTP_FILE)) if not c.is_scale(n)]
    prefix = f"model.layers.{config['num_hidden_layers']}."
    assert mtp and all(n.startswith(prefix) for n in mtp)
    others = [n for n in c.names() if n.startswith(prefix) and n not in mtp and not c.is_scale(n)]
    assert others == []  # the main shards hold no MTP tensor
    for name in ("eh_proj.weight", "self_attn.q_a_proj.weight", "mlp.experts.15.down_proj.weight",
                 "mlp.shared_experts.up_proj.weight"):
        assert c.tensor(prefix + name).fmt == 1, name
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "mlp.gate.e_score_correction_bias"):
        assert c.info(prefix + name).dtype == "F32", name
    assert prefix + "shared_head.head.weight" not in c and prefix + "embed_tokens.weight" not in c


def test_demo_loads_the_mtp_layer_beside_the_main_model(demo):
    model, _ = demo
    assert len(model.mtp_layers) == 1 and model.mtp_layers[0].eh_proj.shape == (512, 1024)
    assert model.mtp_layers[0].head is None  # shares lm_head


@pytest.mark.slow
def test_mtp_head_drafts_the_main_models_next_next_token():
    """The head at t (h_t, token t+1) against the main model's greedy token at t+1 on held-out
    text, through the stored (int8) head: docs/demo-model.md measures 0.49; an eh_proj half in
    the wrong order, or an unrelated head, agrees on ~0.03."""
    import importlib.util
    import sys

    pytest.importorskip("transformers")
    scripts = Path(__file__).parent.parent / "scripts" / "demo"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location("eval_mtp", scripts / "eval_mtp.py")
        eval_mtp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(eval_mtp)
    finally:
        sys.path.remove(str(scripts))
    main = eval_mtp.load_main_model(Path(DEMO_MODEL_DIR))
    head = eval_mtp.load_head(main, Path(DEMO_MODEL_DIR))
    result = eval_mtp.heldout_acceptance(head, main, np.load(HELDOUT)[:1025], 256)
    assert result["top1_acceptance"] > 0.3, result


def test_demo_drafts_with_its_mtp_layer_by_default(demo):
    """Greedy decoding of the demo speculates with its MTP layer (the default draft) and gives the
    tokens of decoding without it; seeded sampling keeps to plain decoding."""
    from colibri_mlx import speculative
    from colibri_mlx.generate import SamplingParams, generate_tokens

    model, tokenizer = demo
    assert speculative.resolve_draft(model, None) == "mtp"
    assert speculative.resolve_draft(model, None, seeded_sampling=True) == "none"
    ids = tokenizer.encode("And the LORD said unto Moses,")
    plain = list(generate_tokens(model, ids, 24, SamplingParams(), draft="none"))
    default = list(generate_tokens(model, ids, 24, SamplingParams()))
    assert [t for t, _ in default] == [t for t, _ in plain]
    assert default[-1][1]["draft_steps"] > 0 and default[-1][1]["draft_accepted"] > 0, default[-1][1]
