"""mlx-lm checkpoints (``mlx_lm.convert`` output) loaded by colibri_mlx, against mlx-lm itself.

Tiny random DeepSeek-V3 and GLM-5 (DSA) Hugging Face checkpoints (tests/helpers_models.py, widths
of 128 so every group size quantizes the projections) are converted with ``mlx_lm.convert``; each
result is loaded by ``mlx_lm.load`` (cast to float32) and by ``colibri_mlx.load`` (float32):

* logits of a 12-token prompt agree to 1e-5 relative to their largest magnitude (both decode the
  same stored codes exactly; the difference is float32 summation order);
* 32 greedy tokens, each decoded with the model's cache, are identical;
* expert streaming (``ram_gb``) gives the same logits, reading each expert's rows of the stacked
  tensors and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest

mlx_lm = pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")
import mlx.core as mx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers_models import build_hf_model, save_checkpoint  # noqa: E402

WIDE = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, kv_lora_rank=128, q_lora_rank=128,
            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
DSA = dict(index_topk=8, index_n_heads=8, index_head_dim=32)  # every layer its own indexer, as mlx-lm reads it
ARCHS = {"v3": ("deepseek_v3", {}), "glm": ("glm_moe_dsa", DSA)}
REL_TOL = 1e-5
GREEDY_TOKENS = 32

FAST = [
    ("v3", dict(q_bits=4, q_group_size=64)),
    ("v3", dict(q_bits=3, q_group_size=32)),      # 3-bit codes straddle uint32 words
    ("v3", dict(q_bits=6, q_group_size=128)),
    ("v3", dict(q_mode="mxfp4")),
    ("v3", dict(quant_predicate="mixed_3_4")),     # per-module bits in config.json
    ("glm", dict(q_bits=4, q_group_size=64)),     # DSA indexer projections quantized too
]
# BF16 checkpoints (what the hub holds): bfloat16 scales and biases.
BF16 = ("v3", dict(q_bits=4, q_group_size=64, dtype="bfloat16"))
SLOW = [("v3", dict(q_bits=b, q_group_size=g)) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
SLOW += [("v3", dict(q_mode="mxfp8")), ("v3", dict(q_mode="nvfp4")), ("glm", dict(q_mode="mxfp4")),
         ("v3", dict(quant_predicate="mixed_2_6")), ("v3", dict(quant_predicate="mixed_4_6"))]


def _case_id(case):
    arch, kw = case
    label = {"quant_predicate": "recipe"}
    return arch + "-" + "-".join(f"{label.get(k, k.removeprefix('q_'))}{v}" for k, v in kw.items())


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx_lm_hf")
    out = {}
    for key, (arch, extra) in ARCHS.items():
        model = build_hf_model(arch, seed=3, **WIDE, **extra)
        out[key] = save_checkpoint(model, str(root / key))
        if arch == "glm_moe_dsa":   # keys GLM-5's config.json has and mlx-lm's glm_moe_dsa requires
            _edit_config(out[key], lambda c: c.update(topk_method="noaux_tc", scoring_func="sigmoid",
                                                      moe_layer_freq=1))
    return out


_converted: dict = {}


def converted(hf_dirs, tmp_path_factory, case) -> str:
    key = _case_id(case)
    if key not in _converted:
        arch, kw = case
        out = str(tmp_path_factory.getbasetemp() / "mlx_lm_q" / key)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        mlx_lm.convert(hf_dirs[arch], out, quantize=True, **kw)
        _converted[key] = out
    return _converted[key]


def _ours(path, **options):
    import colibri_mlx

    model, _ = colibri_mlx.load(path, dtype="float32", **options)
    return model


def _theirs(path):
    """mlx-lm's model computing in float32: every float parameter widened except the quantization
    scales and biases, which stay as stored (what ``quantized_matmul`` reads)."""
    from mlx.utils import tree_map_with_path

    model, _ = mlx_lm.load(path)
    model.update(tree_map_with_path(
        lambda p, v: v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) and
        not p.endswith((".scales", ".biases")) else v,
        model.parameters()))
    return model


def _prompt(n=12, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, 256, (1, n)).astype(np.int32))


def _greedy(model, cache, prompt, n):
    tokens, x = [], prompt
    for _ in range(n):
        logits = model(x, cache=cache)
        tok = int(mx.argmax(logits[0, -1]).item())
        tokens.append(tok)
        x = mx.array([[tok]], dtype=mx.int32)
    return tokens


def check_against_mlx_lm(path):
    from mlx_lm.models.cache import make_prompt_cache

    ours, theirs = _ours(path), _theirs(path)
    prompt = _prompt()
    want, got = np.array(theirs(prompt)), np.array(ours(prompt))
    assert np.abs(want).max() > 1.0   # O(1) logits: a relative bound that means something
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel <= REL_TOL, f"{path}: logits differ from mlx-lm by {rel:.2e} relative"
    assert _greedy(ours, ours.make_cache(), prompt, GREEDY_TOKENS) == \
        _greedy(theirs, make_prompt_cache(theirs), prompt, GREEDY_TOKENS)
    return ours


@pytest.mark.parametrize("case", FAST, ids=_case_id)
def test_logits_and_greedy_match_mlx_lm(hf_dirs, tmp_path_factory, case):
    path = converted(hf_dirs, tmp_path_factory, case)
    model = check_against_mlx_lm(path)
    from colibri_mlx.models.loading import quantized_tensors

    fmts = {qt.fmt for qt in quantized_tensors(model)}
    want = {"mxfp4": {8}, "nvfp4": {9}, "mxfp8": {10}}.get(case[1].get("q_mode"), {7})
    assert want <= fmts, f"expected QTensor fmt {want}, the model holds {fmts}"


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=_case_id)
def test_every_format_matches_mlx_lm(hf_dirs, tmp_path_factory, case):
    check_against_mlx_lm(converted(hf_dirs, tmp_path_factory, case))


def _expert_bytes(path, layer):
    """Bytes of one expert of ``layer``: 1/E of every switch_mlp tensor of that layer."""
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    from colibri_mlx.container import Container

    c = Container(path)
    stacked = [n for n in names if n.startswith(f"model.layers.{layer}.mlp.switch_mlp.")]
    assert len(stacked) == 9   # gate, up, down x weight, scales, biases
    return sum(c.info(n).nbytes // c.info(n).shape[0] for n in stacked)


def test_streaming_reads_one_row_of_each_stacked_tensor(hf_dirs, tmp_path_factory):
    path = converted(hf_dirs, tmp_path_factory, FAST[0])
    resident = _ours(path)
    streamed = _ours(path, ram_gb=1e-5, prefetch=False, record_usage=False)
    prompt = _prompt()
    want = np.array(resident(prompt))
    x = np.array(streamed(prompt))
    assert np.array_equal(x, want)
    report = streamed.expert_store.report()
    assert report["reads"] > 0 and report["misses"] == report["reads"]
    per_expert = _expert_bytes(path, 1)
    layouts = streamed.expert_store.layouts
    assert {layouts[k].nbytes for k in layouts} == {per_expert}
    assert report["bytes_read"] == report["reads"] * per_expert


def test_inspect_reports_mlx_lm_format(hf_dirs, tmp_path_factory):
    from click.testing import CliRunner

    from colibri_mlx.cli import main

    path = converted(hf_dirs, tmp_path_factory, FAST[3])
    result = CliRunner().invoke(main, ["inspect", path])
    assert result.exit_code == 0, result.output
    assert "format: mlx-lm mxfp4 4-bit g32" in result.output
    assert re.search(r"switch_mlp\.gate_proj\.weight +mlx-mxfp4-4b +32 +128 x 128 ", result.output)
    # 8 experts x 2 MoE layers; an expert: 3 projections x 128 rows x (64 bytes of codes + 4 E8M0 scales)
    assert "routed experts: 16, 26.11 KB each" in result.output


def _copy(path, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return str(dst)


def _edit_config(path, edit):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    edit(config)
    with open(cfg_path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["quantization"].update(bits=7), "bits"),
    (lambda c: c["quantization"].update(mode="int4"), "mode 'int4'"),
    (lambda c: c["quantization"].update(bits="4"), "integer bits"),
    (lambda c: c["quantization"].update(bits=8), "does not match affine bits=8"),
    (lambda c: c["quantization"].update({"model.layers.0.self_attn.o_proj": False}), "quantization says it is not"),
    (lambda c: c["quantization"].update({"model.layers.1.mlp.switch_mlp.gate_proj": dict(
        group_size=16, bits=4, mode="nvfp4", global_scale=True)}), "global_scale is not supported"),
])
def test_bad_quantization_dict_names_the_problem(hf_dirs, tmp_path_factory, tmp_path, edit, message):
    path = _copy(converted(hf_dirs, tmp_path_factory, FAST[0]), tmp_path)
    _edit_config(path, edit)
    with pytest.raises(ValueError, match="config.json|safetensors") as info:
        _ours(path)
    assert message in str(info.value)


def test_missing_scales_names_the_tensor(hf_dirs, tmp_path_factory, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _copy(converted(hf_dirs, tmp_path_factory, FAST[0]), tmp_path)
    shard = os.path.join(path, "model.safetensors")
    tensors = load_file(shard)
    del tensors["model.layers.0.self_attn.o_proj.scales"]
    save_file(tensors, shard, metadata={"format": "mlx"})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight'.*"
                                         r"'model\.layers\.0\.self_attn\.o_proj\.scales' is missing"):
        _ours(path)


def test_nvfp4_global_scale_is_refused_naming_the_tensor(hf_dirs, tmp_path_factory, tmp_path):
    """mlx-lm's per-expert nvfp4 global scale multiplies every weight (as mx.dequantize applies it:
    checked here), so a checkpoint holding one is refused, not decoded without it."""
    from safetensors.numpy import load_file, save_file

    w = mx.random.normal((4, 64), key=mx.random.key(1))
    g = mx.max(mx.abs(w)).astype(mx.float32)
    q, s = mx.quantize(w, 16, 4, mode="nvfp4", global_scale=g)
    with_g = mx.dequantize(q, s, None, 16, 4, mode="nvfp4", global_scale=g, dtype=mx.float32)
    without = mx.dequantize(q, s, None, 16, 4, mode="nvfp4", dtype=mx.float32)
    assert not mx.allclose(with_g, without)

    path = _copy(converted(hf_dirs, tmp_path_factory, FAST[0]), tmp_path)
    shard = os.path.join(path, "model.safetensors")
    tensors = load_file(shard)
    name = "model.layers.1.mlp.switch_mlp.gate_proj.global_scale"
    tensors[name] = np.ones((tensors["model.layers.1.mlp.switch_mlp.gate_proj.weight"].shape[0],), np.float32)
    save_file(tensors, shard, metadata={"format": "mlx"})
    with pytest.raises(ValueError, match=re.escape(repr(name)) + ".*global_scale is not supported"):
        _ours(path)


def _fake_hub_cache(cache, repo, src):
    """``src``'s files as the snapshot of ``repo`` in a Hugging Face hub cache laid out as
    huggingface_hub writes it (refs/main -> snapshots/<commit>/)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(src, root / "snapshots" / commit)
    return str(root / "snapshots" / commit)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_from_the_cache(hf_dirs, tmp_path_factory, offline_hub, monkeypatch):
    from colibri_mlx.models.modeldir import resolve_model_path

    snapshot = _fake_hub_cache(offline_hub, "mlx-community/Tiny-V3-4bit",
                               converted(hf_dirs, tmp_path_factory, FAST[0]))
    monkeypatch.chdir(offline_hub)   # no local directory of that name
    assert os.path.samefile(resolve_model_path("mlx-community/Tiny-V3-4bit"), snapshot)
    model = _ours("mlx-community/Tiny-V3-4bit")
    want = np.array(_ours(snapshot)(_prompt()))
    assert np.array_equal(np.array(model(_prompt())), want)


def test_hub_id_offline_and_not_cached_says_so(offline_hub, monkeypatch):
    from click.testing import CliRunner

    from colibri_mlx.cli import main

    monkeypatch.chdir(offline_hub)
    result = CliRunner().invoke(main, ["generate", "-m", "mlx-community/Not-Cached-4bit", "-p", "hi"])
    assert result.exit_code != 0
    assert "not in the cache" in result.output and "HF_HUB_OFFLINE" in result.output, result.output


def test_local_directory_wins_over_a_hub_id(tmp_path, monkeypatch):
    from colibri_mlx.models.modeldir import resolve_model_path

    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("owner/name") == "owner/name"


def test_bfloat16_scales_match_mlx_lm(hf_dirs, tmp_path_factory):
    from colibri_mlx.container import Container

    path = converted(hf_dirs, tmp_path_factory, BF16)
    assert Container(path).info("lm_head.scales").dtype == "BF16"
    check_against_mlx_lm(path)


def test_cli_generate_streams_an_mlx_lm_checkpoint(hf_dirs, tmp_path_factory):
    from click.testing import CliRunner

    from colibri_mlx.cli import main

    from colibri_mlx.kernels import dispatch

    path = converted(hf_dirs, tmp_path_factory, FAST[0])
    dispatch.reset_counters()   # process-wide: another test file's declines may have run in this worker
    result = CliRunner().invoke(main, ["generate", "-m", path, "-p", "In the beginning", "--max-tokens", "4",
                                       "--ram-gb", "0.0001", "--no-chat-template"])
    assert result.exit_code == 0, result.output
    assert "generation: 4 tokens" in result.output and "expert hit rate" in result.output
    assert "fallback 0" in result.output


def _container_of(hf_dir: str, out_dir: str) -> str:
    """The same Hugging Face weights as a container: every projection fmt 4 g64, the embedding a
    float table (as the end-to-end bench's container model), norms and router float."""
    import glob

    from safetensors.numpy import load_file

    from helpers_models import write_container

    state = {}
    for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        state.update({k: v.astype(np.float32) for k, v in load_file(f).items()})

    def fmt4(name, shape):
        if len(shape) != 2 or "norm" in name or "mlp.gate.weight" in name or "embed_tokens" in name:
            return None
        return (4, 64)

    write_container(state, hf_dir, out_dir, fmt4)
    return out_dir


def _decode_step_record(model, monkeypatch, compile_mode: str):
    """One decode step on the GPU path (every launch stubbed, the whole step one graph): the
    custom-kernel launches it built, the dispatch counters, and the launching primitives of the
    step's graph (compiled blocks merged into ``Compiled``, views left out)."""
    import tempfile
    from collections import Counter

    from colibri_mlx.kernels import compiled, dispatch
    from colibri_mlx.models import deepseek_v3

    monkeypatch.setenv("COLIBRI_COMPILE", compile_mode)
    compiled.clear()
    cache = model.make_cache()
    mx.eval(model(_prompt(4), cache))
    token = mx.array([[5]], dtype=mx.int32)
    for _ in range(3):                 # warm-up and trace (kernels.compiled)
        mx.eval(model(token, cache))
    dispatch.reset_counters()
    launched = _LAUNCHED
    launched.clear()
    out = model(token, cache)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out, *[b for lc in cache.layers for b in lc.buffers.values()])
        names = re.findall(r'label ="([^"]+)", shape=rectangle', f.read())
    mx.eval(out)
    views = {"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "Transpose", "AsStrided", "StopGradient"}
    nodes = Counter("Compiled" if n.startswith("Compiled") else n.split("(")[0].strip() for n in names)
    nodes = Counter({k: v for k, v in nodes.items() if k not in views})
    assert deepseek_v3.commits_layers(1) is False
    return Counter(launched), dispatch.counters(), nodes


_LAUNCHED: list = []


def test_decode_step_launches_as_the_container(hf_dirs, tmp_path_factory, tmp_path, monkeypatch):
    """An mlx-lm affine 4-bit g64 checkpoint decodes with the same kernels, as many of each, as
    the same weights in a fmt 4 g64 container, on the GPU path (launches stubbed): every block
    compiled (no decline counted), the lm head and the MLA kv_b on the kernels, nothing per
    step outside the compiled graphs but the embedding's row lookup (its quantized table: two
    more row gathers and the decode, itself a compiled graph)."""
    from colibri_mlx.kernels import dispatch
    from colibri_mlx.models import deepseek_v3

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "scripts", "bench"))
    from bench_build import stub_launch

    stub = stub_launch(keep_inputs=True)

    def launch(backend, spec):
        _LAUNCHED.append(spec.name)
        return stub(backend, spec)

    ours = _ours(converted(hf_dirs, tmp_path_factory, FAST[0]))
    container = _ours(_container_of(hf_dirs["v3"], str(tmp_path / "c")))
    monkeypatch.setattr(dispatch, "launch", launch)
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: dispatch.CUDA)
    monkeypatch.setattr(dispatch, "backend", lambda: dispatch.CUDA)
    monkeypatch.setattr(deepseek_v3, "commits_layers", lambda L: False)   # the whole step one graph
    plain = {name: _decode_step_record(m, monkeypatch, "0") for name, m in (("mlx", ours), ("container", container))}
    assert plain["mlx"][0] == plain["container"][0] and sum(plain["mlx"][0].values()) > 0, plain
    assert {"qgemv", "mla_qb_qabs", "moe_gate_up", "moe_down"} <= set(plain["mlx"][0]), plain["mlx"][0]
    steps = {name: _decode_step_record(m, monkeypatch, "1") for name, m in (("mlx", ours), ("container", container))}
    for name, (_, counters, _) in steps.items():
        assert not counters["fallbacks"], (name, counters)
        assert not [k for k in counters["calls"] if "declined" in k], (name, counters["calls"])
    assert steps["mlx"][1]["calls"] == steps["container"][1]["calls"], steps
    extra = steps["mlx"][2] - steps["container"][2]
    assert extra == {"Gather": 2, "Compiled": 2} and not steps["container"][2] - steps["mlx"][2], (
        f"launching nodes of the mlx-lm step beyond the container's: {dict(extra)}; "
        f"mlx-lm {dict(steps['mlx'][2])}, container {dict(steps['container'][2])}")


# The kernel path's VALUES on mlx-lm checkpoints, every launch in the MSL simulator (as on a Mac).
# Both sides decode the same stored codes to float32 and compute in float32; they differ only in
# summation order (per-simdgroup partial sums, per-group sums of x, fused residual adds), an error
# of a few float32 ulps of each dot product: ~1e-6 of the largest logit or hidden value on these
# 128-wide layers, which a wrong code, scale or group offset (an O(1) relative change in a dot
# product) exceeds by orders of magnitude. 2e-5 leaves an order of margin above the ~1e-6 seen.
STEP_REL_TOL = 2e-5
STEP_CASES = [FAST[0], FAST[1], FAST[3], FAST[4]]   # affine 4-bit g64, 3-bit g32, mxfp4, mixed_3_4


def _decode_step_values(model, prompt, token, monkeypatch):
    """The prompt prefilled on the reference path, then one decode step of ``token`` (on whatever
    path is active): the embedding row, every decoder layer's output (the residual stream before
    the next norm) and the float32 logits, as numpy."""
    from colibri_mlx import kernels
    from colibri_mlx.models import deepseek_v3

    cache = model.make_cache()
    with kernels.force_reference():
        mx.eval(model(prompt, cache))
    hidden = []
    layer_call = deepseek_v3.DecoderLayer.__call__

    def record(self, *args, **kw):
        out = layer_call(self, *args, **kw)
        hidden.append(np.array(out[0]))
        return out

    embed = deepseek_v3.embedding_rows

    def record_embed(*args, **kw):
        out = embed(*args, **kw)
        hidden.insert(0, np.array(out.astype(mx.float32)))
        return out

    with monkeypatch.context() as m:
        m.setattr(deepseek_v3.DecoderLayer, "__call__", record)
        m.setattr(deepseek_v3, "embedding_rows", record_embed)
        logits = np.array(model(mx.array([[token]], dtype=mx.int32), cache))
    return hidden, logits


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.msl
@pytest.mark.parametrize("case", STEP_CASES, ids=_case_id)
def test_decode_step_kernel_values_equal_reference(hf_dirs, tmp_path_factory, monkeypatch, case):
    """One decode step (after a 5-token prompt) of an mlx-lm DeepSeek-V3 checkpoint with every
    kernel launch (qgemv, mla_rows_into, mla_qb_qabs, the attention, moe_gate_up / moe_down, the
    lm head) run in the MSL simulator: the embedding row, each layer's output and the logits equal
    the reference path's (kernels.force_reference) to STEP_REL_TOL of their largest magnitude."""
    from colibri_mlx.kernels import dispatch, moe
    from moe_mla_oracle import route_launches_to_simulator, simulator_or_skip

    simulator = simulator_or_skip()
    model = _ours(converted(hf_dirs, tmp_path_factory, case))
    prompt, token = _prompt(5, seed=1), 17
    monkeypatch.setenv("COLIBRI_COMPILE", "0")
    want_h, want = _decode_step_values(model, prompt, token, monkeypatch)
    try:
        launched = route_launches_to_simulator(monkeypatch, simulator)
        got_h, got = _decode_step_values(model, prompt, token, monkeypatch)
        counters = dispatch.counters()
    finally:
        monkeypatch.undo()
        moe.clear_banks()
    assert {"qgemv", "mla_qb_qabs", "moe_gate_up", "moe_down"} <= set(launched), launched
    assert not counters["fallbacks"], counters
    assert len(got_h) == len(want_h) == len(model.layers) + 1
    assert np.abs(want).max() > 1.0   # O(1) logits: a relative bound that means something
    rels = [_rel(g, w) for g, w in zip(got_h, want_h)]
    logit_rel = _rel(got, want)
    top2 = np.sort(want.reshape(-1))[-2:]   # a flip needs a logit difference of about this margin
    print(f"{_case_id(case)}: logits {logit_rel:.2e}, embedding + layers {' '.join(f'{r:.2e}' for r in rels)}; "
          f"reference top-2 margin {top2[1] - top2[0]:.3g} of max |logit| {np.abs(want).max():.3g}")
    assert all(r <= STEP_REL_TOL for r in rels), f"hidden states (embedding, layer 0..) differ by {rels}"
    assert logit_rel <= STEP_REL_TOL, f"logits differ from the reference by {logit_rel:.2e} relative"
    assert np.argmax(got) == np.argmax(want)
