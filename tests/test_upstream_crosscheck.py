"""Byte-identity of `colibri convert` with upstream colibri's own converter.

Runs upstream's `c/tools/convert_fp8_to_int4.py` (from a checkout named by the environment
variable COLIBRI_UPSTREAM_DIR; never part of this repository) and ours on the same tiny BF16
and FP8 checkpoints (scripts/convert/crosscheck_upstream_converter.py) and requires the same shard
names, tensor names, dtypes, shapes and bytes. Skipped when COLIBRI_UPSTREAM_DIR is unset.

The comparison itself is tested without upstream: a one-byte change, a renamed tensor and a
missing shard must each be reported.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import numpy as np
import pytest

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "convert", "crosscheck_upstream_converter.py")
_spec = importlib.util.spec_from_file_location("crosscheck_upstream_converter", _SCRIPT)
cc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cc  # dataclasses look their module up while the class is built
_spec.loader.exec_module(cc)

UPSTREAM_DIR = os.environ.get("COLIBRI_UPSTREAM_DIR")
needs_upstream = pytest.mark.skipif(not UPSTREAM_DIR, reason="COLIBRI_UPSTREAM_DIR (an upstream colibri checkout) "
                                    "is not set")
# A quick subset (FP8 source: it also exercises the block dequantization) runs by default when
# COLIBRI_UPSTREAM_DIR is set; the rest, at ~3 s per converter pair, is marked slow.
QUICK = ("default (int4 g64, int8 io)", "--group-size 0 (int4 per-row)", "--ebits 8", "--up-bits 3",
         "--ebits 2 --group-size 0 (int2)")
CASES = [pytest.param(src, label, marks=() if (src == "fp8" and label in QUICK) else pytest.mark.slow)
         for src in ("bf16", "fp8") for label in cc.OPTION_SETS if label not in cc.E8_SETS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {src: cc.build_checkpoint(str(root / src), fp8=(src == "fp8")) for src in ("bf16", "fp8")}


def _crosscheck(checkpoints, tmp_path, source, label):
    converter = cc.find_upstream_converter(UPSTREAM_DIR)
    options = cc.OPTION_SETS[label]
    up, ours = str(tmp_path / "upstream"), str(tmp_path / "ours")
    cc.run_upstream(converter, checkpoints[source], up, options)
    cc.run_ours(checkpoints[source], ours, options)
    result = cc.compare(up, ours)
    assert result.identical, f"{source} {label}: {result.first_difference}"
    assert result.n_tensors > 0
    return up


@needs_upstream
@pytest.mark.parametrize("source,label", CASES)
def test_converter_bytes_match_upstream(checkpoints, tmp_path, source, label):
    _crosscheck(checkpoints, tmp_path, source, label)


@needs_upstream
@pytest.mark.slow
@pytest.mark.parametrize("source", ["bf16", "fp8"])
def test_e8_converter_bytes_match_upstream(checkpoints, tmp_path, source):
    up = _crosscheck(checkpoints, tmp_path, source, "--xbits e8")
    # The option must really have produced fmt 6: upstream tags each e8 tensor's .qs with [6.0].
    tensors = cc.read_tensors(up)
    qs = [t for shard in tensors.values() for n, t in shard.items() if ".mlp.experts." in n and n.endswith(".qs")]
    assert qs and all(np.frombuffer(b, np.float32).tolist() == [6.0] for _, _, b in qs)


# ------------------------------------------------------------------ the comparison can fail


def _write(path, tensors, metadata=None):
    from safetensors.numpy import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path, metadata=metadata)


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {"a.weight": rng.integers(0, 256, 40, dtype=np.uint8),
               "a.weight.qs": rng.standard_normal(5).astype(np.float32),
               "n.weight": rng.standard_normal(7).astype(np.float32)}
    up, ours = tmp_path / "up", tmp_path / "ours"
    _write(str(up / "out-00000.safetensors"), tensors)
    _write(str(ours / "out-00000.safetensors"), tensors, metadata={"stamp": "differs, ignored"})
    return up, ours, tensors


def test_compare_equal_ignores_file_metadata(pair):
    up, ours, _ = pair
    assert cc.compare(str(up), str(ours)) == cc.Comparison(True, 3)


def test_compare_reports_one_byte(pair):
    up, ours, tensors = pair
    changed = dict(tensors, **{"a.weight": tensors["a.weight"].copy()})
    changed["a.weight"][17] ^= 1
    _write(str(ours / "out-00000.safetensors"), changed)
    result = cc.compare(str(up), str(ours))
    assert not result.identical and "a.weight" in result.first_difference and "byte 17" in result.first_difference


def test_compare_reports_dtype_name_and_shard(pair, tmp_path):
    up, ours, tensors = pair
    _write(str(ours / "out-00000.safetensors"), dict(tensors, **{"n.weight": tensors["n.weight"].astype(np.float64)}))
    assert "float64" in cc.compare(str(up), str(ours)).first_difference
    renamed = {("b.weight" if k == "a.weight" else k): v for k, v in tensors.items()}
    _write(str(ours / "out-00000.safetensors"), renamed)
    assert "only ours ['b.weight']" in cc.compare(str(up), str(ours)).first_difference
    shutil.copy(up / "out-00000.safetensors", ours / "out-00000.safetensors")
    _write(str(up / "out-00001.safetensors"), tensors)
    assert "shard files differ" in cc.compare(str(up), str(ours)).first_difference


def test_checkpoint_has_the_edge_cases(checkpoints):
    """The source really holds what the crosscheck relies on: FP8 blocks with float32 scales,
    .5 ties, zero rows, an MTP-only shard."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(checkpoints["fp8"]) if f.endswith(".safetensors"))
    assert len(files) == 3
    with safe_open(os.path.join(checkpoints["fp8"], files[1]), framework="pt") as f:
        assert str(f.get_slice("model.layers.1.self_attn.o_proj.weight").get_dtype()) == "F8_E4M3"
        assert f.get_tensor("model.layers.1.self_attn.o_proj.weight_scale_inv").shape == (2, 2)
    with safe_open(os.path.join(checkpoints["fp8"], files[2]), framework="pt") as f:
        mtp = set(f.keys())
    p = f"model.layers.{cc.N_LAYERS}."
    assert all(n.startswith(p) for n in mtp)
    # a whole MTP layer, with the tensors --mtp must skip (indexer) and keep (embedding copy)
    assert {p + n for n in ("eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                            "self_attn.kv_b_proj.weight", "mlp.gate.e_score_correction_bias",
                            "mlp.experts.3.down_proj.weight", "self_attn.indexer.wq_b.weight")} <= mtp
    with safe_open(os.path.join(checkpoints["bf16"], files[0]), framework="pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.q_a_proj.weight").float().numpy()
    assert not w[0].any() and w[1, :8].tolist() == cc.TIE_ROW_INT4 and w[2, :8].tolist() == cc.TIE_ROW_INT8
