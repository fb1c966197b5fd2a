"""`colibri inspect`: per-tensor fmt/gs/shape/bytes, totals, ambiguity flags, unresolvable verdicts,
weights config.json implies that are missing (required) or absent (optional MTP layer / DSA indexer).

The missing-weight verdict is checked against the loader itself (``load_model``): inspect must fail
exactly the containers the loader refuses."""

from __future__ import annotations

import json
import os
import struct
import warnings

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner

from colibri_mlx.cli import main
from colibri_mlx.container import expected_shapes, write_shard
from colibri_mlx.formats import FMT_NAMES, QTensor, encode
from colibri_mlx.models.loading import load_model

DEMO = os.path.join(os.path.dirname(__import__("colibri_mlx").__file__), "demo")

CONFIG = dict(
    model_type="deepseek_v3", hidden_size=256, vocab_size=64, num_hidden_layers=2, num_attention_heads=1,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    intermediate_size=80, moe_intermediate_size=32, n_routed_experts=2, n_shared_experts=1,
    first_k_dense_replace=1, num_nextn_predict_layers=0, num_experts_per_tok=1,
)
AMBIGUOUS = "model.layers.0.mlp.down_proj.weight"  # [256, 80] int4 gs 64: 2 groups, like gs 48


def plan(name: str):
    table = {
        "embed_tokens": (1, None), "lm_head": (2, None), "q_a_proj": (3, None), "q_b_proj": (5, None),
        "kv_a_proj": (1, None), "kv_b_proj": (2, None), "o_proj": (1, None), "mlp.gate_proj": (4, 64),
        "mlp.up_proj": (4, 32), "mlp.down_proj": (4, 64), "shared_experts": (5, None),
        "experts.0.down": (4, 16), "experts.1.down": (3, None), "experts": (6, None), "mlp.gate.": (0, None),
    }
    for key, fmt_gs in table.items():
        if key in name:
            return fmt_gs
    raise AssertionError(name)


def vectors(config) -> dict[str, int]:
    """The 1-D norms and biases models.deepseek_v3 takes, written out by hand: name -> length."""
    n, mtp = config["num_hidden_layers"], config.get("num_nextn_predict_layers", 0)
    D, dsa = config["hidden_size"], config["model_type"] == "deepseek_v32"
    out = {"model.norm.weight": D}
    for i in range(n + mtp):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": D, p + "post_attention_layernorm.weight": D,
                p + "self_attn.q_a_layernorm.weight": config["q_lora_rank"],
                p + "self_attn.kv_a_layernorm.weight": config["kv_lora_rank"]}
        if i >= config["first_k_dense_replace"]:
            out[p + "mlp.gate.e_score_correction_bias"] = config["n_routed_experts"]
        if dsa:
            out |= {p + "self_attn.indexer.k_norm.weight": config["index_head_dim"],
                    p + "self_attn.indexer.k_norm.bias": config["index_head_dim"]}
        if i >= n:
            out |= {p + "enorm.weight": D, p + "hnorm.weight": D, p + "shared_head.norm.weight": D}
    return out


def build(path, config=CONFIG, corrupt: str | None = None, drop=()) -> dict:
    """Container with fmt 1-6; AMBIGUOUS is written unstamped (as upstream's converter would).
    The names in ``drop`` are left out of it (they stay in the returned dict)."""
    rng = np.random.default_rng(11)
    tensors = {}
    for name, (O, I) in expected_shapes(config).items():
        fmt, gs = plan(name)
        w = rng.standard_normal((O, I)).astype(np.float32)
        tensors[name] = w if fmt == 0 else QTensor(*encode(fmt, w, gs), fmt, O, I, gs, name)
    for name, n in vectors(config).items():
        tensors[name] = rng.standard_normal(n).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    amb = tensors[AMBIGUOUS]
    plain = {AMBIGUOUS: amb.packed, AMBIGUOUS + ".qs": amb.scales}
    if corrupt:
        plain[corrupt + ".qs"] = np.ones(tensors[corrupt].scales.size + 1, np.float32)
    safetensors.numpy.save_file(plain, os.path.join(path, "out-00001.safetensors"))
    write_shard(os.path.join(path, "out-00000.safetensors"),
                {n: t for n, t in tensors.items() if n not in (AMBIGUOUS, corrupt, *drop)})
    if corrupt:
        write_shard(os.path.join(path, "out-00002.safetensors"), {corrupt: tensors[corrupt].packed})
    return tensors


def stored_nbytes(t) -> int:
    return t.packed.nbytes + t.scales.nbytes if isinstance(t, QTensor) else t.nbytes


def data_bytes_on_disk(path) -> int:
    total = 0
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
            total += os.path.getsize(os.path.join(path, f)) - 8 - n
    return total


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect")
    return path, build(path)


def run(*args):
    return CliRunner().invoke(main, ["inspect", *map(str, args)], catch_exceptions=False)


def test_json_report(container):
    path, tensors = container
    result = run(path, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {r["name"]: r for r in report["tensors"]}
    assert rows.keys() == tensors.keys()
    for name, t in tensors.items():
        r = rows[name]
        assert r["nbytes"] == stored_nbytes(t), name
        if isinstance(t, QTensor):
            want_gs = t.gs if t.fmt == 4 else None
            assert (r["fmt"], r["fmt_id"], r["gs"], r["O"], r["I"]) == (FMT_NAMES[t.fmt], t.fmt, want_gs, t.O, t.I), name
        else:
            assert (r["fmt"], r["O"], r["I"]) == ("f32", t.shape[0], t.shape[1] if t.ndim == 2 else None), name
    assert {r["fmt_id"] for r in rows.values() if r["dtype"] == "U8"} == {1, 2, 3, 4, 5, 6}

    totals = report["totals"]
    assert totals["nbytes"] == data_bytes_on_disk(path) == sum(stored_nbytes(t) for t in tensors.values())
    assert sum(v["nbytes"] for v in totals["by_fmt"].values()) == totals["nbytes"]
    assert sum(v["nbytes"] for v in totals["by_class"].values()) == totals["nbytes"]
    assert totals["by_fmt"]["e8-iq3-lattice"]["count"] == 4
    assert totals["by_class"]["routed_experts"]["count"] == 6
    assert totals["by_class"]["dense_mlp"]["count"] == 3
    expert0 = sum(stored_nbytes(tensors[f"model.layers.1.mlp.experts.0.{p}_proj.weight"]) for p in ("gate", "up", "down"))
    expert1 = sum(stored_nbytes(tensors[f"model.layers.1.mlp.experts.1.{p}_proj.weight"]) for p in ("gate", "up", "down"))
    assert report["routed_experts"] == {"count": 2, "nbytes_per_expert": sorted({expert0, expert1})}
    assert report["ambiguous"] == [AMBIGUOUS] and report["unresolved"] == [] and report["ok"]
    assert report["missing"] == report["missing_optional"] == report["optional_absent"] == []
    assert report["missing_check_skipped"] is None
    amb = rows[AMBIGUOUS]
    assert (amb["fmt_id"], amb["gs"]) == (4, 64) and [4, 48] in amb["readings"]


def test_table(container):
    path, tensors = container
    result = run(path)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for name, t in tensors.items():
        (line,) = [ln for ln in lines if ln.split() and ln.split()[0] == name]
        fmt = FMT_NAMES[t.fmt] if isinstance(t, QTensor) else "f32"
        assert line.split()[1] == fmt, line
        assert f"{stored_nbytes(t):,}" in line
        if isinstance(t, QTensor):
            assert f"{t.O} x {t.I}" in line
            assert (line.rstrip().endswith("AMBIGUOUS")) == (name == AMBIGUOUS)
    assert f"AMBIGUOUS {AMBIGUOUS}: ambiguous: bytes fit int4-grouped gs 48, int4-grouped gs 64; read as " \
           f"int4-grouped gs 64; upstream reads int4-grouped gs 48" in result.stdout
    assert "routed experts: 2," in result.stdout
    assert "verdict: all" in result.stdout and "(1 ambiguous" in result.stdout
    assert "every weight config.json requires is present" in result.stdout
    assert "MISSING" not in result.stdout and "absent (optional" not in result.stdout


def test_fixture_container_loads(container):
    """The oracle for the missing-weight tests: the complete container is one the loader accepts."""
    path, _ = container
    load_model(str(path))


def test_unresolvable_tensor_exits_nonzero(tmp_path):
    bad = "model.layers.0.self_attn.q_b_proj.weight"
    build(tmp_path, corrupt=bad)
    result = run(tmp_path)
    assert result.exit_code == 1
    assert f"UNRESOLVED {bad}:" in result.stdout and "match no format" in result.stdout
    assert "verdict: 1 of" in result.stdout and "cannot be read" in result.stdout
    report = json.loads(run(tmp_path, "--json").stdout)
    assert not report["ok"] and [u["name"] for u in report["unresolved"]] == [bad]
    verdict = report["unresolved"][0]["verdict"]
    assert "out-00002.safetensors: tensor" in verdict and "(scales in " in verdict and "out-00001" in verdict


def test_weight_without_scales_is_unresolved(tmp_path):
    write_shard(tmp_path / "a.safetensors", {"lm_head.weight": np.ones(64 * 256, np.uint8)})
    with open(tmp_path / "config.json", "w") as f:
        json.dump(CONFIG, f)
    result = run(tmp_path, "--json")
    assert result.exit_code == 1
    (u,) = json.loads(result.stdout)["unresolved"]
    assert u["name"] == "lm_head.weight" and "has no lm_head.weight.qs" in u["verdict"]


def test_malformed_shard_is_a_clean_error(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 1
    assert "bad.safetensors: header length 1000 runs past the end" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


# -- weights config.json implies that the container lacks ------------------------------------
DSA = dict(CONFIG, model_type="deepseek_v32", hidden_size=64, num_nextn_predict_layers=1, index_n_heads=2,
           index_head_dim=16, index_topk=8)
MTP_LAYER = f"model.layers.{DSA['num_hidden_layers']}."


def build_plain(path, config, drop=()) -> list[str]:
    """Every tensor float32, in one shard, less ``drop``; returns the stored names."""
    rng = np.random.default_rng(5)
    tensors = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in expected_shapes(config).items()}
    tensors |= {n: rng.standard_normal(size).astype(np.float32) for n, size in vectors(config).items()}
    assert set(drop) <= tensors.keys()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    write_shard(os.path.join(path, "out-00000.safetensors"), {n: t for n, t in tensors.items() if n not in drop})
    return sorted(tensors)


def loader_accepts(path) -> bool:
    """The oracle: does colibri_mlx's loader take this container?"""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the dense-attention notice of a DSA model without indexer
            load_model(str(path))
    except ValueError as e:
        assert "missing tensor" in str(e) or "not used by this config.json" in str(e), e
        return False
    return True


def experts_of(layer, *ids, projections=("gate", "up", "down")):
    return [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for e in ids for p in projections]


LAYER_1 = sorted(n for n in expected_shapes(CONFIG).keys() | vectors(CONFIG).keys() if n.startswith("model.layers.1."))


@pytest.mark.parametrize("drop, lines", [
    (experts_of(1, 0, projections=("down",)) + experts_of(1, 1),
     ["layer 1: expert 0 (down); expert 1 (gate/up/down)"]),
    (LAYER_1, [f"layer 1: every weight ({len(LAYER_1)} tensors)"]),  # convert --n-layers 1 of 2
    (["model.norm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight", "lm_head.weight"],
     ["lm_head.weight", "model.norm.weight", "layer 0: self_attn.kv_a_layernorm.weight"]),
], ids=["experts", "layer", "norms"])
def test_missing_required_weights_fail(tmp_path, drop, lines):
    build(tmp_path, drop=drop)
    assert not loader_accepts(tmp_path)
    result = run(tmp_path)
    assert result.exit_code == 1, result.output
    out = result.stdout.splitlines()
    start = out.index(f"MISSING {len(drop)} weights config.json implies:")
    assert out[start + 1: start + 1 + len(lines)] == [f"  {line}" for line in lines]
    assert f"verdict: {len(drop)} weights config.json requires are missing, colibri_mlx.load refuses" \
           in result.stdout
    report = json.loads(run(tmp_path, "--json").stdout)
    assert not report["ok"] and sorted(report["missing"]) == sorted(drop)
    assert report["missing_optional"] == [] and report["unresolved"] == []


def test_mtp_layer_and_indexer_absent_are_optional(tmp_path):
    names = build_plain(tmp_path, DSA)
    dropped = [n for n in names if n.startswith(MTP_LAYER) or ".self_attn.indexer." in n]
    for f in os.listdir(tmp_path):
        os.remove(tmp_path / f)
    build_plain(tmp_path, DSA, drop=dropped)
    assert loader_accepts(tmp_path)
    result = run(tmp_path)
    assert result.exit_code == 0, result.output
    n_mtp = sum(n.startswith(MTP_LAYER) for n in dropped)
    assert (f"absent (optional: MTP layer 2, written only by `colibri convert --mtp`; without it generation "
            f"drafts with `--draft ngram` or none): {n_mtp} tensors") in result.stdout
    assert f"absent (optional: DSA indexer, written only by `colibri convert --indexer`; without it the model " \
           f"runs dense attention" in result.stdout
    assert f"): {len(dropped) - n_mtp} tensors" in result.stdout
    assert "MISSING" not in result.stdout and "every weight config.json requires is present" in result.stdout
    report = json.loads(run(tmp_path, "--json").stdout)
    assert report["ok"] and report["missing"] == []
    assert sorted(report["missing_optional"]) == sorted(dropped)
    assert {a["part"]: a["count"] for a in report["optional_absent"]} == {"mtp": n_mtp, "indexer": len(dropped) - n_mtp}


@pytest.mark.parametrize("drop, required", [
    (["model.layers.1.self_attn.indexer.wk.weight", "model.layers.1.self_attn.indexer.k_norm.bias"], True),
    ([MTP_LAYER + "enorm.weight"], True),
    ([MTP_LAYER + "eh_proj.weight", MTP_LAYER + "mlp.experts.0.up_proj.weight"], True),
    ([MTP_LAYER + "embed_tokens.weight", MTP_LAYER + "shared_head.head.weight"], False),
    (["model.layers.1.mlp.gate.e_score_correction_bias"], True),
    ([MTP_LAYER + "self_attn.indexer." + t for t in ("wq_b.weight", "wk.weight", "weights_proj.weight",
                                                     "k_norm.weight", "k_norm.bias")], False),
    ([MTP_LAYER + "self_attn.indexer.wk.weight"], True),
], ids=["part-of-indexer", "mtp-norm", "mtp-eh_proj", "mtp-embed-head-copies", "router-bias",
        "mtp-indexer", "part-of-mtp-indexer"])
def test_stored_optional_part_must_be_whole(tmp_path, drop, required):
    """An MTP layer or indexer that is stored at all must be complete; verdict == the loader's."""
    build_plain(tmp_path, DSA, drop=drop)
    assert loader_accepts(tmp_path) is not required
    result = run(tmp_path, "--json")
    assert result.exit_code == (1 if required else 0), result.output
    report = json.loads(result.stdout)
    assert sorted(report["missing" if required else "missing_optional"]) == sorted(drop)
    assert report["missing_optional" if required else "missing"] == []


def test_demo_model_has_every_weight():
    result = run(DEMO, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and report["missing"] == []
    # The MTP head (layer 4) shares the main embedding and lm_head: no copies stored.
    assert report["missing_optional"] == ["model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight"]
    assert [a["part"] for a in report["optional_absent"]] == ["mtp_copy"]
    assert report["missing_check_skipped"] is None and len(report["tensors"]) > 100


def test_without_config_the_check_is_skipped_and_said(tmp_path):
    write_shard(tmp_path / "a.safetensors", {"model.norm.weight": np.arange(4, dtype=np.float32)})
    result = run(tmp_path)
    assert result.exit_code == 0, result.output
    assert "missing-weight check skipped: the container has no config.json" in result.stdout
    assert "every weight config.json requires" not in result.stdout


def test_hub_id_resolves_from_the_cache(container, tmp_path, monkeypatch):
    """A hub id is inspected from the hub cache's snapshot, as generate resolves it; one that is
    not cached while offline, or a missing path, is a clean error."""
    import shutil

    from huggingface_hub import constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / "models--owner--Tiny-Container"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(container[0], root / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)                         # no local directory of that name
    by_id = run("--json", "owner/Tiny-Container")
    assert by_id.exit_code == 0, by_id.output
    got, want = json.loads(by_id.stdout), json.loads(run("--json", container[0]).stdout)
    assert got.pop("path").endswith(os.path.join("snapshots", commit))
    assert {k: v for k, v in want.items() if k != "path"} == got
    missing = run("owner/Not-Cached")
    assert missing.exit_code != 0 and "not in the cache" in missing.output, missing.output
    absent = run(tmp_path / "nowhere")
    assert absent.exit_code != 0 and "no such file or directory" in absent.output, absent.output
