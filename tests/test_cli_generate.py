"""`colibri generate` and `colibri chat` on a tiny random checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from helpers_models import build_config_model, save_checkpoint

import colibri_mlx
from colibri_mlx.cli import main

STATS = re.compile(r"prompt: (\d+) tokens, [\d.]+ tok/s \| generation: (\d+) tokens, [\d.]+ tok/s \| "
                   r"peak memory: .* \| kernels\[")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_config_model("v3_lora_g1", seed=9)
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp("v3")))
    return path, *colibri_mlx.load(path)


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def test_generate_streams_text_and_stats(checkpoint):
    path, model, tokenizer = checkpoint
    result = run("generate", "-m", path, "-p", "hello world", "--max-tokens", "12", "--no-chat-template")
    assert result.exit_code == 0, result.output
    expected = colibri_mlx.generate(model, tokenizer, "hello world", max_tokens=12)
    assert result.stdout == expected + "\n"
    m = STATS.search(result.stderr)
    assert m and m.groups() == ("11", "12")


def test_generate_with_chat_template_and_system(checkpoint):
    path, model, tokenizer = checkpoint
    result = run("generate", "-m", path, "-p", "hi", "--system", "terse", "--max-tokens", "6")
    assert result.exit_code == 0, result.output
    ids = tokenizer.encode_chat([{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}])
    assert result.stdout == colibri_mlx.generate(model, tokenizer, ids, max_tokens=6) + "\n"
    assert STATS.search(result.stderr).group(1) == str(len(ids))


def test_generate_sampling_options_are_reproducible(checkpoint):
    path, _, _ = checkpoint
    args = ("generate", "-m", path, "-p", "abc", "--max-tokens", "8", "--temp", "1.2", "--top-p", "0.9",
            "--top-k", "50", "--min-p", "0.01", "--seed", "4")
    first = run(*args)
    assert first.exit_code == 0 and first.stdout.strip(), first.output
    assert run(*args).stdout == first.stdout


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("option, message", [(("--top-p", "0"), "'--top-p': 0.0 is not in the range 0<x<=1"),
                                             (("--temp", "-1"), "'--temp': -1.0 is not in the range x>=0"),
                                             (("--min-p", "1.5"), "'--min-p': 1.5 is not in the range 0<=x<=1"),
                                             (("--temp", "nan"), "'--temp': nan is not a finite number"),
                                             (("--top-k", "-1"), "'--top-k': -1 is not in the range x>=0")])
def test_bad_sampling_values_are_refused_before_loading(command, option, message):
    args = [command, "-m", "/nonexistent/dir", *option] + (["-p", "x"] if command == "generate" else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output and "does not exist" not in result.output


def test_chat_keeps_cache_between_turns(checkpoint):
    path, model, tokenizer = checkpoint
    result = run("chat", "-m", path, "--max-tokens", "5", input="ab\ncd\n/reset\nab\n/exit\n")
    assert result.exit_code == 0, result.output
    stats = STATS.findall(result.stderr)
    assert len(stats) == 3 and "(conversation cleared)" in result.stderr
    # Turn 1 and the turn after /reset see the same fresh conversation.
    first = colibri_mlx.generate(model, tokenizer, tokenizer.encode_chat([{"role": "user", "content": "ab"}]),
                                 max_tokens=5)
    assert result.stdout.count(first) >= 2
    turn1_prompt = len(tokenizer.encode_chat([{"role": "user", "content": "ab"}]))
    assert int(stats[0][0]) == turn1_prompt and int(stats[2][0]) == turn1_prompt


def test_chat_session_feeds_only_new_tokens(checkpoint, monkeypatch):
    from colibri_mlx.cli import _ChatSession

    _, model, tokenizer = checkpoint
    session = _ChatSession(model, tokenizer, None)
    first = session.turn("hello", dict(max_tokens=4))
    assert session.cache.offset == len(session.cached_ids) == first.prompt_tokens + 3
    # A template that reproduces the history token for token: only the suffix is fed.
    history = list(session.cached_ids)
    monkeypatch.setattr(tokenizer, "encode_chat", lambda messages, add_generation_prompt=True: history + [7, 8, 9])
    second = session.turn("more", dict(max_tokens=4))
    assert second.prompt_tokens == 3
    # One that does not: the cache starts over with the whole conversation.
    monkeypatch.setattr(tokenizer, "encode_chat", lambda messages, add_generation_prompt=True: [1, 2, 3, 4, 5])
    assert session.turn("again", dict(max_tokens=2)).prompt_tokens == 5
    assert session.cache.offset == 5 + 1


def test_missing_model_is_a_clear_error():
    result = CliRunner().invoke(main, ["generate", "-m", "/nonexistent/dir", "-p", "x"])
    assert result.exit_code != 0 and "does not exist" in result.output


def test_non_utf8_input_is_a_clear_error(checkpoint):
    path, _, _ = checkpoint
    # argv and the terminal hand undecodable bytes over as surrogate escapes.
    bad = b"in \xff the".decode("utf-8", "surrogateescape")
    result = CliRunner().invoke(main, ["generate", "-m", path, "-p", bad, "--max-tokens", "2"])
    assert result.exit_code == 1 and "the prompt is not valid UTF-8 (byte 0xff at character 3)" in result.output
    result = CliRunner().invoke(main, ["generate", "-m", path, "-p", "-", "--max-tokens", "2"], input=b"ok \xfe")
    assert result.exit_code == 1 and "not valid UTF-8 (byte 0xfe at offset 3)" in result.output
    # A real pipe with a strict UTF-8 stdin decoder (CliRunner echoes input through a strict encoder).
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
    chat = subprocess.run([sys.executable, "-m", "colibri_mlx", "chat", "-m", path, "--max-tokens", "2"],
                          input=b"in \xff the\nab\n", capture_output=True, env=env, timeout=120)
    stderr = chat.stderr.decode()
    assert chat.returncode == 0, stderr
    assert "Error: the message is not valid UTF-8 (byte 0xff at character 3)" in stderr
    assert len(STATS.findall(stderr)) == 1  # the next line still got its reply


def test_chat_turn_past_the_context_limit_keeps_the_conversation(checkpoint):
    path, model, tokenizer = checkpoint
    too_long = " ".join(["word"] * (model.max_length + 10))
    result = run("chat", "-m", path, "--max-tokens", "3", input=f"ab\n{too_long}\ncd\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "exceeds the context limit" in result.stderr
    stats = STATS.findall(result.stderr)
    assert len(stats) == 2
    # The refused message is not part of the conversation: turn 3 continues turn 1.
    from colibri_mlx.cli import _ChatSession

    session = _ChatSession(model, tokenizer, None)
    session.turn("ab", dict(max_tokens=3))
    with pytest.raises(ValueError, match="context limit"):
        session.turn(too_long, dict(max_tokens=3))
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.cache.offset == len(session.cached_ids)
    expected = session.turn("cd", dict(max_tokens=3))
    assert stats[1] == (str(expected.prompt_tokens), str(expected.generation_tokens))


def test_chat_turn_interrupted_mid_reply_starts_the_cache_over(checkpoint, monkeypatch):
    import colibri_mlx.cli as cli

    _, model, tokenizer = checkpoint
    session = cli._ChatSession(model, tokenizer, None)
    session.turn("ab", dict(max_tokens=3))
    real = cli._stream_reply

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_stream_reply", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.turn("cd", dict(max_tokens=3))
    assert [m["content"] for m in session.messages] == ["ab", session.messages[1]["content"]]
    assert session.cache.offset == len(session.cached_ids) == 0


def test_ctrl_c_in_chat_stops_the_reply_not_the_chat(checkpoint, monkeypatch):
    import colibri_mlx.cli as cli

    path, _, _ = checkpoint
    real, calls = cli._stream_reply, []

    def first_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "_stream_reply", first_interrupted)
    result = run("chat", "-m", path, "--max-tokens", "3", input="ab\ncd\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "reply interrupted" in result.stderr
    assert len(STATS.findall(result.stderr)) == 1  # the second message still got its reply
