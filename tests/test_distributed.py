"""Expert and pipeline parallel over MLX's ring backend, 2 and 3 local processes.

Each run is checked against the same model in one process (the oracle): 32 greedy tokens
identical, logits of the prompt and of every step within 1e-5. Per-rank bytes are checked against
the container's own header (not the planner's numbers): the ranks together read the sharded part
once and the replicated part once each, and no rank reads more than 1/N of the sharded part plus
the replicated part plus the planner's stated imbalance (one expert per MoE layer under expert
parallel, one layer under pipeline parallel).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import helpers_models
import helpers_tiny
from colibri_mlx.distributed import write_local_hostfile
from dist_worker import PROMPT
from helpers_tiny import CONFIG, GLM, write_tiny_container

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dist_worker.py")
N_TOKENS = 32
LOGIT_TOL = 1e-5            # float32 sums in another order (partial sums per rank, then all_sum)
RESIDENT_OVERHEAD = 4096    # per-rank index tables (expert id -> local slot: 4 bytes per expert and layer)
DSV3 = dict(CONFIG, num_hidden_layers=4, n_routed_experts=6, max_position_embeddings=64)
GLM5 = dict(GLM, num_hidden_layers=4, n_routed_experts=6, max_position_embeddings=64)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path, rank, world, extra=None):
    hostfile = tmp_path / "hosts.json"
    if not hostfile.exists():
        write_local_hostfile(hostfile, world)
    env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile),
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    env.update(extra or {})
    return env


def _launch(tmp_path, model, mode, world, out, n_tokens=N_TOKENS, extra=None, **popen):
    return [subprocess.Popen([sys.executable, WORKER, model, mode, str(out), str(n_tokens)],
                             env=_env(tmp_path, r, world, extra), cwd=str(tmp_path), **popen)
            for r in range(world)]


def _run(tmp_path, model, mode, world, extra=None):
    out = tmp_path / f"{mode}{world}.json"
    procs = _launch(tmp_path, model, mode, world, out, extra=extra, stderr=subprocess.PIPE)
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    return json.loads(out.read_text())


def _reference(tmp_path, model):
    out = tmp_path / "one.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    for k in ("MLX_RANK", "MLX_HOSTFILE"):
        env.pop(k, None)
    subprocess.run([sys.executable, WORKER, model, "expert", str(out), str(N_TOKENS)], env=env, check=True,
                   timeout=120)
    return json.loads(out.read_text())


def _header_parts(path, mode):
    """From the container header alone: per sharded unit (an expert of a layer, or a layer) and for
    the replicated rest, the stored bytes a load reads and the bytes it keeps (quantized tensors as
    stored, every float tensor widened to float32 on the CPU, FP8 block scales folded in)."""
    from colibri_mlx.container import Container

    c = Container(path)
    names = set(c.names())
    units, replicated = {}, np.zeros(2)
    for name in names:
        info = c.info(name)
        if name.endswith("_scale_inv"):
            kept = 0
        elif name.endswith(".qs") or name + ".qs" in names:
            kept = info.nbytes
        else:
            kept = 4 * int(np.prod(info.shape))
        m = re.match(r"model\.layers\.(\d+)\.(mlp\.experts\.(\d+)\.)?", name)
        key = None
        if m is not None:
            key = int(m.group(1)) if mode == "pipeline" else (
                (int(m.group(1)), int(m.group(3))) if m.group(2) else None)
        if key is None:
            replicated += (info.nbytes, kept)
        else:
            units[key] = units.get(key, np.zeros(2)) + (info.nbytes, kept)
    return units, replicated


def _mlx_lm_header_parts(path, mode):
    """:func:`_header_parts` of an mlx-lm checkpoint: an expert is row e of each stacked
    ``switch_mlp`` tensor (weight, scales, biases). Only stored bytes (the kept column is 0: its
    ``kv_b_proj`` is kept widened from the split halves)."""
    from colibri_mlx.container import Container

    c = Container(path)
    units, replicated = {}, np.zeros(2)
    for name in c.names():
        info = c.info(name)
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None or (mode == "expert" and ".switch_mlp." not in name):
            replicated[0] += info.nbytes
        elif mode == "pipeline":
            units.setdefault(int(m.group(1)), np.zeros(2))[0] += info.nbytes
        else:
            for e in range(info.shape[0]):
                units.setdefault((int(m.group(1)), e), np.zeros(2))[0] += info.nbytes // info.shape[0]
    return units, replicated


def _check_bytes(path, mode, world, stats, parts=_header_parts, resident=True):
    units, replicated = parts(path, mode)
    sharded = sum(units.values())
    if mode == "expert":
        # The planner's imbalance: at most one expert per MoE layer more than an even share.
        layers = {l for l, _ in units}
        slack = sum(np.max([v for (l, _), v in units.items() if l == layer], axis=0) for layer in layers)
        assert sum(s["experts_held"] for s in stats) == len(units)    # disjoint and complete
    else:
        slack = np.max(list(units.values()), axis=0)                  # one layer
        assert sum(s["layers_held"] for s in stats) == len(units)
    assert len(units) > world
    read = sum(s["read_bytes"] for s in stats)
    assert read == sharded[0] + world * replicated[0]     # each sharded tensor read by exactly one rank
    bound = sharded / world + replicated + slack
    for s in stats:
        assert s["read_bytes"] <= bound[0], (s, bound)
    if not resident:
        return
    for s in stats:
        assert s["resident_bytes"] <= bound[1] + RESIDENT_OVERHEAD, (s, bound)
    kept = sum(s["resident_bytes"] for s in stats)
    assert abs(kept - (sharded[1] + world * replicated[1])) <= world * RESIDENT_OVERHEAD


def _check_against_one(tmp_path, model, mode, world, **bytes_check):
    ref = _reference(tmp_path, model)
    got = _run(tmp_path, model, mode, world)
    assert len(ref["tokens"]) == N_TOKENS
    assert got["tokens"] == ref["tokens"]
    a, b = np.array(ref["logits"]), np.array(got["logits"])
    assert a.shape == b.shape and np.isfinite(a).all()
    assert np.abs(a - b).max() <= LOGIT_TOL
    assert [s["rank"] for s in got["stats"]] == list(range(world))
    _check_bytes(model, mode, world, got["stats"], **bytes_check)
    return got


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    made = {"dsv3": write_tiny_container(root / "dsv3", DSV3, seed=1),
            "glm5": write_tiny_container(root / "glm5", GLM5, seed=2)}
    original = helpers_tiny._format
    helpers_tiny._format = helpers_models.default_container_formats   # every fmt, per expert too
    try:
        made["mixed"] = write_tiny_container(root / "mixed", DSV3, seed=3)
    finally:
        helpers_tiny._format = original
    return made


@pytest.mark.parametrize("name,mode,world", [
    ("dsv3", "expert", 2),
    ("mixed", "pipeline", 2),
    ("glm5", "expert", 2),
])
def test_parallel_matches_one_process(tmp_path, models, name, mode, world):
    _check_against_one(tmp_path, models[name], mode, world)


@pytest.fixture(scope="module")
def mlx_lm_model(tmp_path_factory):
    """``mlx_lm.convert`` of a tiny DeepSeek-V3 (affine 4-bit g64, as tests/test_mlx_lm_checkpoint.py)."""
    mlx_lm = pytest.importorskip("mlx_lm")
    pytest.importorskip("transformers")
    from test_mlx_lm_checkpoint import WIDE

    root = tmp_path_factory.mktemp("dist_mlx_lm")
    hf = helpers_models.save_checkpoint(helpers_models.build_hf_model("deepseek_v3", seed=3, **WIDE),
                                        str(root / "hf"))
    mlx_lm.convert(hf, str(root / "q"), quantize=True, q_bits=4, q_group_size=64)
    return str(root / "q")


@pytest.mark.parametrize("mode", ["expert", "pipeline"])
def test_mlx_lm_checkpoint_parallel(tmp_path, mlx_lm_model, mode):
    """Stacked switch_mlp experts: each rank reads its experts' rows (or its layers) and the rest."""
    got = _check_against_one(tmp_path, mlx_lm_model, mode, 2, parts=_mlx_lm_header_parts, resident=False)
    if mode == "expert":
        assert all(0 < s["experts_held"] for s in got["stats"])


def test_mlx_lm_checkpoint_streamed_per_rank(tmp_path, mlx_lm_model):
    """--ram-gb under --parallel expert: each rank streams rows of its own experts only; nothing
    of a routed expert is read at load."""
    _check_streamed_stacked(tmp_path, mlx_lm_model, _mlx_lm_header_parts)


def _check_streamed_stacked(tmp_path, model, parts):
    """Two expert-parallel ranks streaming a checkpoint of stacked experts: tokens and logits as in
    one process; each rank read only the replicated tensors at load and streamed its own experts."""
    ref = _reference(tmp_path, model)
    got = _run(tmp_path, model, "expert", 2, extra={"DIST_WORKER_RAM_GB": str(STREAM_RAM_GB)})
    assert got["tokens"] == ref["tokens"]
    assert np.abs(np.array(ref["logits"]) - np.array(got["logits"])).max() <= LOGIT_TOL
    units, replicated = parts(model, "expert")
    for s in got["stats"]:
        assert s["read_bytes"] == replicated[0]
        mine = int(s["experts_held"]) * max(v[0] for v in units.values())
        assert 0 < s["streamed_bytes"] <= 2 * (1 + N_TOKENS) * mine, s


class TwoRanks:
    """Rank 0 of 2, for load_rank_model's refusals (nothing is launched)."""

    def rank(self):
        return 0

    def size(self):
        return 2


def test_mlx_lm_checkpoint_refuses_sharded_attention(mlx_lm_model):
    from colibri_mlx.distributed import load_rank_model

    with pytest.raises(ValueError, match="--shard-attention is not available for an mlx-lm checkpoint"):
        load_rank_model(mlx_lm_model, TwoRanks(), shard_attention=True)


@pytest.mark.slow
@pytest.mark.parametrize("name,mode,world", [
    ("dsv3", "pipeline", 2), ("dsv3", "expert", 3), ("dsv3", "pipeline", 3),
    ("glm5", "expert", 3), ("glm5", "pipeline", 2), ("glm5", "pipeline", 3),
    ("mixed", "expert", 2), ("mixed", "expert", 3), ("mixed", "pipeline", 3),
])
def test_parallel_matches_one_process_matrix(tmp_path, models, name, mode, world):
    _check_against_one(tmp_path, models[name], mode, world)


def test_mlx_launch_command_line(tmp_path, models):
    """The documented launcher: ``mlx.launch -n 2 --backend ring``."""
    launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    if not os.path.exists(launcher):
        pytest.skip("mlx.launch is not installed next to this interpreter")
    out = tmp_path / "launch.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    r = subprocess.run([launcher, "-n", "2", "--backend", "ring", "--starting-port", str(_free_port()),
                        sys.executable, WORKER, models["dsv3"], "expert", str(out), "4"],
                       env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(out.read_text())
    assert len(got["tokens"]) == 4 and len(got["stats"]) == 2


def _start_paused(tmp_path, model, extra):
    out = tmp_path / "dead.json"
    procs = _launch(tmp_path, model, "expert", 2, out, extra=dict(extra, DIST_WORKER_PAUSE="1"),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = procs[0].stdout.readline()
    assert line.strip() == b"loaded", (line, procs[0].stderr.read().decode())
    return procs


def _finish(procs, timeout):
    t0 = time.monotonic()
    procs[0].stdin.write(b"go\n")
    procs[0].stdin.flush()
    _, err = procs[0].communicate(timeout=timeout)
    for p in procs[1:]:
        p.kill()
        p.wait()
    return procs[0].returncode, err.decode(), time.monotonic() - t0


def test_dead_rank_is_an_error_on_rank_0(tmp_path, models):
    """The ring backend reports the closed connection (DistributedError); should it not notice,
    the deadline does. Either way rank 0 ends with an error naming the cause, not a hang."""
    procs = _start_paused(tmp_path, models["dsv3"], {"COLIBRI_DIST_TIMEOUT": "3"})
    procs[1].kill()
    procs[1].wait()
    rc, err, _ = _finish(procs, timeout=60)
    assert rc != 0
    assert "rank 0/2" in err and "a rank died" in err, err


def test_hung_rank_times_out_on_rank_0(tmp_path, models):
    procs = _start_paused(tmp_path, models["dsv3"], {"COLIBRI_DIST_TIMEOUT": "2"})
    os.kill(procs[1].pid, signal.SIGSTOP)   # alive, holding its sockets, never answering
    rc, err, seconds = _finish(procs, timeout=60)   # kills the stopped rank afterwards
    from colibri_mlx.distributed import TIMEOUT_EXIT_CODE

    assert rc == TIMEOUT_EXIT_CODE, err
    assert "no answer from the other ranks in 2 s (COLIBRI_DIST_TIMEOUT)" in err, err
    assert seconds < 30


def test_planners():
    from colibri_mlx.distributed import plan_experts, plan_layers

    sizes = np.array([5, 1, 1, 1, 4, 2, 2])
    shares = plan_experts(sizes, 3)
    assert sorted(e for s in shares for e in s) == list(range(7))
    loads = [sizes[s].sum() for s in shares]
    assert max(loads) - min(loads) <= sizes.max()
    assert plan_experts(np.ones(4), 2) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="at least one routed expert per rank"):
        plan_experts(np.ones(2), 3)
    ranges = plan_layers([10, 10, 10, 10, 40], 2)
    assert ranges == [range(0, 3), range(3, 5)] or ranges == [range(0, 4), range(4, 5)]
    assert [list(r) for r in plan_layers([1, 1, 1, 1], 2, shared_after={2})] in ([[0], [1, 2, 3]],
                                                                                  [[0, 1, 2], [3]])
    with pytest.raises(ValueError, match="at least one layer per rank"):
        plan_layers([1, 1], 3)


def test_one_process_is_unchanged(monkeypatch):
    from colibri_mlx import distributed

    for k in ("MLX_RANK", "MLX_HOSTFILE", "OMPI_COMM_WORLD_RANK", "MLX_JACCL_COORDINATOR"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.setup("/nonexistent", "expert") is None
    monkeypatch.setenv("COLIBRI_DIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="COLIBRI_DIST_TIMEOUT"):
        distributed.timeout_s()


def _cli(tmp_path, args, world=None):
    cmd = [sys.executable, "-m", "colibri_mlx", *args]
    if world is None:
        env = dict(os.environ, PYTHONPATH=ROOT)
        for k in ("MLX_RANK", "MLX_HOSTFILE"):
            env.pop(k, None)
        return [subprocess.run(cmd, env=env, capture_output=True, timeout=120)]
    procs = [subprocess.Popen(cmd, env=_env(tmp_path, r, world), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(world)]
    return [subprocess.CompletedProcess(cmd, p.wait(timeout=120), *p.communicate()) for p in procs]


@pytest.mark.parametrize("mode,streaming", [
    ("expert", []),
    pytest.param("pipeline", [], marks=pytest.mark.slow),
    pytest.param("expert", ["--ram-gb", "0.000001", "--pin", "auto"], marks=pytest.mark.slow),
    pytest.param("expert", ["--shard-attention"], marks=pytest.mark.slow),
])
def test_cli_generate_under_two_ranks(tmp_path, models, mode, streaming):
    path = models["dsv3"]
    if streaming:
        import shutil

        path = shutil.copytree(path, tmp_path / "model")   # the run writes .coli_usage next to the model
    args = ["generate", "-m", str(path), "-p", "Hello", "--max-tokens", "12"]
    (one,) = _cli(tmp_path, args)
    assert one.returncode == 0, one.stderr.decode()
    ranks = _cli(tmp_path, args + ["--parallel", mode] + streaming, world=2)
    for r in ranks:
        assert r.returncode == 0, r.stderr.decode()
    assert ranks[0].stdout == one.stdout and one.stdout.strip()
    assert ranks[1].stdout == b""                       # rank 0 owns the output
    err = ranks[0].stderr.decode()
    assert "rank 0: resident" in err and "rank 1: resident" in err, err
    if "--ram-gb" in streaming:
        assert err.count("experts streamed") == 2, err     # both ranks read their experts from disk
        # Written by rank 0 alone, with the whole routing: every MoE layer counts the same
        # selections, the experts rank 1 holds included.
        from colibri_mlx.experts.usage import read_usage

        counts = read_usage(os.path.join(path, ".coli_usage")).counts
        counts = counts[DSV3["first_k_dense_replace"]:DSV3["num_hidden_layers"]]
        per_layer = counts.sum(axis=1)
        assert per_layer.min() == per_layer.max() > 0, counts
        assert per_layer[0] % DSV3["num_experts_per_tok"] == 0
        assert counts[:, 1::2].sum() > 0 and counts[:, 0::2].sum() > 0   # both ranks' shares (dealt in turn)


def test_cli_help_documents_the_launch():
    from click.testing import CliRunner

    from colibri_mlx.cli import main

    for command in ("generate", "chat", "bench", "serve"):
        text = CliRunner().invoke(main, [command, "--help"]).output
        assert "--parallel [expert|pipeline]" in text and "mlx.launch" in text, command
        assert "--shard-attention" in text and "--ram-gb is per rank" in text, command


def test_rank_0_gone_ends_the_other_ranks(tmp_path, models):
    procs = _start_paused(tmp_path, models["dsv3"], {})
    procs[0].kill()
    procs[0].wait()
    _, err = procs[1].communicate(timeout=60)
    assert procs[1].returncode == 1
    assert "colibri: rank 1/2: command wait failed" in err.decode(), err.decode()


def test_expert_shares_follow_the_usage_history(models):
    """With a .coli_usage history the shares balance selections, not bytes: the two most selected
    experts of a layer land on different ranks, and every expert is held exactly once."""
    from colibri_mlx.container import Container
    from colibri_mlx.distributed import plan_rank
    from colibri_mlx.experts.usage import UsageHistory
    from colibri_mlx.models.deepseek_v3 import ModelArgs

    c = Container(models["dsv3"])
    args = ModelArgs.from_config(DSV3)
    usage = UsageHistory.empty(DSV3["num_hidden_layers"], DSV3["n_routed_experts"])
    usage.counts[1, [0, 1]] = 1000            # experts 0 and 1 of layer 1: the hot ones
    plans = [plan_rank(c, args, r, 2, "expert", usage)[0] for r in range(2)]
    shares = [p.experts["model.layers.1.mlp.experts."] for p in plans]
    assert sorted(shares[0] + shares[1]) == list(range(DSV3["n_routed_experts"]))
    assert (0 in shares[0]) != (1 in shares[0])
    by_bytes = [plan_rank(c, args, r, 2, "expert")[0].experts["model.layers.1.mlp.experts."] for r in range(2)]
    assert by_bytes == [[0, 2, 4], [1, 3, 5]]   # equal experts: dealt in turn


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["expert", "pipeline"])
def test_unconverted_fp8_checkpoint(tmp_path, mode):
    """A Hugging Face checkpoint with FP8 weights and their block scales: each rank reads its
    tensors' scales with them, and nothing else."""
    pytest.importorskip("transformers")
    from helpers_models import build_config_model, save_checkpoint

    path = save_checkpoint(build_config_model("v3_lora_g1"), str(tmp_path / "hf"), fp8=True)
    _check_against_one(tmp_path, path, mode, 2)


def _bench(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for k in ("MLX_RANK", "MLX_HOSTFILE"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench", "bench_distributed.py"), *args],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_bench_estimate_model():
    """docs/distributed.md's table: one machine is every layer's measured time added up by hand
    (61 MLA blocks at 186 µs, 3 dense + 58 MoE blocks at 142.7 µs)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))
    try:
        import bench_distributed as B
    finally:
        sys.path.pop(0)
    assert B.estimate("DeepSeek-V3", 1, "expert", 0.0) == pytest.approx((61 * 186.0 + 61 * 142.7) / 1e3)
    # Pipeline: the same compute plus one hop per rank and rank 0's two broadcasts.
    assert B.estimate("DeepSeek-V3", 4, "pipeline", 300.0) == pytest.approx((61 * 186.0 + 61 * 142.7 + 6 * 300) / 1e3)
    out = _bench("--estimate")
    assert "expert over JACCL RDMA [2:   42.7, 4:   37.2, 8:   33.9]" in out   # the DeepSeek-V3 row of the docs


@pytest.mark.slow
def test_bench_runs(tmp_path):
    out = _bench("--tokens", "6", "--json", str(tmp_path / "b.json"))
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["expert"]["ratio"] > 0 and report["pipeline"]["ratio"] > 0
    assert "all_sum float32 [1x512]" in out


STREAM_RAM_GB = 1e-6    # 1000 bytes per rank: less than one tiny expert, so every selection is read


@pytest.mark.parametrize("name,mode", [
    ("dsv3", "expert"),
    pytest.param("glm5", "expert", marks=pytest.mark.slow),
    pytest.param("dsv3", "pipeline", marks=pytest.mark.slow),
])
def test_streamed_experts_per_rank(tmp_path, models, name, mode):
    """--ram-gb under --parallel: each rank streams only the experts it holds, with the budget per
    rank. Against one process with every expert resident: the same tokens and logits. No rank reads
    a routed expert at load; each streams at most its own experts' bytes on every forward step
    (demand reads plus the next layer's guesses, each at most once a step); under expert parallel
    rank 0's usage history counts every selection of every layer (the whole model's routing)."""
    path = models[name]
    ref = _reference(tmp_path, path)
    got = _run(tmp_path, path, mode, 2, extra={"DIST_WORKER_RAM_GB": str(STREAM_RAM_GB)})
    assert got["tokens"] == ref["tokens"]
    assert np.abs(np.array(ref["logits"]) - np.array(got["logits"])).max() <= LOGIT_TOL
    cfg = DSV3 if name == "dsv3" else GLM5
    units, replicated = _header_parts(path, "expert")
    steps = 1 + N_TOKENS                               # the prompt, then one call per token
    for s in got["stats"]:
        held_experts = int(s["experts_held"])
        if mode == "expert":
            assert s["read_bytes"] == replicated[0]        # nothing of a routed expert read at load
            mine = held_experts * max(v[0] for v in units.values())
        else:
            mine = sum(v[0] for v in units.values())   # a stage's layers: at most all experts
        assert 0 < s["streamed_bytes"] <= 2 * steps * mine, s
        assert s["expert_cache_bytes"] <= STREAM_RAM_GB * 1e9
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    if mode == "expert":
        assert got["usage_total"] == (len(PROMPT) + N_TOKENS) * cfg["num_experts_per_tok"] * moe_layers
    else:
        assert got["usage_total"] is None              # no rank sees every layer's routing: not written


def _sharded_kept(path, world):
    """Kept bytes (as in _header_parts) of the tensors --shard-attention splits: q_b/q, kv_b and
    o_proj weights of every layer, and an untied lm_head."""
    from colibri_mlx.container import Container

    c = Container(path)
    names = set(c.names())
    total = 0
    for name in names:
        if re.match(r"model\.layers\.\d+\.self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj)\.weight$", name) or \
                name == "lm_head.weight":
            total += c.info(name).nbytes + (c.info(name + ".qs").nbytes if name + ".qs" in names else 0)
    return total


@pytest.mark.parametrize("name", ["dsv3", pytest.param("glm5", marks=pytest.mark.slow)])
def test_sharded_attention_and_head(tmp_path, models, name):
    """--shard-attention on 2 ranks: the same tokens and logits as one process, and each rank keeps
    half of every attention head projection and of the head less than with them replicated."""
    path = models[name]
    ref = _reference(tmp_path, path)
    plain = _run(tmp_path, path, "expert", 2)
    got = _run(tmp_path, path, "expert", 2, extra={"DIST_WORKER_SHARD_ATTENTION": "1"})
    assert got["tokens"] == ref["tokens"]
    assert np.abs(np.array(ref["logits"]) - np.array(got["logits"])).max() <= LOGIT_TOL
    saved = _sharded_kept(path, 2) / 2
    assert saved > 0
    from colibri_mlx.container import Container
    from colibri_mlx.tensor_parallel import vocab_range

    c = Container(path)
    head_rows = [np.subtract(*vocab_range(c.config["vocab_size"], r, 2)[::-1]) for r in range(2)]
    assert sum(head_rows) == c.config["vocab_size"]
    # Reads: the other rank's rows of q_b/kv_b and of the head are not read (their .qs scales
    # are, whole); o_proj is read whole and cut by columns.
    row_sharded = sum(c.info(n).nbytes for n in c.names()
                      if re.match(r"model\.layers\.\d+\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight$", n))
    for r, (p, s) in enumerate(zip(plain["stats"], got["stats"])):
        assert p["resident_bytes"] - s["resident_bytes"] == saved, (p, s)
        unread = row_sharded / 2 + c.info("lm_head.weight").nbytes * (1 - head_rows[r] / c.config["vocab_size"])
        assert p["read_bytes"] - s["read_bytes"] == unread, (r, p, s)
        assert s["comm_calls"] > p["comm_calls"]      # an all_sum per layer's attention, one for the head


@pytest.mark.parametrize("fmt,gs", [(0, None), (1, None), (2, None), (3, None), (4, 16)])
def test_weight_slices_keep_every_stored_value(fmt, gs):
    """Row and column slices of a stored weight decode to the same slice of the whole weight's
    values (the numpy decoder of the whole tensor is the oracle): bytes and scales moved, none
    requantized."""
    from colibri_mlx.formats import QTensor, encode
    from colibri_mlx.tensor_parallel import column_slice, row_slice

    w = np.random.default_rng(fmt).standard_normal((12, 64)).astype(np.float32)
    qt = QTensor(*encode(fmt, w, gs), fmt, 12, 64, gs, "w").to_mlx()
    whole = qt.dequantize()
    assert np.array_equal(column_slice(qt, 16, 48, "w").dequantize(), whole[:, 16:48])
    assert np.array_equal(row_slice(qt, 4, 10).dequantize(), whole[4:10])
    if fmt in (0, 1):                                   # one byte or more per value: any column
        assert np.array_equal(column_slice(qt, 3, 7, "w").dequantize(), whole[:, 3:7])
    else:                                               # inside a byte, or inside a scale group (fmt 4)
        with pytest.raises(ValueError, match="whole bytes and scale groups"):
            column_slice(qt, 8 if fmt == 4 else 1, 48, "w")


def test_weight_slices_refuse_rotated_columns():
    from colibri_mlx.formats import QTensor, encode
    from colibri_mlx.tensor_parallel import column_slice

    w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    qt = QTensor(*encode(6, w, None), 6, 4, 256, None, "o_proj").to_mlx()
    with pytest.raises(ValueError, match="o_proj is stored as fmt 6"):
        column_slice(qt, 0, 128, "o_proj")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["streamed", "fp8"])
def test_sharded_attention_with_streaming_and_fp8(tmp_path, models, case):
    """--shard-attention with --ram-gb (each rank streaming its experts), and on an unconverted
    FP8 checkpoint (block-scaled weights read whole and cut): the same tokens and logits as one
    process."""
    extra = {"DIST_WORKER_SHARD_ATTENTION": "1"}
    if case == "streamed":
        path = models["dsv3"]
        extra["DIST_WORKER_RAM_GB"] = str(STREAM_RAM_GB)
    else:
        pytest.importorskip("transformers")
        from helpers_models import build_config_model, save_checkpoint

        path = save_checkpoint(build_config_model("v3_lora_g1"), str(tmp_path / "hf"), fp8=True)
    ref = _reference(tmp_path, path)
    got = _run(tmp_path, path, "expert", 2, extra=extra)
    assert got["tokens"] == ref["tokens"]
    assert np.abs(np.array(ref["logits"]) - np.array(got["logits"])).max() <= LOGIT_TOL
    if case == "streamed":
        assert all(s["streamed_bytes"] > 0 for s in got["stats"])


# ------------------------------------------------------------------------------------- GGUF

GGUF_DIR = os.path.join(ROOT, "tests", "data", "gguf")


def _gguf_header_parts(path, mode):
    """:func:`_header_parts` of a GGUF file, stored bytes only: an expert is row e of each stacked
    ``*_exps`` tensor; a layer is every ``blk.N.`` tensor."""
    import gguf

    units, replicated = {}, np.zeros(2)
    for t in gguf.GGUFReader(path).tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        nbytes = int(t.n_bytes)
        if m is None or (mode == "expert" and "_exps." not in t.name):
            replicated[0] += nbytes
        elif mode == "pipeline":
            units.setdefault(int(m.group(1)), np.zeros(2))[0] += nbytes
        else:
            E = int(t.shape[-1])   # gguf lists dimensions innermost first: experts last
            for e in range(E):
                units.setdefault((int(m.group(1)), e), np.zeros(2))[0] += nbytes // E
    return units, replicated


@pytest.mark.parametrize("fixture,mode", [("tiny-q4_k_m", "expert"), ("tiny-bf16", "pipeline")])
def test_gguf_parallel(tmp_path, fixture, mode):
    """A GGUF file under --parallel: each rank reads its experts' rows of the stacked tensors (or its
    layers) and the rest; tokens and logits as in one process."""
    pytest.importorskip("gguf")
    path = os.path.join(GGUF_DIR, fixture + ".gguf")
    ref = _reference(tmp_path, path)
    got = _run(tmp_path, path, mode, 2)
    assert got["tokens"] == ref["tokens"] and len(ref["tokens"]) == N_TOKENS
    a, b = np.array(ref["logits"]), np.array(got["logits"])
    assert a.shape == b.shape and np.isfinite(a).all() and np.abs(a - b).max() <= LOGIT_TOL
    units, replicated = _gguf_header_parts(path, mode)
    stats = got["stats"]
    key = "experts_held" if mode == "expert" else "layers_held"
    assert sum(s[key] for s in stats) == len(units) and all(s[key] > 0 for s in stats)
    sharded = sum(units.values())[0]
    assert sum(s["read_bytes"] for s in stats) == sharded + 2 * replicated[0]
    slack = max(v[0] for v in units.values()) if mode == "pipeline" else sum(
        max(v[0] for (l, _), v in units.items() if l == layer) for layer in {l for l, _ in units})
    for s in stats:
        assert s["read_bytes"] <= sharded / 2 + replicated[0] + slack, s


def test_gguf_streamed_per_rank(tmp_path):
    """--ram-gb under --parallel expert on a GGUF file: each rank streams rows of its own experts
    only; nothing of a routed expert is read at load."""
    pytest.importorskip("gguf")
    _check_streamed_stacked(tmp_path, os.path.join(GGUF_DIR, "tiny-q4_k_m.gguf"), _gguf_header_parts)


def test_gguf_refuses_sharded_attention():
    pytest.importorskip("gguf")
    from colibri_mlx.distributed import load_rank_model

    with pytest.raises(ValueError, match="--shard-attention is not available for a GGUF model"):
        load_rank_model(os.path.join(GGUF_DIR, "tiny-bf16.gguf"), TwoRanks(), shard_attention=True)
