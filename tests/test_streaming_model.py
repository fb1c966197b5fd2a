"""Expert streaming end to end: a tiny DeepSeek-V3 container run fully resident and streamed.

The oracle is the fully resident run of the same container (same kernels, every expert in
memory): for any budget, down to nothing cached, the streamed run must give bit-identical logits
and tokens. Router top-p is checked against a float64 numpy re-implementation of upstream's rule.
Peak RSS is measured in a subprocess (/proc/self/status VmHWM) with experts several times the budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import mlx.core as mx
import numpy as np
import pytest

from colibri_mlx.container import expected_shapes, write_shard
from colibri_mlx.experts import ExpertStoreError, read_usage
from colibri_mlx.formats import QTensor, encode
from colibri_mlx.models import load_model

# Per-expert formats cycle through these (fmt, gs): the store must carry each expert's own fmt.
EXPERT_FORMATS = ((4, 32), (1, None), (5, None), (2, None), (3, None))
CONFIG = dict(
    model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu",
)


def build_container(path, seed: int = 0, **overrides) -> dict:
    """A random tiny container (fmt 4 spine, mixed-fmt experts, two shards split at layer 2); returns its config."""
    config = dict(CONFIG, **overrides)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (O, I) in expected_shapes(config).items():
        w = (rng.standard_normal((O, I)) / (1 if "embed" in name else np.sqrt(I))).astype(np.float32)
        if name.endswith("mlp.gate.weight"):
            tensors[name] = 3 * w  # router stays float; sharper scores spread the selections
            continue
        m = re_expert(name)
        fmt, gs = EXPERT_FORMATS[m % len(EXPERT_FORMATS)] if m is not None else (4, 32)
        packed, scales = encode(fmt, w, gs)
        tensors[name] = QTensor(packed, scales, fmt, O, I, gs, name)
    D = config["hidden_size"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n, size in (("input_layernorm", D), ("post_attention_layernorm", D),
                        ("self_attn.q_a_layernorm", config["q_lora_rank"]),
                        ("self_attn.kv_a_layernorm", config["kv_lora_rank"])):
            tensors[p + n + ".weight"] = (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)
        if i >= config["first_k_dense_replace"]:
            tensors[p + "mlp.gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(
                config["n_routed_experts"])).astype(np.float32)
    tensors["model.norm.weight"] = np.ones(D, np.float32)
    os.makedirs(path, exist_ok=True)
    later = {n for n in tensors if n.startswith("model.layers.") and int(n.split(".")[2]) >= 2}
    write_shard(os.path.join(path, "out-00000.safetensors"), {n: t for n, t in tensors.items() if n not in later})
    write_shard(os.path.join(path, "out-00001.safetensors"), {n: tensors[n] for n in later})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return config


def re_expert(name: str):
    parts = name.split(".")
    return int(parts[5]) if len(parts) > 5 and parts[3] == "mlp" and parts[4] == "experts" else None


PROMPT = [5, 17, 33, 2, 60, 41, 8, 19, 27, 50, 3, 11]


def run(model, steps: int = 6):
    """Greedy: prefill PROMPT, then ``steps`` decode tokens; (tokens, stacked float32 logits)."""
    cache = model.make_cache()
    logits = model(mx.array([PROMPT]), cache)
    outs = [np.array(logits[0])]
    token = int(mx.argmax(logits[0, -1]).item())
    tokens = [token]
    for _ in range(steps):
        logits = model(mx.array([[token]]), cache)
        outs.append(np.array(logits[0]))
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
    return tokens, np.concatenate(outs)


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "model"
    build_container(str(path))
    return str(path)


@pytest.fixture(scope="module")
def resident(container):
    return run(load_model(container))


def expert_bytes(model) -> int:
    return max(l.nbytes for l in model.expert_store.layouts.values())


@pytest.mark.parametrize("budget", ["zero", "one_per_layer", "half", "all"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_streamed_run_is_bit_identical_to_resident(container, resident, budget, prefetch, tmp_path):
    probe = load_model(container, ram_gb=0, record_usage=False)
    one, total = expert_bytes(probe), probe.expert_store.total_expert_bytes
    n_moe = len(probe.expert_store.moe_layers)
    probe.expert_store.close()
    ram = {"zero": 0, "one_per_layer": n_moe * one, "half": total // 2, "all": total}[budget]
    model = load_model(container, ram_gb=ram / 1e9, prefetch=prefetch, usage_path=str(tmp_path / "u"))
    store = model.expert_store
    assert store.budget_bytes == ram
    tokens, logits = run(model)
    assert tokens == resident[0]
    np.testing.assert_array_equal(logits, resident[1])
    r = store.report()
    assert r["cached_bytes"] <= ram
    assert r["lookups"] > 0 and r["hits_pinned"] == 0
    if budget == "zero":
        assert r["hits_lru"] == 0
    if budget == "all":
        assert r["misses"] + r["hits_prefetch"] <= len(store.layouts)  # every expert read at most once
    assert r["tokens"] == len(PROMPT) + 6
    store.close()


def test_pinned_from_usage_history_and_written_back(container, resident, tmp_path):
    usage = str(tmp_path / ".coli_usage")
    first = load_model(container, ram_gb=1.0, usage_path=usage)
    run(first)
    first.expert_store.save_usage()
    first.expert_store.close()
    history = read_usage(usage)
    assert history.total == (len(PROMPT) + 6) * CONFIG["num_experts_per_tok"] * 3  # 3 MoE layers
    one = max(l.nbytes for l in first.expert_store.layouts.values())
    model = load_model(container, ram_gb=8 * one / 1e9, pin="auto", pin_gb=5 * one / 1e9, usage_path=usage,
                       record_usage=False)
    store = model.expert_store
    assert len(store.pinned_keys) >= 5 and store.pinned_reserved <= 5 * one
    # Greedy by count: every expert hotter than a pinned one was pinned, or did not fit.
    order = history.hottest()
    last = max(order.index(k) for k in store.pinned_keys)
    skipped = [k for k in order[:last] if k not in store.pinned_keys]
    assert all(store.pinned_reserved + store.layouts[k].nbytes > 5 * one for k in skipped)
    assert order[0] in store.pinned_keys
    assert store.pinned_bytes == store.pinned_reserved  # pinned set loaded at startup
    tokens, logits = run(model)
    assert tokens == resident[0]
    np.testing.assert_array_equal(logits, resident[1])
    r = store.report()
    assert r["hits_pinned"] > 0 and r["cached_bytes"] <= store.budget_bytes
    assert set(store._pinned) == set(store.pinned_keys)  # never evicted
    store.close()


def topp_oracle(x_normed_router_scores, K, p, scale):
    """float64 numpy: upstream's TOPP on already-selected unnormalised weights [N, K]."""
    w = x_normed_router_scores.astype(np.float64)
    keep = np.zeros_like(w, bool)
    for n in range(w.shape[0]):
        order = np.argsort(-w[n], kind="stable")
        cs = np.cumsum(w[n][order])
        m = int(np.searchsorted(cs >= p * w[n].sum(), True)) + 1
        keep[n, order[:m]] = True
    kept = np.where(keep, w, 0)
    return keep, kept / kept.sum(axis=1, keepdims=True) * scale


def test_expert_top_p_matches_oracle_and_reduces_reads(container, tmp_path):
    from colibri_mlx.experts import expert_top_p

    rng = np.random.default_rng(1)
    w = rng.uniform(0.05, 1, (200, 8)).astype(np.float32)
    ids = np.tile(np.arange(8, dtype=np.int32), (200, 1))
    for p in (0.3, 0.7, 0.85, 1.0):
        got_ids, got_w = expert_top_p(mx.array(ids), mx.array(w), p, True, 2.5)
        keep, want = topp_oracle(w, 8, p, 2.5)
        np.testing.assert_array_equal(np.array(got_ids) >= 0, keep)
        np.testing.assert_allclose(np.array(got_w), want, rtol=2e-6, atol=1e-7)  # float32 vs float64
    full = load_model(container, ram_gb=0, usage_path=str(tmp_path / "a"))
    cut = load_model(container, ram_gb=0, expert_top_p=0.5, usage_path=str(tmp_path / "b"))
    t_full, l_full = run(full, 3)
    t_cut, l_cut = run(cut, 3)
    assert cut.expert_store.stats.lookups < full.expert_store.stats.lookups
    assert not np.array_equal(l_full, l_cut)  # documented as changing results
    full.expert_store.close(), cut.expert_store.close()


def test_truncated_shard_is_a_clear_error(tmp_path):
    path = str(tmp_path / "m")
    build_container(path)
    model = load_model(path, ram_gb=0, record_usage=False)
    store = model.expert_store
    shard = store.layouts[(1, 0)].reads[0].path
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size // 3)
    with pytest.raises(ExpertStoreError, match=r"truncated or replaced"):
        run(model, 2)
    store.close()


def test_deleted_shard_keeps_serving_the_opened_file(container, resident, tmp_path):
    path = str(tmp_path / "m")
    build_container(path)
    model = load_model(path, ram_gb=0, record_usage=False)
    for shard in {r.path for l in model.expert_store.layouts.values() for r in l.reads}:
        os.unlink(shard)  # the descriptors opened at load keep the bytes reachable
    tokens, logits = run(model)
    assert tokens == resident[0]
    np.testing.assert_array_equal(logits, resident[1])
    model.expert_store.close()


TRUNCATE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from test_streaming_model import run
    from colibri_mlx.models import load_model
    model = load_model(sys.argv[2])
    for f in os.listdir(sys.argv[2]):
        if f.endswith(".safetensors"):
            os.truncate(os.path.join(sys.argv[2], f), 0)  # a mapped page past EOF would be SIGBUS
    print(json.dumps(run(model, 3)[0]))
""")


def test_resident_model_survives_its_shards_being_truncated(container, resident, tmp_path):
    # Without --ram-gb every weight is resident, copied out of the memory map at load.
    path = tmp_path / "m"
    build_container(str(path))
    script = tmp_path / "trunc.py"
    script.write_text(TRUNCATE_SCRIPT)
    out = subprocess.run([sys.executable, str(script), os.path.dirname(__file__), str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -7 = SIGBUS
    assert json.loads(out.stdout.strip().splitlines()[-1]) == resident[0][:4]


RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    sys.path.insert(0, sys.argv[1])
    from test_streaming_model import run
    from colibri_mlx.models import load_model
    ram = float(sys.argv[3])
    model = load_model(sys.argv[2], ram_gb=ram if ram >= 0 else None, **({} if ram < 0 else
                       dict(record_usage=False, workers=2, max_inflight=2)))
    run(model, 3)
    store = model.expert_store
    status = dict(l.split(":", 1) for l in open("/proc/self/status"))
    out = dict(hwm=int(status["VmHWM"].split()[0]) * 1024, rss=int(status["VmRSS"].split()[0]) * 1024)
    if store is not None:
        out.update(resident=store.resident_weight_bytes, total=store.total_expert_bytes,
                   one=max(l.nbytes for l in store.layouts.values()), budget=store.budget_bytes)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_peak_rss_bounded_with_experts_several_times_the_budget(tmp_path):
    # Experts large enough (~2.4 MB each, ~190 MB in all) that the interpreter's baseline is small beside them.
    path = str(tmp_path / "big")
    build_container(path, hidden_size=512, moe_intermediate_size=1024, n_routed_experts=32,
                    num_experts_per_tok=4, vocab_size=64, intermediate_size=256)
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT)
    tests = os.path.dirname(__file__)

    def measure(ram):
        out = subprocess.run([sys.executable, str(script), tests, path, str(ram)], capture_output=True, text=True,
                             check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    base = measure(0)  # nothing cached: the process's floor for this model
    budget = 8 * base["one"]
    r = measure(budget / 1e9)
    assert r["total"] >= 4 * budget
    # Stated overhead: max_inflight + 1 experts beyond the budget, plus dequantization temporaries
    # the zero-budget run has too.
    bound = base["hwm"] + budget + 3 * base["one"]
    assert r["hwm"] <= bound, (r, base)
    full = measure(-1)
    assert r["hwm"] < full["hwm"]


def test_cli_flags_stats_line_and_usage_written(tmp_path):
    from click.testing import CliRunner

    from colibri_mlx.cli import main
    from helpers_models import VOCAB_SIZE, write_tokenizer

    path = str(tmp_path / "m")
    build_container(path, vocab_size=VOCAB_SIZE)
    write_tokenizer(path)
    common = ["generate", "-m", path, "-p", "hello", "--max-tokens", "4", "--no-chat-template"]
    plain = CliRunner().invoke(main, common)
    assert plain.exit_code == 0, plain.output
    streamed = CliRunner().invoke(main, common + ["--ram-gb", "0.00002", "--pin", "auto", "--pin-gb", "0.00001"])
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout == plain.stdout  # same text whatever the budget
    assert "expert hit rate" in streamed.stderr and "MB/token" in streamed.stderr
    assert "expert hit rate" not in plain.stderr
    assert read_usage(os.path.join(path, ".coli_usage")).total > 0
    cut = CliRunner().invoke(main, common + ["--ram-gb", "1", "--expert-top-p", "0.5"])
    assert cut.exit_code == 0, cut.output
    bad = CliRunner().invoke(main, common + ["--expert-top-p", "1.5"])
    assert bad.exit_code != 0 and "expert-top-p" in bad.output


def test_store_is_closed_with_its_model(container):
    import gc
    from collections import Counter

    def container_files_open():
        # By target, not by descriptor number: numbers freed by an earlier test's garbage
        # can be reused by the store's shards, so a set difference of numbers may be empty.
        root = os.path.realpath(container)
        opened = Counter()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(os.path.join("/proc/self/fd", fd))
            except OSError:  # closed between listdir and readlink
                continue
            if target.startswith(root + os.sep):
                opened[target] += 1
        return opened

    before = container_files_open()  # other models of this module may hold some
    model = load_model(container, ram_gb=0, record_usage=False)
    run(model)
    assert container_files_open() - before  # the store keeps its shards open while the model lives
    del model
    gc.collect()
    assert not container_files_open() - before
