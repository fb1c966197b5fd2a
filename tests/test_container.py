"""colibri_mlx.container: strict reader, writer layout vs safetensors, shapes vs transformers."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import safetensors.numpy
import torch

from colibri_mlx.container import (
    STAMP_KEY,
    Container,
    ContainerError,
    RawTensor,
    expected_shapes,
    expert_key,
    tensor_class,
    write_shard,
)
from colibri_mlx.formats import QTensor, decode, encode

TINY = dict(
    model_type="deepseek_v3", hidden_size=256, vocab_size=300, num_hidden_layers=3, num_attention_heads=2,
    q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    intermediate_size=96, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
    first_k_dense_replace=1, num_nextn_predict_layers=1, tie_word_embeddings=False,
)


def plan_fmt(name: str):
    """A fmt (and gs) for every weight class so that one container exercises fmt 1-6."""
    if "embed_tokens" in name or "head" in name:
        return 1, None
    if ".mlp.experts." in name:
        if "down_proj" in name:
            return 4, 16
        # gate/up have I = D = 256; fmt 6 only on two experts because its encoder is slow
        return (6, None) if name.startswith(("model.layers.1.mlp.experts.0.", "model.layers.1.mlp.experts.1.")) else (4, 64)
    if "shared_experts" in name:
        return 5, None
    if ".mlp.gate." in name:
        return 0, None  # router stays float32
    if ".mlp." in name:
        return 3, None
    if "kv_b" in name:
        return 4, 32
    return 2, None


def build_tensors(config, rng, plan=plan_fmt) -> dict:
    tensors = {}
    for name, (O, I) in expected_shapes(config).items():
        fmt, gs = plan(name)
        w = rng.standard_normal((O, I)).astype(np.float32)
        if fmt == 0:
            tensors[name] = w
        else:
            packed, scales = encode(fmt, w, gs)
            tensors[name] = QTensor(packed, scales, fmt, O, I, gs, name)
    tensors["model.norm.weight"] = rng.standard_normal(config["hidden_size"]).astype(np.float32)
    return tensors


def write_container(path, tensors: dict, config=TINY, shards: int = 2) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    names = sorted(tensors)
    for k in range(shards):
        write_shard(os.path.join(path, f"out-{k:05d}.safetensors"), {n: tensors[n] for n in names[k::shards]})


def raw_shard(path, header: dict, data: bytes = b"", pad: bool = True) -> None:
    """A shard with exactly this header (for malformed-input tests)."""
    raw = json.dumps(header).encode()
    if pad:
        raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tensors = build_tensors(TINY, np.random.default_rng(7))
    write_container(path, tensors)
    return path, tensors


# -- writer ------------------------------------------------------------------------------------
def _mixed_tensors(rng):
    return {
        "model.layers.0.mlp.experts.10.up_proj.weight": rng.integers(0, 256, 37, dtype=np.uint8),
        "model.layers.0.mlp.experts.1.up_proj.weight": rng.integers(0, 256, 5, dtype=np.uint8),
        "model.layers.0.mlp.experts.1.down_proj.weight": rng.integers(-128, 128, 9, dtype=np.int8),
        "model.layers.0.mlp.experts.1.up_proj.weight.qs": rng.standard_normal(3).astype(np.float32),
        "h": rng.standard_normal((3, 5)).astype(np.float16),
        "ids": rng.integers(-5, 5, 4, dtype=np.int64),
        "uids": rng.integers(0, 5, 2, dtype=np.uint64),
        "empty": np.zeros((0, 4), np.float32),
        "bias": rng.standard_normal(7).astype(np.float32),
    }


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_write_shard_bytes_equal_safetensors_save(tmp_path, metadata):
    tensors = _mixed_tensors(np.random.default_rng(1))
    write_shard(tmp_path / "ours.safetensors", tensors, metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == safetensors.numpy.save(tensors, metadata)


def test_write_shard_qtensor_layout_and_stamp(tmp_path):
    rng = np.random.default_rng(2)
    packed, scales = encode(4, rng.standard_normal((6, 80)).astype(np.float32), 64)
    qt = QTensor(packed, scales, 4, 6, 80, 64, "w")
    norm = rng.standard_normal(6).astype(np.float32)
    write_shard(tmp_path / "q.safetensors", {"w": qt, "norm": norm})
    stamp = json.dumps({"w": {"fmt": 4, "gs": 64}}, separators=(",", ":"))
    expected = safetensors.numpy.save({"w": packed, "w.qs": scales, "norm": norm}, {STAMP_KEY: stamp})
    assert (tmp_path / "q.safetensors").read_bytes() == expected
    loaded = safetensors.numpy.load_file(tmp_path / "q.safetensors")
    assert loaded.keys() == {"w", "w.qs", "norm"}
    assert np.array_equal(loaded["w"], packed) and np.array_equal(loaded["w.qs"], scales)
    assert loaded["w"].dtype == np.uint8 and loaded["w.qs"].dtype == np.float32


def test_write_shard_raw_dtypes_equal_safetensors_torch(tmp_path):
    import safetensors.torch

    g = torch.Generator().manual_seed(3)
    bf = torch.randn(4, 6, generator=g).to(torch.bfloat16)
    f8 = torch.randn(5, generator=g).to(torch.float8_e4m3fn)
    e8 = torch.tensor([1.0, 0.25, 1024.0], dtype=torch.float32).to(torch.float8_e8m0fnu)
    ours = {"bf": RawTensor("BF16", (4, 6), bf.view(torch.int16).numpy()),
            "f8": RawTensor("F8_E4M3", (5,), f8.view(torch.uint8).numpy()),
            "e8": RawTensor("F8_E8M0", (3,), e8.view(torch.uint8).numpy())}
    write_shard(tmp_path / "r.safetensors", ours)
    assert (tmp_path / "r.safetensors").read_bytes() == safetensors.torch.save({"bf": bf, "f8": f8, "e8": e8})


def test_write_shard_is_atomic(tmp_path):
    target = tmp_path / "a.safetensors"
    write_shard(target, {"x": np.arange(4, dtype=np.float32)})
    before = target.read_bytes()
    with pytest.raises(ContainerError, match="'bad'.*float64"):
        write_shard(target, {"y": np.ones(3, np.float32), "bad": np.ones(2, np.float64)})
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["a.safetensors"]  # no leftover .tmp-<pid>


@pytest.mark.parametrize("qt,pattern", [
    (QTensor(np.zeros(12, np.uint8), np.ones(4, np.float32), 1, 4, 4), r"'w': fmt 1 \[4, 4\] gs None needs 16 weight \+ 16"),
    (QTensor(np.zeros(8, np.uint8), np.ones(4, np.float32), 4, 4, 4, None), r"'w': invalid QTensor fmt 4"),
    (QTensor(np.zeros(64, np.uint8), np.ones(0, np.float32), 0, 4, 4), r"'w'.*store fmt 0 as a float32 array"),
])
def test_write_shard_refuses_inconsistent_qtensor(tmp_path, qt, pattern):
    with pytest.raises(ContainerError, match=pattern):
        write_shard(tmp_path / "a.safetensors", {"w": qt})
    assert os.listdir(tmp_path) == []


def test_write_shard_refuses_name_clash_with_qs(tmp_path):
    packed, scales = encode(1, np.ones((2, 4), np.float32))
    with pytest.raises(ContainerError, match=r"w\.qs"):
        write_shard(tmp_path / "a.safetensors", {"w": QTensor(packed, scales, 1, 2, 4), "w.qs": scales})


# -- reader: round trip ------------------------------------------------------------------------
def test_roundtrip_bytes_and_formats(tiny):
    path, tensors = tiny
    c = Container(path)
    assert set(c.weight_names()) == set(tensors)
    seen_fmts = set()
    for name, t in tensors.items():
        got = c.tensor(name)
        if isinstance(t, QTensor):
            assert isinstance(got, QTensor), name
            assert (got.fmt, got.gs, got.O, got.I) == (t.fmt, t.gs, t.O, t.I), name
            assert got.packed.tobytes() == t.packed.tobytes(), name
            assert got.scales.dtype == np.float32 and got.scales.tobytes() == t.scales.tobytes(), name
            seen_fmts.add(t.fmt)
        else:
            assert got.dtype == t.dtype and got.shape == t.shape and got.tobytes() == t.tobytes(), name
    assert seen_fmts == {1, 2, 3, 4, 5, 6}


def test_array_dequantizes_with_the_codec(tiny):
    path, tensors = tiny
    c = Container(path)
    for name in ("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                 "model.layers.1.mlp.shared_experts.up_proj.weight"):
        t = tensors[name]
        ref = decode(t.fmt, t.packed, t.scales, t.O, t.I, t.gs)
        got = c.array(name)
        assert got.dtype == np.float32 and np.abs(ref).max() > 0
        assert np.array_equal(got, ref), name


def test_views_are_lazy_read_only_and_exact(tiny):
    path, tensors = tiny
    c = Container(path)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    q = c.tensor(name)
    assert not q.packed.flags.writeable and not q.packed.flags.owndata
    info = c.info(name)
    assert q.packed.nbytes == info.nbytes
    with open(info.path, "rb") as f:
        f.seek(info.offset)
        assert f.read(info.nbytes) == tensors[name].packed.tobytes()
    assert c.read_bytes(name) == tensors[name].packed.tobytes()


def test_safetensors_load_file_reads_our_container(tiny):
    path, tensors = tiny
    for shard in Container(path).shards:
        for name, arr in safetensors.numpy.load_file(shard).items():
            base = tensors[name[:-3]] if name.endswith(".qs") else tensors[name]
            want = (base.scales if name.endswith(".qs") else base.packed) if isinstance(base, QTensor) else base
            assert np.array_equal(arr, want), name


def test_float_dtype_conversion_matches_torch(tmp_path):
    g = torch.Generator().manual_seed(4)
    bf = (torch.randn(3, 5, generator=g) * 100).to(torch.bfloat16)
    f16 = torch.randn(7, generator=g).to(torch.float16)
    f8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # every bit pattern
    e8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    write_shard(tmp_path / "f.safetensors", {
        "bf": RawTensor("BF16", (3, 5), bf.view(torch.int16).numpy()), "f16": f16.numpy(),
        "f8": RawTensor("F8_E4M3", (256,), f8.view(torch.uint8).numpy()),
        "e8": RawTensor("F8_E8M0", (256,), e8.view(torch.uint8).numpy())})
    c = Container(tmp_path)
    assert c.tensor("bf").dtype == np.uint16 and c.tensor("f8").dtype == np.uint8
    for name, ref in (("bf", bf), ("f16", f16), ("f8", f8), ("e8", e8)):
        want = ref.to(torch.float32).numpy()
        np.testing.assert_array_equal(c.array(name), want, err_msg=name)  # NaN positions must agree too


def test_bf16_and_f16_scales_are_widened(tmp_path):
    rng = np.random.default_rng(5)
    packed, scales = encode(1, rng.standard_normal((4, 8)).astype(np.float32))
    scales16 = scales.astype(np.float16)
    safetensors.numpy.save_file({"w": packed, "w.qs": scales16}, tmp_path / "s.safetensors")
    q = Container(tmp_path).tensor("w", (4, 8))
    assert q.fmt == 1 and q.scales.dtype == np.float32
    assert np.array_equal(q.scales, scales16.astype(np.float32))


def test_ambiguous_unstamped_vs_stamped(tmp_path):
    """gs=64 at I=80 has 2 groups, as gs=48 does: unstamped that is ambiguous, our stamp decides."""
    rng = np.random.default_rng(6)
    packed, scales = encode(4, rng.standard_normal((6, 80)).astype(np.float32), 64)
    (tmp_path / "u").mkdir()
    safetensors.numpy.save_file({"w": packed, "w.qs": scales}, tmp_path / "u" / "a.safetensors")
    res = Container(tmp_path / "u").resolve("w", (6, 80))
    assert res.ambiguous and (4, 48) in res.readings and (4, 64) in res.readings
    write_shard(tmp_path / "s.safetensors", {"w": QTensor(packed, scales, 4, 6, 80, 48)})
    c = Container(tmp_path)
    assert c.stamp("w") == (4, 48)
    res = c.resolve("w", (6, 80))
    q = c.tensor("w", (6, 80))
    assert not res.ambiguous and (q.fmt, q.gs) == (4, 48)


def test_upstream_colibri_fmt_stamp_is_read(tmp_path):
    packed, scales = encode(4, np.random.default_rng(8).standard_normal((6, 80)).astype(np.float32), 64)
    safetensors.numpy.save_file({"w": packed, "w.qs": scales}, tmp_path / "a.safetensors",
                                {"colibri.fmt": json.dumps({"w": "int4-grouped"})})
    c = Container(tmp_path)
    assert c.stamp("w") == "int4-grouped"
    assert c.tensor("w", (6, 80)).fmt == 4


def test_shapes_from_config_or_argument(tmp_path):
    packed, scales = encode(2, np.random.default_rng(9).standard_normal((4, 10)).astype(np.float32))
    write_shard(tmp_path / "a.safetensors", {"w": QTensor(packed, scales, 2, 4, 10)})
    c = Container(tmp_path)
    with pytest.raises(ContainerError, match=r"a\.safetensors.*'w'.*no \[O, I\].*no config\.json"):
        c.tensor("w")
    assert c.tensor("w", (4, 10)).fmt == 2


def test_unknown_model_type_gives_no_shapes(tmp_path):
    # DeepSeek-shaped dimensions under another model_type: the model loader refuses the
    # container, so inspect must not report every tensor as resolving.
    packed, scales = encode(2, np.random.default_rng(9).standard_normal((4, 10)).astype(np.float32))
    write_shard(tmp_path / "a.safetensors", {"w": QTensor(packed, scales, 2, 4, 10)})
    c = Container(tmp_path, config={**TINY, "model_type": "llama"})
    with pytest.raises(ContainerError, match=r"config\.json: cannot derive tensor shapes: .*unknown model_type 'llama'"):
        c.shapes
    assert expected_shapes({k: v for k, v in TINY.items() if k != "model_type"})  # absent = deepseek_v3


# -- reader: malformed input -------------------------------------------------------------------
def _entry(dtype, shape, a, b):
    return {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}


BAD_HEADERS = [
    ({"w": _entry("F32", [2], 0, 16)}, 8, r"'w'.*data_offsets \[0, 16\] out of range"),
    ({"w": _entry("F32", [2], 4, 2)}, 8, r"'w'.*out of range"),
    ({"w": _entry("F32", [2], -1, 7)}, 8, r"'w'.*out of range"),
    ({"a": _entry("U8", [6], 0, 6), "b": _entry("U8", [4], 4, 8)}, 8, r"'b' overlaps tensor 'a'"),
    ({"w": _entry("F64", [1], 0, 8)}, 8, r"'w'.*unsupported dtype 'F64'"),
    ({"w": _entry(7, [1], 0, 4)}, 8, r"'w'.*unsupported dtype"),
    ({"w": _entry("F32", [3], 0, 8)}, 8, r"'w'.*F32 shape \[3\] needs 12 bytes, data_offsets span 8"),
    ({"w": _entry("F32", [-2], 0, 8)}, 8, r"'w'.*non-negative"),
    ({"w": _entry("F32", [True, 2], 0, 8)}, 8, r"'w'.*non-negative integers"),
    ({"w": _entry("U8", [1 << 40, 1 << 40], 0, 8)}, 8, r"'w'.*overflows int64"),
    ({"w": {"dtype": "F32", "shape": [2]}}, 8, r"'w'.*missing \['data_offsets'\]"),
    ({"w": {**_entry("F32", [2], 0, 8), "extra": 1}}, 8, r"'w'.*unknown keys \['extra'\]"),
    ({"w": [1, 2]}, 8, r"'w'.*entry must be an object"),
    ({"__metadata__": {"k": 1}}, 0, r"__metadata__\['k'\] must be a string"),
    ({"__metadata__": [1]}, 0, r"__metadata__ must be an object"),
]


@pytest.mark.parametrize("header,ndata,pattern", BAD_HEADERS)
def test_bad_header_entries(tmp_path, header, ndata, pattern):
    raw_shard(tmp_path / "bad.safetensors", header, bytes(range(ndata)))
    with pytest.raises(ContainerError, match=r"bad\.safetensors.*" + pattern):
        Container(tmp_path)


@pytest.mark.parametrize("content,pattern", [
    (b"\x01\x02", r"is 2 bytes; .*at least 8"),
    (struct.pack("<Q", 100) + b"{}", r"header length 100 runs past the end .*expected <= file size - 8 = 2"),
    (struct.pack("<Q", 3) + b"[1]", r"header must be a JSON object"),
    (struct.pack("<Q", 4) + b"{\"a\"", r"not valid UTF-8 JSON"),
    (struct.pack("<Q", 2) + b"\xff\xfe", r"not valid UTF-8 JSON"),
    (struct.pack("<Q", 8) + b'{"a":NaN', r"not valid UTF-8 JSON"),
    (struct.pack("<Q", 4000) + b"[" * 2000 + b"]" * 2000, r"not valid UTF-8 JSON|must be a JSON object"),
])
def test_bad_files(tmp_path, content, pattern):
    (tmp_path / "bad.safetensors").write_bytes(content)
    with pytest.raises(ContainerError, match=r"bad\.safetensors.*" + pattern):
        Container(tmp_path)


def test_header_length_over_limit(tmp_path, monkeypatch):
    from colibri_mlx.container import safetensors_reader

    monkeypatch.setattr(safetensors_reader, "MAX_HEADER_BYTES", 16)
    raw_shard(tmp_path / "big.safetensors", {"__metadata__": {"k": "v" * 40}})
    with pytest.raises(ContainerError, match=r"big\.safetensors: header length \d+ exceeds the 16-byte limit"):
        Container(tmp_path)


def test_truncated_shard(tmp_path, tiny):
    src = Container(tiny[0]).shards[0]
    data = open(src, "rb").read()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ContainerError, match=r"cut\.safetensors: tensor '.*': data_offsets .* out of range"):
        Container(tmp_path)


@pytest.mark.parametrize("change", ["deleted", "resized"])
def test_shard_changed_after_open(tmp_path, change):
    path = tmp_path / "a.safetensors"
    write_shard(path, {"x": np.arange(4, dtype=np.float32)})
    c = Container(tmp_path)
    if change == "deleted":
        path.unlink()
    else:
        write_shard(path, {"x": np.arange(8, dtype=np.float32)})
    with pytest.raises(ContainerError, match=r"a\.safetensors: .*(cannot map|was \d+ when)"):
        c.tensor("x")
    if change == "deleted":
        with pytest.raises(ContainerError, match=r"a\.safetensors: tensor 'x': cannot read"):
            c.read_bytes("x")


def test_duplicate_name_across_shards(tmp_path):
    write_shard(tmp_path / "a.safetensors", {"x": np.ones(2, np.float32)})
    write_shard(tmp_path / "b.safetensors", {"x": np.ones(2, np.float32), "y": np.ones(1, np.float32)})
    with pytest.raises(ContainerError, match=r"'x' appears in two shards: .*a\.safetensors and .*b\.safetensors"):
        Container(tmp_path)


def test_macos_appledouble_files_are_not_shards(tmp_path):
    write_shard(tmp_path / "out-00000.safetensors", {"x": np.ones(2, np.float32)})
    (tmp_path / "._out-00000.safetensors").write_bytes(b"\x00\x05\x16\x07" + bytes(80))  # AppleDouble
    c = Container(tmp_path)
    assert [os.path.basename(p) for p in c.shards] == ["out-00000.safetensors"]


def test_scales_without_weight(tmp_path):
    write_shard(tmp_path / "a.safetensors", {"w.qs": np.ones(4, np.float32)})
    with pytest.raises(ContainerError, match=r"a\.safetensors: tensor 'w\.qs': scales without a weight"):
        Container(tmp_path)


def test_scales_on_float_weight_or_bad_scale_dtype(tmp_path):
    (tmp_path / "1").mkdir()
    write_shard(tmp_path / "1" / "a.safetensors", {"w": np.ones(4, np.float32), "w.qs": np.ones(1, np.float32)})
    with pytest.raises(ContainerError, match=r"a\.safetensors: tensor 'w'.*is F32; expected U8 or I8"):
        Container(tmp_path / "1")
    (tmp_path / "2").mkdir()
    write_shard(tmp_path / "2" / "a.safetensors", {"w": np.ones(4, np.uint8), "w.qs": np.ones(1, np.int64)})
    with pytest.raises(ContainerError, match=r"'w\.qs': scales are I64; expected F32, BF16 or F16"):
        Container(tmp_path / "2")


def test_weight_without_scales(tmp_path):
    write_shard(tmp_path / "a.safetensors", {"lm_head.weight": np.ones(300 * 256, np.uint8)})
    with open(tmp_path / "config.json", "w") as f:
        json.dump(TINY, f)
    c = Container(tmp_path)
    with pytest.raises(ContainerError, match=r"a\.safetensors: tensor 'lm_head\.weight': U8 weight of 76800 B "
                                             r"for \[300, 256\] has no lm_head\.weight\.qs.*fmt 1 \(int8-row\): "
                                             r"76800 \+ 1200 B"):
        c.tensor("lm_head.weight")


def test_scale_count_matching_no_group_size(tmp_path):
    packed, _ = encode(4, np.ones((6, 80), np.float32), 64)
    write_shard(tmp_path / "a.safetensors", {"w": packed, "w.qs": np.ones(7, np.float32)})
    c = Container(tmp_path)
    with pytest.raises(ContainerError, match=r"a\.safetensors: tensor 'w' \[O=6, I=80\]: weight 240 B \+ scales "
                                             r"28 B match no format.*fmt 4 \(int4-grouped, gs 64\): 240 \+ 48 B"):
        c.tensor("w", (6, 80))


def test_stamp_disagreeing_with_bytes(tmp_path):
    packed, scales = encode(2, np.ones((6, 80), np.float32))
    safetensors.numpy.save_file({"w": packed, "w.qs": scales}, tmp_path / "a.safetensors",
                                {STAMP_KEY: json.dumps({"w": {"fmt": 1, "gs": None}})})
    with pytest.raises(ContainerError, match=r"a\.safetensors: tensor 'w'.*stamp"):
        Container(tmp_path).tensor("w", (6, 80))


@pytest.mark.parametrize("stamps,pattern", [
    ('{"w": {"fmt": 9}}', r"'w': bad colibri_mlx\.formats record"),
    ('{"zz": {"fmt": 1, "gs": null}}', r"'zz': format stamp for a tensor that is not"),
    ("not json", r"is not valid JSON"),
])
def test_bad_stamp_metadata(tmp_path, stamps, pattern):
    packed, scales = encode(1, np.ones((2, 4), np.float32))
    safetensors.numpy.save_file({"w": packed, "w.qs": scales}, tmp_path / "a.safetensors", {STAMP_KEY: stamps})
    with pytest.raises(ContainerError, match=r"a\.safetensors.*" + pattern):
        Container(tmp_path)


def test_float_shape_checked_against_config(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(TINY, f)
    write_shard(tmp_path / "a.safetensors", {"model.layers.1.mlp.gate.weight": np.ones((4, 255), np.float32)})
    with pytest.raises(ContainerError, match=r"'model\.layers\.1\.mlp\.gate\.weight': stored shape \[4, 255\], "
                                             r"expected \[4, 256\]"):
        Container(tmp_path).tensor("model.layers.1.mlp.gate.weight")


def test_empty_directory(tmp_path):
    with pytest.raises(ContainerError, match="no \\*.safetensors"):
        Container(tmp_path)


# -- shapes ------------------------------------------------------------------------------------
def _hf_2d_shapes(config: dict) -> dict:
    """2-D parameter shapes of a randomly initialised transformers model for ``config``."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = {}
    for name, p in model.state_dict().items():
        if p.ndim == 2:
            shapes[name] = tuple(p.shape)
        elif p.ndim == 3 and ".mlp.experts." in name:  # fused experts [E, out, in]
            shapes[name] = tuple(p.shape)
    return shapes


def _fuse_experts(ours: dict, layers: int) -> dict:
    """Our per-expert shapes in transformers' fused-expert layout, MTP layers dropped."""
    out, experts = {}, {}
    for name, shape in ours.items():
        key = expert_key(name)
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer >= layers:
            continue
        if key is None:
            out[name] = shape
            continue
        experts.setdefault((key[0], key[2]), []).append(shape)
    for (layer, proj), shapes in experts.items():
        assert len(set(shapes)) == 1
        O, I = shapes[0]
        if proj == "down":
            out[f"model.layers.{layer}.mlp.experts.down_proj"] = (len(shapes), O, I)
        else:
            prev = out.get(f"model.layers.{layer}.mlp.experts.gate_up_proj", (len(shapes), 0, I))
            out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = (len(shapes), prev[1] + O, I)
    return out


DSV3 = dict(model_type="deepseek_v3", hidden_size=64, vocab_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=12, intermediate_size=80, moe_intermediate_size=24, n_routed_experts=5, n_shared_experts=2,
            first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1)


@pytest.mark.parametrize("config", [
    DSV3,
    {**DSV3, "q_lora_rank": None},
    {**DSV3, "model_type": "deepseek_v32", "index_n_heads": 3, "index_head_dim": 8},
    {**DSV3, "model_type": "glm_moe_dsa", "index_n_heads": 3, "index_head_dim": 8, "num_hidden_layers": 6,
     "first_k_dense_replace": 2, "indexer_types": ["full", "full", "shared", "full", "shared", "shared"]},
], ids=["deepseek_v3", "q_proj", "deepseek_v32", "glm_moe_dsa"])
def test_expected_shapes_match_transformers(config):
    hf = _hf_2d_shapes(config)
    ours = _fuse_experts(expected_shapes(config), config["num_hidden_layers"])
    assert ours == hf


def test_expected_shapes_mtp_and_indexer_schedule():
    config = {**DSV3, "model_type": "glm_moe_dsa", "num_hidden_layers": 8, "num_nextn_predict_layers": 1,
              "index_topk_freq": 4, "index_skip_topk_offset": 3, "index_n_heads": 3, "index_head_dim": 8}
    shapes = expected_shapes(config)
    D, vocab = config["hidden_size"], config["vocab_size"]
    assert shapes["model.layers.8.eh_proj.weight"] == (D, 2 * D)
    assert shapes["model.layers.8.mlp.experts.4.down_proj.weight"] == (D, 24)
    assert shapes["model.layers.8.shared_head.head.weight"] == (vocab, D)
    assert "model.layers.9.eh_proj.weight" not in shapes
    full = sorted(int(n.split(".")[2]) for n in shapes if n.endswith("indexer.wk.weight"))
    assert full == [0, 1, 2, 6]  # upstream's rule: v = max(i - 3 + 1, 0), full iff v % 4 == 0
    assert shapes["model.layers.6.self_attn.indexer.wq_b.weight"] == (24, 32)
    assert shapes["model.layers.6.self_attn.indexer.weights_proj.weight"] == (3, D)
    assert "model.layers.0.mlp.gate_proj.weight" in shapes and "model.layers.0.mlp.gate.weight" not in shapes
    assert shapes["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (48, D)  # moe_inter * n_shared
    tied = expected_shapes({**DSV3, "tie_word_embeddings": True})
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"] == (vocab, D)


@pytest.mark.parametrize("name,cls", [
    ("model.embed_tokens.weight", "embeddings_head"), ("lm_head.weight", "embeddings_head"),
    ("model.norm.weight", "norms_router"), ("model.layers.0.input_layernorm.weight", "norms_router"),
    ("model.layers.0.self_attn.q_a_layernorm.weight", "norms_router"),
    ("model.layers.3.mlp.gate.weight", "norms_router"), ("model.layers.3.mlp.gate.e_score_correction_bias", "norms_router"),
    ("model.layers.0.self_attn.kv_b_proj.weight", "attention"), ("model.layers.0.self_attn.o_proj.weight.qs", "attention"),
    ("model.layers.0.mlp.down_proj.weight", "dense_mlp"),
    ("model.layers.3.mlp.shared_experts.up_proj.weight", "shared_experts"),
    ("model.layers.3.mlp.experts.17.up_proj.weight", "routed_experts"),
    ("model.layers.3.self_attn.indexer.wk.weight", "indexer"), ("model.layers.3.self_attn.indexer.k_norm.bias", "indexer"),
    ("model.layers.61.eh_proj.weight", "mtp"), ("model.layers.61.mlp.experts.0.up_proj.weight", "mtp"),
])
def test_tensor_class(name, cls):
    assert tensor_class(name, num_hidden_layers=61) == cls


def test_expert_key():
    assert expert_key("model.layers.3.mlp.experts.17.down_proj.weight.qs") == (3, 17, "down")
    assert expert_key("model.layers.3.mlp.shared_experts.down_proj.weight") is None
