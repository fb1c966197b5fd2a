"""`colibri convert` mistakes: one `Error:` line naming the file, never exit 0 on absurd input,
never a half-written output; a finished shard damaged later is converted again on rerun.

The source is a tiny float32 Hugging Face-style checkpoint written with safetensors' numpy API
(two shards and an index), built from tests/helpers_tiny.py's config: no torch needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from helpers_tiny import CONFIG, GLM, tensor_shapes, write_tiny_container

from colibri_mlx.cli import main

REPO = Path(__file__).resolve().parents[1]
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def write_checkpoint(path: Path, config: dict = CONFIG) -> Path:
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    parts: list[dict] = [{}, {}]
    for name, shape in sorted(tensor_shapes(config).items()):
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        parts[1 if ".mlp.experts." in name or "indexer" in name else 0][name] = w
    weight_map = {}
    for fname, tensors in zip(SHARDS, parts):
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt")


@pytest.fixture
def src(source, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(source, d)
    return d


def convert(indir, outdir, *more):
    return CliRunner().invoke(main, ["convert", "--indir", str(indir), "--outdir", str(outdir), "--no-progress",
                                     "--no-stats", *more])


def assert_error(result, *needles):
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    last = result.output.rstrip("\n").splitlines()[-1]
    assert last.startswith("Error: "), result.output
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def test_clean_conversion_leaves_no_lock_file(src, tmp_path):
    out = tmp_path / "out"
    result = convert(src, out)
    assert result.exit_code == 0, result.output
    assert not (out / ".convert.lock").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["out-00000.safetensors", "out-00001.safetensors"]


def test_a_colibri_container_is_not_converted_again(tmp_path):
    container = write_tiny_container(tmp_path / "container")
    last = assert_error(convert(container, tmp_path / "out"), "already a colibri container", "colibri generate")
    assert "U8 is not a supported weight encoding" not in last
    assert not (tmp_path / "out").exists()


def test_a_truncated_finished_shard_is_converted_again(src, tmp_path):
    out = tmp_path / "out"
    assert convert(src, out).exit_code == 0
    clean = {p.name: p.read_bytes() for p in out.glob("*.safetensors")}
    shard = out / "out-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # damaged after the conversion finished
    result = convert(src, out)
    assert result.exit_code == 0, result.output
    assert "[resume] out-00001.safetensors is" in result.output and "converting" in result.output
    assert {p.name: p.read_bytes() for p in out.glob("*.safetensors")} == clean
    # same size, damaged header: the header check catches it
    raw = bytearray(shard.read_bytes())
    raw[8:16] = b"garbage!"
    shard.write_bytes(bytes(raw))
    assert convert(src, out).exit_code == 0
    assert {p.name: p.read_bytes() for p in out.glob("*.safetensors")} == clean
    rerun = convert(src, out)  # intact: nothing converted again
    assert rerun.exit_code == 0 and "converting" not in rerun.output


@pytest.mark.parametrize("target", ["../elsewhere.safetensors", "/tmp/x.safetensors", "sub/model.safetensors"])
def test_index_naming_shards_outside_the_directory(src, tmp_path, target):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: target for name in index["weight_map"]}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_error(convert(src, tmp_path / "out", "--indexer"), "model.safetensors.index.json", target)
    assert not (tmp_path / "out").exists()


def test_index_naming_a_missing_shard(src, tmp_path):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_error(convert(src, tmp_path / "out", "--mtp"), "model-00009-of-00009.safetensors", "not among")


@pytest.mark.parametrize("flag", ["--mtp", "--indexer"])
def test_a_pass_with_nothing_to_convert_is_an_error(src, tmp_path, flag):
    # a DeepSeek-V3 checkpoint without MTP layer or DSA indexer
    assert_error(convert(src, tmp_path / "out", flag), "nothing to convert")
    assert not (tmp_path / "out").exists()


def test_a_config_that_would_not_load_is_refused_before_converting(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, n_group=0)))
    assert_error(convert(src, tmp_path / "out"), "config.json", "n_group")
    (src / "config.json").write_text("[1]")
    assert_error(convert(src, tmp_path / "out"), "config.json", "JSON object")
    (src / "config.json").write_bytes(b'{"model_type": "\xff"}')
    assert_error(convert(src, tmp_path / "out"), "config.json", "UTF-8")
    assert not (tmp_path / "out").exists()


def _drop_from_shard(path: Path, name: str):
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("case, needles", [
    ("more-layers-in-config", ["config.json", "num_hidden_layers=3", "would not load"]),
    ("tensor-missing-from-its-shard", ["model.safetensors.index.json", "model.norm.weight", SHARDS[0]]),
    ("shard-named-by-the-index-absent", ["model.safetensors.index.json", SHARDS[1], "not among"]),
    ("tokenizer-broken-symlink", ["tokenizer.json", "broken symlink"]),
    ("tokenizer-symlink-outside", ["tokenizer.json", "outside"]),
    ("bits-out-of-range", ["--ebits", "99"]),
])
def test_an_incomplete_or_inconsistent_checkpoint_is_refused_before_converting(src, tmp_path, case, needles):
    """What would make a container that does not load (or fail after hours) is refused up front."""
    more = []
    if case == "more-layers-in-config":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    elif case == "tensor-missing-from-its-shard":
        _drop_from_shard(src / SHARDS[0], "model.norm.weight")
    elif case == "shard-named-by-the-index-absent":
        (src / SHARDS[1]).unlink()
    elif case == "tokenizer-broken-symlink":
        (src / "tokenizer.json").unlink()
        os.symlink("tokenizer.json.incomplete", src / "tokenizer.json")
    elif case == "tokenizer-symlink-outside":
        (src / "tokenizer.json").unlink()
        (tmp_path / "elsewhere.json").write_text("{}")
        os.symlink(tmp_path / "elsewhere.json", src / "tokenizer.json")
    else:
        more = ["--ebits", "99"]
    assert_error(convert(src, tmp_path / "out", *more), *needles)
    assert not (tmp_path / "out").exists()


def test_a_partial_checkpoint_without_an_index_converts_with_a_warning(src, tmp_path):
    # a hand-made checkpoint (no index) converts as upstream converts it, saying what it lacks
    (src / "model.safetensors.index.json").unlink()
    _drop_from_shard(src / SHARDS[0], "model.norm.weight")
    result = convert(src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "WARNING" in result.output and "model.norm.weight" in result.output and "will not load" in result.output


def test_outdir_equal_to_indir(src):
    assert_error(convert(src, src), "--outdir", "--indir")


def test_a_fifo_shard_in_the_checkpoint(src, tmp_path):
    os.mkfifo(src / "model-00003-of-00003.safetensors")
    assert_error(convert(src, tmp_path / "out"), "model-00003-of-00003.safetensors", "FIFO")


def test_glm_default_output_notes_how_to_add_the_indexer(tmp_path):
    from helpers_models import write_tokenizer

    from colibri_mlx.container import Container

    src = write_checkpoint(tmp_path / "glm", GLM)
    write_tokenizer(src)
    out = tmp_path / "out"
    assert convert(src, out).exit_code == 0
    with Container(out) as c:
        assert not [n for n in c.names() if ".indexer." in n]  # the main pass leaves the indexer out
    from colibri_mlx.errors import ColibriNote

    with pytest.warns(ColibriNote, match="no DSA indexer weights.*colibri convert .* --indexer"):
        result = CliRunner().invoke(main, ["generate", "-m", str(out), "-p", "hi", "--max-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert convert(src, out, "--indexer").exit_code == 0   # the note's advice works
    assert sorted(p.name for p in out.glob("out-idx-*")) == ["out-idx-00000.safetensors"]
    with Container(out) as c:
        assert [n for n in c.names() if ".indexer." in n]


_DISK_FULL = textwrap.dedent("""
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (40000, 40000))
    from colibri_mlx.cli import main
    sys.argv = ["colibri", "convert", "--indir", sys.argv[1], "--outdir", sys.argv[2], "--no-progress"]
    main()
""")


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(src, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _DISK_FULL, str(src), str(out)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("Error: ") and "out-00000.safetensors" in last and "File too large" in last, last
    assert not [p.name for p in out.iterdir() if p.name.endswith(".safetensors") or ".tmp" in p.name]
    assert not (out / ".convert.lock").exists()
    # with room again, the same command finishes the job
    assert convert(src, out).exit_code == 0
    assert len(list(out.glob("*.safetensors"))) == 2
