"""The first hour with a model: defaults that work, and flag mistakes answered before loading.

* no chat template: `generate` uses the plain prompt and `chat` plain text, each with one note;
* every check that can fail is done before the weights load (proved by a loader that fails);
* flags are checked by their flag names, nan/inf refused, any seed accepted;
* the context limit is named in the stats line and in finish_reason;
* the Python API uses the prompt as given and says so in help();
* a GLM container without indexer prints one clean note;
* the fmt 6 encoder's cached library is checked before it is loaded.
"""

from __future__ import annotations

import json
import os
import pydoc
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers_tiny import GLM, write_tiny_container

import colibri_mlx
from colibri_mlx.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Path(write_tiny_container(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def loaded(tiny):
    return colibri_mlx.load(tiny)


@pytest.fixture
def no_template(tiny, tmp_path):
    d = tmp_path / "plain"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def weights_never_load(monkeypatch):
    """Make loading weights fail loudly: a check that passes it came too late."""
    import colibri_mlx.models.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(loading, "build_model", refuse)


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def last_line(result) -> str:
    return result.output.rstrip("\n").splitlines()[-1]


# ---------------------------------------------------------------------- no chat template


def test_generate_without_chat_template_uses_the_plain_prompt(no_template):
    result = run("generate", "-m", no_template, "-p", "hello", "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("colibri: note:") == 1 and "has no chat template" in result.stderr
    model, tokenizer = colibri_mlx.load(no_template)
    assert result.stdout == colibri_mlx.generate(model, tokenizer, "hello", max_tokens=5) + "\n"


def test_chat_without_chat_template_feeds_plain_text(no_template):
    result = run("chat", "-m", no_template, "--max-tokens", "3", input="ab\ncd\n/exit\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("colibri: note:") == 1 and "plain text" in result.stderr
    assert result.stderr.count("prompt: ") == 2  # two turns answered


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["chat"]])
def test_system_without_a_template_is_refused_before_loading(no_template, weights_never_load, command):
    result = run(command[0], "-m", no_template, *command[1:], "--system", "be brief")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert last_line(result).startswith("Error: --system needs a chat template")
    assert "tokenizer_config.json" in last_line(result)


def test_system_with_no_chat_template_flag_is_refused_first():
    result = run("generate", "-m", "/nonexistent/model", "-p", "x", "--system", "s", "--no-chat-template")
    assert result.exit_code == 2
    assert last_line(result) == "Error: --system needs the chat template (drop --no-chat-template)"


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["chat"]])
def test_a_broken_template_fails_before_the_weights_load(tiny, tmp_path, weights_never_load, command):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'].missing.attr }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    result = run(command[0], "-m", d, *command[1:], input="/exit\n")
    assert result.exit_code == 1
    assert last_line(result).startswith(f"Error: {d / 'tokenizer_config.json'}: the chat template failed")


def test_prompt_past_the_context_fails_before_the_weights_load(tiny, weights_never_load):
    result = run("generate", "-m", tiny, "-p", "x" * 200, "--no-chat-template")
    assert result.exit_code == 1
    assert "more than the model's context limit of 64" in last_line(result)


# ---------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("args, message", [
    (["--temp", "nan"], "'--temp': nan is not a finite number"),
    (["--temp", "inf"], "'--temp': inf is not a finite number"),
    (["--top-p", "0"], "'--top-p': 0.0 is not in the range 0<x<=1"),
    (["--top-p", "nan"], "'--top-p': nan is not a finite number"),
    (["--top-k", "-1"], "'--top-k': -1 is not in the range x>=0"),
    (["--min-p", "2"], "'--min-p': 2.0 is not in the range 0<=x<=1"),
    (["--max-tokens", "0"], "'--max-tokens': 0 is not in the range x>=1"),
    (["--ram-gb", "nan"], "'--ram-gb': nan is not a finite number"),
    (["--ram-gb", "-1"], "'--ram-gb': -1.0 is not in the range x>=0"),
    (["--expert-top-p", "nan"], "'--expert-top-p': nan is not a finite number"),
    (["--pin", "auto"], "--pin needs --ram-gb"),
    (["--pin-gb", "1"], "--pin-gb needs --ram-gb"),
    (["--ram-gb", "1", "--pin", "/no/such.coli_usage"], "--pin /no/such.coli_usage: no such file"),
    (["--ram-gb", "1", "--pin-gb", "2"], "--pin-gb 2 is more than --ram-gb 1"),
    (["--dtype", "int8"], "'--dtype': 'int8' is not one of"),
    (["--seed", "x"], "'--seed': 'x' is not a valid integer"),
])
def test_bad_flags_are_named_before_anything_loads(args, message):
    result = run("generate", "-m", "/nonexistent/model", "-p", "x", *args)
    assert result.exit_code == 2, result.output
    assert message in last_line(result) and last_line(result).startswith("Error: ")
    assert "does not exist" not in result.output


def test_pin_file_errors_name_the_file(tiny, tmp_path):
    bad = tmp_path / "usage.coli_usage"
    bad.write_text("1 2\n")
    result = run("generate", "-m", tiny, "-p", "x", "--ram-gb", "1", "--pin", bad)
    assert result.exit_code == 2 and f"--pin {bad}:1: expected" in last_line(result)
    os.mkfifo(tmp_path / "fifo")
    result = run("generate", "-m", tiny, "-p", "x", "--ram-gb", "1", "--pin", tmp_path / "fifo")
    assert result.exit_code == 2 and "FIFO" in last_line(result)


@pytest.mark.parametrize("seed", ["-1", str(2**64), str(10**30), "-" + str(10**30)])
def test_any_seed_is_accepted(tiny, seed):
    result = run("generate", "-m", tiny, "-p", "hi", "--max-tokens", "3", "--temp", "1", "--seed", seed)
    assert result.exit_code == 0, result.output


def test_api_seed_is_reduced_modulo_2_64(loaded):
    model, tokenizer = loaded
    kw = dict(max_tokens=6, temperature=1.0)
    assert colibri_mlx.generate(model, tokenizer, "ab", seed=2**64 + 7, **kw) == \
        colibri_mlx.generate(model, tokenizer, "ab", seed=7, **kw)
    assert colibri_mlx.generate(model, tokenizer, "ab", seed=-1, **kw) == \
        colibri_mlx.generate(model, tokenizer, "ab", seed=2**64 - 1, **kw)
    with pytest.raises(ValueError, match="seed must be an integer"):
        colibri_mlx.generate(model, tokenizer, "ab", seed="7", **kw)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=float("inf")), "top_p must be a finite number"),
    (dict(top_k=1.5), "top_k must be an integer"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
])
def test_api_refuses_absurd_sampling_values(loaded, kwargs, message):
    model, tokenizer = loaded
    with pytest.raises(ValueError, match=message):
        colibri_mlx.generate(model, tokenizer, "ab", **kwargs)


def test_api_refuses_ids_outside_the_vocabulary(loaded):
    model, tokenizer = loaded
    with pytest.raises(ValueError, match="prompt token id 999 is outside the model's vocabulary"):
        colibri_mlx.generate(model, tokenizer, [1, 999])


def test_convert_flags_are_checked(tmp_path):
    for args, message in ((["--jobs", "0"], "'--jobs': 0 is not in the range x>=1"),
                          (["--n-layers", "-3"], "'--n-layers': -3 is not in the range x>=1"),
                          (["--min-free-gb", "nan"], "'--min-free-gb': nan is not a finite number")):
        result = run("convert", "--indir", tmp_path, "--outdir", tmp_path / "out", *args)
        assert result.exit_code == 2 and message in last_line(result), result.output
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------- the context limit


def test_context_limit_is_said_in_stats_and_finish_reason(tiny, loaded):
    result = run("generate", "-m", tiny, "-p", "hello", "--max-tokens", "500", "--no-chat-template")
    assert result.exit_code == 0, result.output
    assert "stopped: context limit of 64 tokens reached (max_position_embeddings in config.json)" in result.stderr
    model, tokenizer = loaded
    # no end-of-sequence token: the tiny random model is made to never stop on its own
    last = None
    for last in colibri_mlx.stream_generate(model, tokenizer, "hello", max_tokens=500):
        pass
    assert last.finish_reason in ("length", "stop")
    if last.finish_reason == "length":
        assert last.prompt_tokens + last.generation_tokens == model.max_length + 1
    short = run("generate", "-m", tiny, "-p", "hello", "--max-tokens", "3", "--no-chat-template")
    assert "context limit" not in short.stderr


# --------------------------------------------------------------------------- the Python API


def test_api_uses_the_prompt_as_given_and_help_says_so(loaded):
    model, tokenizer = loaded
    ids = tokenizer.encode("hello")
    assert colibri_mlx.generate(model, tokenizer, "hello", max_tokens=4) == \
        colibri_mlx.generate(model, tokenizer, ids, max_tokens=4)
    chat_ids = tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert chat_ids != ids
    for fn in (colibri_mlx.generate, colibri_mlx.stream_generate):
        text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
        for phrase in ("chat template", "encode_chat", "seed", "max_tokens", "temperature", "top_p", "top_k",
                       "min_p", "repetition_penalty", "cache", "ValueError", "context limit"):
            assert phrase in text, (fn.__name__, phrase)
        assert "prompt: 'Union[str, Sequence[int]]'" in text
    assert "finish_reason" in pydoc.render_doc(colibri_mlx.stream_generate, renderer=pydoc.plaintext)
    assert "mlx-lm" in colibri_mlx.__doc__


def test_api_load_errors_name_the_file(tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, n_group=0)))
    with pytest.raises(ValueError, match=r"config\.json: n_group: got 0"):
        colibri_mlx.load(d)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        colibri_mlx.load(tmp_path)


# ----------------------------------------------------------------------------- the notes


def test_glm_without_indexer_prints_one_clean_note(tmp_path):
    d = write_tiny_container(tmp_path / "glm", GLM, indexer=False)
    proc = subprocess.run([sys.executable, "-m", "colibri_mlx", "generate", "-m", d, "-p", "hi", "--max-tokens",
                           "2"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "indexer" in line]
    assert len(notes) == 1 and notes[0].startswith("colibri: note: ") and "--indexer" in notes[0], proc.stderr
    assert "Warning" not in proc.stderr and "warnings.warn" not in proc.stderr


# ------------------------------------------------------------------ the fmt 6 encoder's .so


def test_cached_encoder_library_is_checked_before_loading(tmp_path, monkeypatch):
    from colibri_mlx.formats import e8

    if not (os.environ.get("CC") or shutil.which("cc")):
        pytest.skip("no C compiler")
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path))
    e8._build_and_load()
    (so,) = [p for p in tmp_path.iterdir() if p.name.endswith(".so")]
    record = Path(str(so) + ".sha256")
    key = json.loads(record.read_text())["key"]
    assert so.name == f"e8_encode-{key[:16]}.so" and e8._trusted(str(so), str(record), key)
    built = so.read_bytes()

    def replace(data: bytes):  # a new file under the name (the loaded one's pages stay mapped)
        tmp = tmp_path / "planted.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, so)

    # tampered with after it was built: the record's sha256 no longer matches, it is rebuilt
    replace(built + b"\0")
    assert not e8._trusted(str(so), str(record), key)
    e8._build_and_load()
    assert so.read_bytes() == built
    # a library planted under the right name, without our record of it: rebuilt, not loaded
    record.unlink()
    replace(b"\x7fELF planted")
    e8._build_and_load()
    assert so.read_bytes() == built and e8._trusted(str(so), str(record), key)
    # writable by others: not trusted
    so.chmod(0o666)
    assert not e8._trusted(str(so), str(record), key)
    e8._build_and_load()
    assert so.stat().st_mode & 0o777 == 0o700 and e8._trusted(str(so), str(record), key)


# ------------------------------------------------------------------------ the error path


def test_a_bug_is_one_line_unless_debugging(tiny, monkeypatch):
    import colibri_mlx.tokenizer as tok

    def broken(path):
        raise TypeError("something internal broke")

    monkeypatch.setattr(tok, "load_tokenizer", broken)
    result = run("generate", "-m", tiny, "-p", "hi")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert last_line(result) == ("Error: internal error: TypeError: something internal broke (this is a bug in "
                                 "colibri_mlx; COLIBRI_DEBUG=1 shows the traceback)")
    monkeypatch.setenv("COLIBRI_DEBUG", "1")
    result = run("generate", "-m", tiny, "-p", "hi")
    assert isinstance(result.exception, TypeError)


def test_a_small_expert_budget_is_noted_not_refused(tiny):
    result = run("generate", "-m", tiny, "-p", "hi", "--max-tokens", "2", "--ram-gb", "0.000001")
    assert result.exit_code == 0, result.output
    assert "colibri: note: --ram-gb 1e-06 holds fewer experts than one layer uses per token" in result.stderr


def test_bench_takes_any_seed(tiny):
    result = run("bench", "-m", tiny, "--prompt-tokens", "4", "--gen-tokens", "2", "--repeat", "1", "--seed", "-5")
    assert result.exit_code == 0, result.output
    result = run("bench", "-m", tiny, "--prompt-tokens", "60", "--gen-tokens", "8", "--repeat", "1")
    assert result.exit_code == 1 and "68 exceeds the model's context limit of 64" in last_line(result)
