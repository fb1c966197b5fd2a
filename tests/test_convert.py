"""The converter: tiny random checkpoints in every input dtype -> containers, checked against
float64 / torch references and upstream's quantizer formulas written out element-wise."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from colibri_mlx.container import Container, ContainerError
from colibri_mlx.convert import ConvertError, convert
from colibri_mlx.convert.classify import BitPlan, classify, format_for
from colibri_mlx.container.reader import E4M3FN, E8M0
from colibri_mlx.convert.sources import SafetensorsShard, WeightSource
from colibri_mlx.formats import decode

REPO = Path(__file__).resolve().parents[1]

# A runnable DeepSeek-V3-shaped model: layer 0 dense, layer 1 MoE, layer 2 = MTP head.
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 300, "hidden_size": 256, "intermediate_size": 160, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32, "v_head_dim": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "attention_bias": False, "rope_scaling": None,
}
D, VOCAB, INTER, MOE, E = 256, 300, 160, 256, 4


def _layer(i: int, moe: bool) -> dict:
    p = f"model.layers.{i}."
    H, qk, v = 2, 32 + 16, 32
    t = {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
         p + "self_attn.q_a_proj.weight": (96, D), p + "self_attn.q_a_layernorm.weight": (96,),
         p + "self_attn.q_b_proj.weight": (H * qk, 96),
         p + "self_attn.kv_a_proj_with_mqa.weight": (64 + 16, D), p + "self_attn.kv_a_layernorm.weight": (64,),
         p + "self_attn.kv_b_proj.weight": (H * (32 + v), 64), p + "self_attn.o_proj.weight": (D, H * v)}
    if not moe:
        t.update({p + "mlp.gate_proj.weight": (INTER, D), p + "mlp.up_proj.weight": (INTER, D),
                  p + "mlp.down_proj.weight": (D, INTER)})
        return t
    t.update({p + "mlp.gate.weight": (E, D), p + "mlp.gate.e_score_correction_bias": (E,),
              p + "mlp.shared_experts.gate_proj.weight": (MOE, D), p + "mlp.shared_experts.up_proj.weight": (MOE, D),
              p + "mlp.shared_experts.down_proj.weight": (D, MOE)})
    for e in range(E):
        t.update({p + f"mlp.experts.{e}.gate_proj.weight": (MOE, D), p + f"mlp.experts.{e}.up_proj.weight": (MOE, D),
                  p + f"mlp.experts.{e}.down_proj.weight": (D, MOE)})
    return t


def _indexer(i: int) -> dict:
    p = f"model.layers.{i}.self_attn.indexer."
    return {p + "wq_b.weight": (64, 96), p + "wk.weight": (32, D), p + "k_norm.weight": (32,),
            p + "k_norm.bias": (32,), p + "weights_proj.weight": (4, D)}


def _mtp(i: int) -> dict:
    p = f"model.layers.{i}."
    t = {k: s for k, s in _layer(i, True).items()}
    t.update({p + "eh_proj.weight": (D, 2 * D), p + "enorm.weight": (D,), p + "hnorm.weight": (D,),
              p + "shared_head.norm.weight": (D,)})
    return t


SHARDS = [  # source shard -> tensor shapes; the last holds only the MTP head
    {"model.embed_tokens.weight": (VOCAB, D), **_layer(0, False)},
    {**_layer(1, True), **_indexer(1)},
    {"lm_head.weight": (VOCAB, D), "model.norm.weight": (D,)},
    _mtp(2),
]


def _random_weight(rng, shape, name) -> np.ndarray:
    if name.endswith(("norm.weight", "norm.bias")):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    w = 0.05 * rng.standard_normal(shape)
    if len(shape) == 2:  # a few outliers per matrix, as in real checkpoints
        flat = w.reshape(-1)
        flat[rng.integers(0, flat.size, max(1, flat.size // 500))] *= 12
    return w.astype(np.float32)


def _fp8_encode(w: np.ndarray, scale_dtype: str):
    """Block-quantize like DeepSeek's FP8 release: 128x128 blocks, amax/448 scales."""
    O, I = w.shape
    bo, bi = -(-O // 128), -(-I // 128)
    pad = np.zeros((bo * 128, bi * 128), np.float32)
    pad[:O, :I] = w
    amax = np.abs(pad.reshape(bo, 128, bi, 128)).max(axis=(1, 3))
    scale = np.maximum(amax / 448.0, 1e-12).astype(np.float32)
    if scale_dtype == "ue8m0":
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)  # power of two, rounded up
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:O, :I]
    q = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
    st = torch.from_numpy(scale)
    st = st.to(torch.float8_e8m0fnu) if scale_dtype == "ue8m0" else st
    return q, st


def _nvfp4_encode(w: np.ndarray, rng):
    O, I = w.shape
    codes = rng.integers(0, 16, size=(O, I)).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    block = torch.from_numpy(rng.choice([0.25, 0.5, 1.0, 1.5, 3.0, 6.0], size=(O, I // 16)).astype(np.float32))
    return torch.from_numpy(packed), block.to(torch.float8_e4m3fn), torch.tensor(3.9e-5, dtype=torch.float32)


def _float64_reference(t: dict, name: str) -> np.ndarray:
    """Independent dequantization in float64 (torch decodes the float8 codes), then rounded once
    to float32 — every product below is exact in float64, so this is the correctly rounded value."""
    w = t[name]
    if w.dtype == torch.float8_e4m3fn:
        s = t[name + "_scale_inv"].to(torch.float64).numpy()
        O, I = w.shape
        full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:O, :I]
        return (w.to(torch.float64).numpy() * full).astype(np.float32)
    if w.dtype == torch.uint8 and name + "_scale" in t:
        lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
        codes = torch.stack([w & 15, w >> 4], dim=-1).reshape(w.shape[0], -1).long()
        block = t[name + "_scale"].to(torch.float64).repeat_interleave(16, 1)
        return (lut[codes] * block * t[name + "_scale_2"].double()).numpy().astype(np.float32)
    return w.to(torch.float64).numpy().astype(np.float32)


def make_checkpoint(root: Path, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a 4-shard checkpoint in `dtype`; return name -> float32 reference weight."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    reference, weight_map = {}, {}
    for k, shapes in enumerate(SHARDS):
        t = {}
        for name, shape in shapes.items():
            w = _random_weight(rng, shape, name)
            is_matrix = len(shape) == 2 and not name.endswith("mlp.gate.weight")
            io = name in ("model.embed_tokens.weight", "lm_head.weight")
            if name.endswith("e_score_correction_bias"):
                t[name] = torch.from_numpy(w)
            elif dtype in ("fp8-f32", "fp8-ue8m0") and is_matrix and not io:
                t[name], t[name + "_scale_inv"] = _fp8_encode(w, dtype.split("-")[1])
            elif dtype == "nvfp4" and ".mlp.experts." in name:
                t[name], t[name + "_scale"], t[name + "_scale_2"] = _nvfp4_encode(w, rng)
                t[name[: -len("weight")] + "input_scale"] = torch.tensor(1.0)  # consumed, never written
            else:
                torch_dtype = {"f16": torch.float16, "f32": torch.float32}.get(dtype, torch.bfloat16)
                t[name] = torch.from_numpy(w).to(torch_dtype)
            reference[name] = _float64_reference(t, name)
        fname = f"model-{k + 1:05d}-of-{len(SHARDS):05d}.safetensors"
        save_file(t, str(root / fname))
        weight_map.update({n: fname for n in t})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "generation_config.json").write_text('{"eos_token_id": 1}')
    return reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(dtype):
        if dtype not in cache:
            root = tmp_path_factory.mktemp(dtype)
            cache[dtype] = (root, make_checkpoint(root, dtype))
        return cache[dtype]
    return get


def _convert(indir, outdir, **kw):
    kw.setdefault("progress", False)
    return convert(str(outdir), indir=str(indir), log=lambda m: None, **kw)


def _shard_bytes(outdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(outdir.glob("*.safetensors"))}


# ---------------------------------------------------------------- input decoding


def test_e4m3_and_e8m0_tables_match_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    for table, dt in ((E4M3FN, torch.float8_e4m3fn), (E8M0, torch.float8_e8m0fnu)):
        ref = codes.view(dt).to(torch.float32).numpy()
        assert np.array_equal(np.isnan(ref), np.isnan(table))
        ok = ~np.isnan(ref)
        assert np.array_equal(ref[ok].view(np.uint32), table[ok].view(np.uint32))


@pytest.mark.parametrize("scale_dtype", ["f32", "ue8m0"])
def test_fp8_block_dequant_exact_against_float64(tmp_path, scale_dtype):
    rng = np.random.default_rng(1)
    w = _random_weight(rng, (300, 200), "w.weight")  # partial blocks on both axes
    q, s = _fp8_encode(w, scale_dtype)
    save_file({"w.weight": q, "w.weight_scale_inv": s}, str(tmp_path / "a.safetensors"))
    ref = _float64_reference({"w.weight": q, "w.weight_scale_inv": s}, "w.weight")
    with SafetensorsShard(tmp_path / "a.safetensors") as shard:
        src = WeightSource(shard, "w.weight")
        got = src.read()
        assert got.dtype == np.float32 and got.shape == (300, 200)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
        assert np.array_equal(src.rows(128, 300), got[128:])  # row blocks agree with the whole
    assert np.abs(ref - w).max() < 0.07 * np.abs(w).max()  # and it is the weight we encoded


def test_nvfp4_dequant_exact_against_float64(tmp_path):
    rng = np.random.default_rng(2)
    packed, block, glob = _nvfp4_encode(np.zeros((24, 64), np.float32), rng)
    t = {"e.weight": packed, "e.weight_scale": block, "e.weight_scale_2": glob}
    save_file(t, str(tmp_path / "a.safetensors"))
    ref = _float64_reference(t, "e.weight")
    with SafetensorsShard(tmp_path / "a.safetensors") as shard:
        got = WeightSource(shard, "e.weight").read()
    assert np.array_equal(got, ref) and np.abs(ref).max() > 0
    # low nibble = even element
    first = int(packed[0, 0])
    lut = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    b0 = float(block[0, 0].to(torch.float32))
    assert got[0, 0] == np.float32(np.float32(lut[first & 15] * b0) * np.float32(3.9e-5))


# ---------------------------------------------------------------- classification


def test_classify_matches_upstream_table():
    n = 2
    cases = {
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": "consumed",
        "model.layers.1.mlp.experts.0.up_proj.weight_scale_2": "consumed",
        "model.layers.1.mlp.gate.e_score_correction_bias": "f32",
        "model.layers.1.mlp.gate.weight": "f32",
        "model.norm.weight": "f32", "model.layers.0.input_layernorm.weight": "f32",
        "model.embed_tokens.weight": "io", "lm_head.weight": "io",
        "model.layers.1.mlp.experts.3.down_proj.weight": "x",
        "model.layers.1.mlp.shared_experts.gate_proj.weight": "sh",
        "model.layers.0.self_attn.o_proj.weight": "o", "model.layers.0.self_attn.kv_b_proj.weight": "kvb",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": "attn",
        "model.layers.0.mlp.down_proj.weight": "dmlp", "model.layers.0.foo.weight": "q",
        "model.layers.1.self_attn.indexer.wk.weight": "skip", "model.layers.2.eh_proj.weight": "skip",
        "model.layers.2.mlp.experts.0.up_proj.weight": "skip",
    }
    for name, kind in cases.items():
        assert classify(name, n) == kind, name
    assert classify("model.layers.2.eh_proj.weight", n, "mtp") == "q"
    assert classify("model.layers.2.mlp.experts.0.up_proj.weight", n, "mtp") == "x"
    assert classify("model.layers.1.q_a_proj.weight", n, "mtp") == "skip"
    assert classify("model.layers.1.self_attn.indexer.k_norm.weight", n, "indexer") == "f32"
    assert classify("model.layers.1.self_attn.indexer.wk.weight", n, "indexer") == "q"
    assert classify("model.layers.1.self_attn.o_proj.weight", n, "indexer") == "skip"


def test_bits_to_format_table():
    assert format_for("e8", 64) == (6, None)
    assert format_for(3, 64) == (5, None) and format_for(3, 0) == (5, None)
    assert format_for(4, 64) == (4, 64) and format_for(4, 0) == (2, None)
    assert format_for(2, 0) == (3, None) and format_for(8, 64) == (1, None)
    with pytest.raises(ConvertError, match="group-size 0"):
        format_for(2, 64)
    with pytest.raises(ConvertError, match="all three expert projections"):
        BitPlan(xbits=4, proj_bits={"up_proj": "e8"})
    with pytest.raises(ConvertError, match="group-size must be"):
        BitPlan(group_size=40)


# ---------------------------------------------------------------- end to end


def _expected_values(w: np.ndarray, fmt: int, gs) -> np.ndarray:
    """Upstream's quantizer formulas, element-wise: float32 absmax scale, round half even."""
    qmax, lo, group = {1: (127, -128, None), 2: (7, -8, None), 3: (1, -2, None), 4: (7, -8, gs),
                       5: (3, -4, 64)}[fmt]
    O, I = w.shape
    group = group or I
    ng = -(-I // group)
    pad = np.zeros((O, ng * group), np.float32)
    pad[:, :I] = w
    g = pad.reshape(O, ng, group)
    s = np.maximum(np.abs(g).max(axis=2, keepdims=True) / np.float32(qmax), np.float32(1e-8))
    q = np.clip(np.rint(g / s), lo, qmax)
    return (q * s).reshape(O, ng * group)[:, :I].astype(np.float32)


EXPECTED_DEFAULT = {"io": (1, None), "x": (4, 64), "sh": (4, 64), "o": (4, 64), "kvb": (4, 64),
                    "attn": (4, 64), "dmlp": (4, 64)}


def _check_container(outdir: Path, reference: dict, expected: dict, n_layers=2, mode="main"):
    with Container(outdir) as c:
        written = {n for n in c.names() if not n.endswith(".qs")}
        want = {n for n in reference if classify(n, n_layers, mode) not in ("skip", "consumed")}
        assert written == want
        for name in sorted(want):
            kind = classify(name, n_layers, mode)
            w = reference[name]
            if kind == "f32" or w.ndim != 2:
                got = np.asarray(c.tensor(name))
                assert got.dtype == np.float32 and np.array_equal(got, w), name
                continue
            proj = name.split(".")[-2]  # "x.up_proj" entries override "x" for one projection
            fmt, gs = expected.get(f"{kind}.{proj}", expected[kind])
            qt = c.tensor(name, w.shape)
            assert (qt.fmt, qt.gs) == (fmt, gs), name
            got = decode(qt.fmt, np.asarray(qt.packed), np.asarray(qt.scales), *w.shape, qt.gs)
            if fmt == 6:
                from colibri_mlx.formats.e8 import rotate_rows

                rw = rotate_rows(w)
                assert np.linalg.norm(got - rw) < 0.25 * np.linalg.norm(rw), name
            else:
                assert np.array_equal(got, _expected_values(w, fmt, gs)), name


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32", "fp8-f32", "fp8-ue8m0", "nvfp4"])
def test_convert_every_input_dtype(checkpoints, tmp_path, dtype):
    indir, reference = checkpoints(dtype)
    summary = _convert(indir, tmp_path / "out")
    out = tmp_path / "out"
    # three shards hold main-pass tensors; the fourth (MTP only) emits nothing
    assert sorted(p.name for p in out.glob("*.safetensors")) == [f"out-0000{i}.safetensors" for i in range(3)]
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / f).read_bytes() == (indir / f).read_bytes()
    _check_container(out, reference, EXPECTED_DEFAULT)
    table = summary.table()
    assert "int4-grouped gs64" in table and "int8-row" in table
    rows = {(k, f): v for (k, f, g), v in summary.rows.items()}
    n, src, nbytes, nw, e2, r2 = rows[("x", 4)]
    assert n == 3 * E and 0.02 < np.sqrt(e2 / r2) < 0.2  # int4 g64 on gaussian + outliers


def test_recipes_and_per_kind_bits(checkpoints, tmp_path):
    indir, reference = checkpoints("bf16")
    _convert(indir, tmp_path / "a", recipe="e8x4g64", up_bits=3)
    exp = {k: (1, None) for k in EXPECTED_DEFAULT}
    exp.update({"x": (4, 64), "x.up_proj": (5, None)})
    _check_container(tmp_path / "a", reference, exp)
    _convert(indir, tmp_path / "b", group_size=0, ebits=4, o_bits=8, kvb_bits=2, attn_bits=3, dmlp_bits=8,
             shared_bits=8, io_bits=4)
    exp = {"io": (2, None), "x": (2, None), "sh": (1, None), "o": (1, None), "kvb": (3, None),
           "attn": (5, None), "dmlp": (1, None)}
    _check_container(tmp_path / "b", reference, exp)


def test_e8_experts(checkpoints, tmp_path):
    pytest.importorskip("colibri_mlx.formats.e8")
    indir, reference = checkpoints("bf16")
    _convert(indir, tmp_path / "out", recipe="e8", jobs=2)
    exp = dict(EXPECTED_DEFAULT, x=(6, None))
    _check_container(tmp_path / "out", reference, exp)


def test_mtp_and_indexer_passes(checkpoints, tmp_path):
    indir, reference = checkpoints("fp8-f32")
    out = tmp_path / "out"
    _convert(indir, out, mtp=True)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["out-mtp-00000.safetensors"]
    _check_container(out, reference, {k: (1, None) for k in EXPECTED_DEFAULT} | {"q": (1, None)}, mode="mtp")
    _convert(indir, tmp_path / "idx", indexer=True, ebits=4)
    assert sorted(p.name for p in (tmp_path / "idx").glob("*.safetensors")) == ["out-idx-00000.safetensors"]
    _check_container(tmp_path / "idx", reference, {"q": (4, 64)}, mode="indexer")
    with pytest.raises(ConvertError, match="main pass only"):
        _convert(indir, tmp_path / "x", mtp=True, recipe="default")


def test_jobs_gives_identical_bytes(checkpoints, tmp_path):
    indir, _ = checkpoints("fp8-ue8m0")
    _convert(indir, tmp_path / "serial")
    _convert(indir, tmp_path / "pool", jobs=2)
    assert _shard_bytes(tmp_path / "serial") == _shard_bytes(tmp_path / "pool")


_KILLED_RUN = textwrap.dedent("""
    import os, sys, time
    import colibri_mlx.container as container
    original = container.write_shard
    def write_then_stall(path, tensors, metadata=None):
        original(path, tensors, metadata)
        open(sys.argv[3], "w").close()   # tell the test a shard is on disk, then wait to be killed
        time.sleep(120)
    container.write_shard = write_then_stall
    from colibri_mlx.convert import convert
    convert(sys.argv[2], indir=sys.argv[1], progress=False, log=lambda m: None)
""")


def test_kill_9_then_resume_is_byte_identical(checkpoints, tmp_path):
    indir, _ = checkpoints("bf16")
    _convert(indir, tmp_path / "clean")
    out, marker = tmp_path / "out", tmp_path / "written"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(indir), str(out), str(marker)], cwd=REPO)
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "converter subprocess died or hung"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # killed after out-00000 was renamed into place but before the manifest recorded it
    assert (out / "out-00000.safetensors").exists() and not (out / "out-00001.safetensors").exists()
    (out / "out-00001.safetensors.tmp-99999").write_bytes(b"half a shard")  # as a kill mid-write leaves
    _convert(indir, out)
    assert not list(out.glob("*.tmp-*"))
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "clean")
    # a further rerun finds everything done and changes nothing
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    _convert(indir, out)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == before


def test_resume_with_other_parameters_is_refused(checkpoints, tmp_path):
    indir, _ = checkpoints("bf16")
    _convert(indir, tmp_path / "out")
    with pytest.raises(ConvertError, match="Refusing to mix conversions") as e:
        _convert(indir, tmp_path / "out", ebits=8)
    assert "'ebits': 4" in str(e.value) and "'ebits': 8" in str(e.value)
    manifest = json.loads((tmp_path / "out" / ".out-progress.json").read_text())
    assert manifest["params"] == {"ebits": 4, "io_bits": 8, "xbits": 4, "group_size": 64, "n_layers": 2,
                                  "bits_map": {}, "proj_bits": {}}
    assert manifest["shards"]["model-00004-of-00004.safetensors"] == ""


def test_outdir_with_a_foreign_shard_is_refused_before_writing(checkpoints, tmp_path):
    # A container reads every *.safetensors in its directory: converting next to another
    # shard would "succeed" into a container with every tensor twice.
    indir, _ = checkpoints("bf16")
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(indir / "model-00001-of-00004.safetensors", out / "model-00001-of-00004.safetensors")
    with pytest.raises(ConvertError, match=r"model-00001-of-00004\.safetensors.*fresh --outdir"):
        _convert(indir, out)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00004.safetensors"]


def test_stale_shard_of_an_earlier_conversion_is_refused(checkpoints, tmp_path):
    indir, _ = checkpoints("bf16")
    out = tmp_path / "out"
    _convert(indir, out)
    (out / ".out-progress.json").unlink()  # as the refusal to mix conversions suggests
    shutil.copyfile(out / "out-00001.safetensors", out / "out-00007.safetensors")  # a bigger run's leftover
    with pytest.raises(ConvertError, match=r"out-00007\.safetensors"):
        _convert(indir, out)
    (out / "out-00007.safetensors").unlink()
    _convert(indir, out)
    Container(str(out))  # readable: no tensor twice


# ---------------------------------------------------------------- bad input


def _single(tmp_path, tensors):
    d = tmp_path / "in"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def test_missing_scale_inv(tmp_path):
    q, _ = _fp8_encode(np.ones((128, 128), np.float32), "f32")
    d = _single(tmp_path, {"model.layers.0.self_attn.o_proj.weight": q})
    with pytest.raises(ConvertError, match=r"model\.safetensors.*o_proj\.weight.*_scale_inv' is missing"):
        _convert(d, tmp_path / "out")


def test_wrong_block_scale_shape(tmp_path):
    q, s = _fp8_encode(np.ones((200, 300), np.float32), "f32")
    d = _single(tmp_path, {"model.layers.0.mlp.up_proj.weight": q,
                           "model.layers.0.mlp.up_proj.weight_scale_inv": s[:1]})
    with pytest.raises(ConvertError, match=r"shape \[1, 3\], expected \[2, 3\]"):
        _convert(d, tmp_path / "out")


def test_e8_scale_overflow_names_the_tensor(tmp_path):
    # RMS 1e7 in a 256-weight block overflows fmt 6's fp16 super-block scale.
    w = np.full((MOE, D), 1e7, np.float32)  # the shape CONFIG implies
    d = _single(tmp_path, {"model.layers.1.mlp.experts.0.up_proj.weight": torch.from_numpy(w)})
    with pytest.raises(ConvertError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.experts\.0"
                                           r"\.up_proj\.weight'.*overflows fp16"):
        _convert(d, tmp_path / "out", recipe="e8")


def test_nvfp4_reciprocal_global_refused(tmp_path):
    packed, block, _ = _nvfp4_encode(np.zeros((16, 32), np.float32), np.random.default_rng(0))
    d = _single(tmp_path, {"model.layers.1.mlp.experts.0.up_proj.weight": packed,
                           "model.layers.1.mlp.experts.0.up_proj.weight_scale": block,
                           "model.layers.1.mlp.experts.0.up_proj.weight_scale_2": torch.tensor(2688.0)})
    with pytest.raises(ConvertError, match="compressed-tensors"):
        _convert(d, tmp_path / "out")


def test_missing_indir_creates_no_outdir(tmp_path):
    with pytest.raises(ConvertError, match=r"--indir .*nowhere: not a directory"):
        _convert(tmp_path / "nowhere", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, message", [
    ({"xbits": 5}, "bits must be one of"), ({"recipe": "int5"}, "unknown recipe 'int5'"),
    ({"group_size": 40}, "group-size must be"), ({"up_bits": "e8"}, "all three expert projections"),
])
def test_bad_options_are_refused_before_the_outdir_exists(checkpoints, tmp_path, options, message):
    indir, _ = checkpoints("bf16")
    with pytest.raises(ConvertError, match=message):
        _convert(indir, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_outdir_that_is_a_file_is_refused(checkpoints, tmp_path):
    indir, _ = checkpoints("bf16")
    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(ConvertError, match=r"--outdir .*out: exists and is not a directory"):
        _convert(indir, tmp_path / "out")


def _shrink_experts(indir: Path, d: Path) -> Path:
    """A copy of the checkpoint whose config.json implies narrower experts than its shards hold."""
    shutil.copytree(indir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": MOE // 2}))
    return d


def test_shape_disagreeing_with_config_is_refused_before_any_output(checkpoints, tmp_path):
    # The container stores quantized weights as flat bytes and takes [O, I] from config.json:
    # a mismatch would convert for hours and fail only at load.
    indir, _ = checkpoints("nvfp4")  # NVFP4 stores [O, I/2]: the check compares the logical [O, I]
    d = _shrink_experts(indir, tmp_path / "in")
    with pytest.raises(ConvertError, match=r"model-00002-of-00004\.safetensors: tensor 'model\.layers\.1\.mlp\."
                                           r"experts\.0\.down_proj\.weight' has shape \[256, 256\] but config\.json "
                                           r"implies \[256, 128\]"):
        _convert(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # shard 1 was fine, but nothing was converted


def test_shape_check_covers_the_mtp_pass_and_spares_unknown_names(checkpoints, tmp_path):
    indir, _ = checkpoints("bf16")
    d = _shrink_experts(indir, tmp_path / "in")
    with pytest.raises(ConvertError, match=r"model-00004-of-00004\.safetensors: tensor 'model\.layers\.2\.mlp\."
                                           r"experts\.0\.down_proj\.weight' has shape"):
        _convert(d, tmp_path / "mtp", mtp=True)
    # names config.json does not imply (here a deepseek_v3 config and DSA indexer weights,
    # an extra matrix) convert as upstream converts them
    (tmp_path / "extra").mkdir()
    extra = torch.from_numpy(np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32))
    e = _single(tmp_path / "extra", {"model.layers.0.self_attn.o_proj.weight": torch.ones(D, 64),
                                     "model.layers.0.mlp.extra_proj.weight": extra})
    _convert(e, tmp_path / "extra_out")
    _convert(indir, tmp_path / "idx", indexer=True)
    with Container(tmp_path / "extra_out") as c:
        assert c.tensor("model.layers.0.mlp.extra_proj.weight", (8, 64)).fmt == 4
    # a model_type the shape table does not know converts as upstream's does, with a warning
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "glm4_moe"}))
    logged = []
    convert(str(tmp_path / "other"), indir=str(d), mtp=True, progress=False, log=logged.append)
    assert any("WARNING: source tensor shapes are not checked (unknown model_type 'glm4_moe'" in m for m in logged)


@pytest.mark.parametrize("name, shape", [("model.layers.1.mlp.experts.gate_up_proj", (E, 2 * MOE, D)),
                                         ("model.layers.1.mlp.experts.down_proj", (E, D, MOE))])
def test_fused_3d_experts_are_refused(tmp_path, name, shape):
    # transformers v5's fused layout; upstream would store it float32 under a name the engine never reads
    w = torch.from_numpy(np.random.default_rng(4).standard_normal(shape).astype(np.float32)).to(torch.bfloat16)
    d = _single(tmp_path, {name: w})
    with pytest.raises(ConvertError, match=rf"model\.safetensors: tensor '{name}' is a fused 3-D expert tensor "
                                           rf"BF16\[{shape[0]}, {shape[1]}, {shape[2]}\].*per-expert 2-D tensors"):
        _convert(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("filename", ["config.json", "model.safetensors.index.json"])
def test_json_file_that_is_not_an_object(checkpoints, tmp_path, filename):
    indir, _ = checkpoints("bf16")
    d = tmp_path / "in"
    shutil.copytree(indir, d)
    (d / filename).write_text('["model-00001-of-00004.safetensors"]')
    with pytest.raises(ConvertError, match=rf"{filename}: expected a JSON object, got list"):
        _convert(d, tmp_path / "out")


def test_truncated_shard(checkpoints, tmp_path):
    indir, _ = checkpoints("bf16")
    d = tmp_path / "in"
    shutil.copytree(indir, d)
    shard = d / "model-00002-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises((ConvertError, ContainerError), match="model-00002-of-00004.safetensors"):
        _convert(d, tmp_path / "out")


# ---------------------------------------------------------------- --repo


class _FakeHub:
    """Serves a local checkpoint through the two huggingface_hub calls the converter makes."""

    def __init__(self, root: Path):
        self.root, self.downloads = root, []

    def model_info(self, repo, revision=None, files_metadata=False):
        from types import SimpleNamespace

        files = [SimpleNamespace(rfilename=p.name, size=p.stat().st_size) for p in sorted(self.root.iterdir())]
        return SimpleNamespace(siblings=files)

    def hf_hub_download(self, repo, filename, revision=None, local_dir=None):
        os.makedirs(local_dir, exist_ok=True)
        self.downloads.append(filename)
        return shutil.copy(self.root / filename, Path(local_dir) / filename)


def _serve(monkeypatch, root: Path) -> _FakeHub:
    import huggingface_hub

    fake = _FakeHub(root)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: fake.model_info(*a, **k))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    return fake


def test_repo_download_convert_delete(checkpoints, tmp_path, monkeypatch):
    indir, reference = checkpoints("fp8-f32")
    fake = _serve(monkeypatch, indir)
    out = tmp_path / "out"
    convert(str(out), repo="org/tiny", progress=False, log=lambda m: None, min_free_gb=0)
    _convert(indir, tmp_path / "local")
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "local")  # no empty shard before the last
    assert not (out / "_inflight").exists() and (out / "config.json").exists()
    n = len(fake.downloads)
    convert(str(out), repo="org/tiny", progress=False, log=lambda m: None, min_free_gb=0)
    assert not any(f.endswith(".safetensors") for f in fake.downloads[n:])  # resumed: nothing fetched
    with pytest.raises(ConvertError, match="min-free-gb"):
        convert(str(tmp_path / "full"), repo="org/tiny", progress=False, log=lambda m: None, min_free_gb=1e9)


def _repo_convert(out: Path, **options):
    return convert(str(out), repo="org/tiny", progress=False, log=lambda m: None, min_free_gb=0, **options)


def test_repo_refusals_leave_the_outdir_untouched(checkpoints, tmp_path, monkeypatch):
    # --repo used to copy config/tokenizer (and create _meta, the lock) before these refusals ran.
    indir, _ = checkpoints("bf16")
    _serve(monkeypatch, indir)
    with pytest.raises(ConvertError, match="unknown recipe"):
        _repo_convert(tmp_path / "fresh", recipe="int5")
    assert not (tmp_path / "fresh").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes((indir / "model-00003-of-00004.safetensors").read_bytes())
    with pytest.raises(ConvertError, match=r"model\.safetensors, which the converter does not write"):
        _repo_convert(foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["model.safetensors"]
    out = tmp_path / "out"
    _repo_convert(out)
    (out / "config.json").write_text("{}")  # if the refused run copied metadata, this would be replaced
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConvertError, match="Refusing to mix conversions"):
        _repo_convert(out, ebits=8)
    assert (out / "config.json").read_text() == "{}" and sorted(p.name for p in out.iterdir()) == before


def test_repo_index_that_is_not_an_object(checkpoints, tmp_path, monkeypatch):
    indir, _ = checkpoints("bf16")
    d = tmp_path / "in"
    shutil.copytree(indir, d)
    (d / "model.safetensors.index.json").write_text('["model-00004-of-00004.safetensors"]')
    _serve(monkeypatch, d)
    with pytest.raises(ConvertError, match=r"model\.safetensors\.index\.json: expected a JSON object, got list"):
        _repo_convert(tmp_path / "out", mtp=True)  # only the --mtp/--indexer passes read the index
    assert not (tmp_path / "out").exists()
    (d / "model.safetensors.index.json").write_text('{"weight_map": ["model-00004-of-00004.safetensors"]}')
    with pytest.raises(ConvertError, match=r"'weight_map' must be a JSON object, got list"):
        _repo_convert(tmp_path / "out", mtp=True)


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_repo_unreachable_gives_clear_message(tmp_path, env):
    full_env = {**os.environ, **env, "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    proc = subprocess.run([sys.executable, "scripts/convert/convert_hf.py", "--repo", "org/model", "--outdir",
                           str(tmp_path / "out"), "--min-free-gb", "0"], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    want = "HF_HUB_OFFLINE=1" if "HF_HUB_OFFLINE" in env else "could not be reached"
    assert want in proc.stderr and "--repo org/model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_convert(checkpoints, tmp_path):
    from click.testing import CliRunner

    from colibri_mlx.cli import main

    indir, _ = checkpoints("bf16")
    r = CliRunner().invoke(main, ["convert", "--indir", str(indir), "--outdir", str(tmp_path / "out"),
                                  "--no-progress", "--xbits", "3"])
    assert r.exit_code == 0, r.output
    assert "int3-g64" in r.output
    r = CliRunner().invoke(main, ["convert", "--indir", str(indir), "--outdir", str(tmp_path / "x"),
                                  "--xbits", "5"])
    assert r.exit_code == 1 and "bits must be one of 2, 3, 4, 8 or e8" in r.output


# ---------------------------------------------------------------- the loaded model


@pytest.mark.parametrize("source, recipe", [("fp8", "default"), ("fp8", "int3-up"), ("bf16", "default"),
                                            ("f16", "default"), ("f32", "int3-up")])
def test_loaded_container_logits_match_dequantized_reference(tmp_path, source, recipe):
    """A checkpoint (FP8 block-scaled, BF16, F16 or F32) converted and loaded by colibri_mlx.load,
    against transformers running the container's own dequantized weights: names, layouts and
    formats reach the model intact."""
    helpers = pytest.importorskip("helpers_models")
    colibri_mlx = pytest.importorskip("colibri_mlx")
    if not hasattr(colibri_mlx, "load"):
        pytest.skip("colibri_mlx.load is not available yet")
    import mlx.core as mx

    from colibri_mlx.container import expected_shapes

    hf = helpers.build_hf_model("deepseek_v3", seed=5, n_routed_experts=8, moe_intermediate_size=64)
    if source in ("bf16", "f16"):
        # The checkpoint holds rounded weights: round the float32 oracle's parameters the same way
        # (only parameters: a half-precision rotary buffer would corrupt the oracle itself).
        half = torch.bfloat16 if source == "bf16" else torch.float16
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.to(half).float())
        src = helpers.save_checkpoint(copy.deepcopy(hf).to(half), str(tmp_path / source))
        with Container(src) as c:
            assert c.info("model.layers.0.self_attn.kv_b_proj.weight").dtype == source.upper()
    else:
        src = helpers.save_checkpoint(hf, str(tmp_path / source), fp8=source == "fp8")
    out = tmp_path / "out"
    _convert(src, out, recipe=recipe)
    dequantized = {}
    with Container(out) as c:
        shapes = expected_shapes(c.config)
        quantized = [n for n in c.weight_names() if c.is_quantized(n)]
        assert {c.tensor(n, shapes[n]).fmt for n in quantized} == ({1, 4} if recipe == "default" else {1, 4, 5})
        for name in quantized:
            dequantized[name] = torch.from_numpy(c.tensor(name, shapes[name]).dequantize())
    hf.load_state_dict({**hf.state_dict(), **helpers._unfuse_names(hf, dequantized)}, strict=True)
    tokens = helpers.random_tokens(12, seed=4)
    model, _ = colibri_mlx.load(str(out), dtype="float32")
    got = np.asarray(model(mx.array(tokens)))
    want = np.asarray(helpers.torch_logits(hf, tokens))
    scale = np.abs(want).max()
    assert scale > 0.5 and np.abs(got - want).max() <= 1e-4 * scale
