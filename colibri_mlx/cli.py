"""The `colibri` command line.

Each subcommand parses options here and imports its implementation lazily, so that
`colibri --help` stays instant and a missing optional dependency only affects its command.

Errors: every command ends a failure with one line, ``Error: ...``, naming the file and the key,
tensor or flag at fault, and exits non-zero (1; 2 for a bad flag). The project's errors (all
``ValueError``s) and ``OSError`` are reported as they are; any other exception is a bug, reported
the same way with its type (``COLIBRI_DEBUG=1`` re-raises it for the traceback). Whatever can
be checked before weights load is checked first: flags, the model directory (config.json against
the schema, shard headers), the tokenizer and chat template, the prompt.
"""

from __future__ import annotations

import errno
import io
import math
import os
import sys

import click

from . import __version__
from .errors import debug, describe, is_user_error, one_line


class _Main(click.Group):
    """The command group: turns any exception into one ``Error:`` line (module docstring)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            e.message = one_line(e.message)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:
            if debug() or (isinstance(e, OSError) and e.errno == errno.EPIPE):
                raise  # a closed pipe (`| head`): click exits quietly
            raise click.ClickException(describe(e)) from None


class _Finite(click.FloatRange):
    """A float flag that refuses nan and inf (``--temp nan`` would sample garbage), and values
    over ``most`` (a typo's size: ``--ram-gb 1e300``)."""

    def __init__(self, *args, most: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.most = most

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number", param, ctx)
        if self.most is not None and rv > self.most:
            self.fail(f"{rv:g} is more than {self.most:g} (a typo?)", param, ctx)
        return rv


class _ByteSize(click.ParamType):
    """A byte count: an integer, or a number with a unit (``512MB``, ``8GB``, ``1.5GiB``), as mlx_lm.server."""

    name = "bytes"
    UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 1 << 10, "MIB": 1 << 20,
             "GIB": 1 << 30, "TIB": 1 << 40}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().upper()
        number = text.rstrip("KMGTIB")
        try:
            n = float(number) * self.UNITS[text[len(number):]]
        except (ValueError, KeyError):
            self.fail(f"{value!r} is not a byte count (an integer, or e.g. 512MB, 8GB, 1.5GiB)", param, ctx)
        if not math.isfinite(n) or n < 0:
            self.fail(f"{value!r} is not a byte count >= 0", param, ctx)
        return int(n)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="colibri")
def main():
    """colibri_mlx: run DeepSeek-V3/R1, Kimi-K2 and GLM-5.x mixture-of-experts models
    on MLX, from colibri containers, Hugging Face checkpoints, mlx-lm checkpoints or GGUF files."""


@main.command()
@click.argument("directory", metavar="MODEL")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def inspect(directory, as_json):
    """List every tensor of a model: format, O x I, bytes, totals; exit 1 if any cannot be read.

    MODEL is a model directory, a .gguf file, or a Hugging Face hub id (mlx-community/...),
    resolved through the hub's cache as `generate` resolves it.
    config.json is checked against the model's schema first, and the tokenizer files when the
    directory has any: a model directory that `generate` would refuse is refused here too.
    A GGUF model (a .gguf file, or a directory of split ones) lists its tensors with their ggml
    types and the model tensors they map to, then the ModelArgs its metadata gives."""
    import json

    from .container import ContainerError
    from .container.inspect import format_table, inspect_container, report_json, verdict_error
    from .models.gguf_checkpoint import is_gguf_path
    from .models.modeldir import resolve_model_path

    try:
        directory = resolve_model_path(directory)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    if not os.path.exists(directory):
        raise click.BadParameter(f"{directory!r}: no such file or directory (give a model directory, a .gguf "
                                 "file or a Hugging Face hub id)", param_hint="'MODEL'")
    if is_gguf_path(directory):
        _inspect_gguf(directory, as_json)
        return
    if not os.path.isdir(directory):
        raise click.BadParameter(f"{directory!r} is a file (give a model directory or a .gguf file)",
                                 param_hint="'MODEL'")
    _check_model_files(directory)
    try:
        report = inspect_container(directory)
    except ContainerError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report_json(report), indent=1) if as_json else format_table(report))
    if not report.ok:
        raise click.ClickException(verdict_error(report))


def _inspect_gguf(path, as_json: bool) -> None:
    import json

    from .models.gguf_checkpoint import GgufError, format_inspect, inspect_gguf
    from .tokenizer import load_tokenizer

    try:
        report = inspect_gguf(path)
        tokenizer = load_tokenizer(path)
    except GgufError as e:
        raise click.ClickException(str(e)) from None
    report["tokenizer"] = {"vocab_size": tokenizer.vocab_size, "bos_token": tokenizer.bos_token,
                           "eos_token_ids": sorted(tokenizer.eos_token_ids),
                           "chat_template": bool(tokenizer.chat_template)}
    click.echo(json.dumps(report, indent=1) if as_json else format_inspect(report))
    if report["unmapped"]:
        raise click.ClickException(f"{path}: tensors the model does not read: {', '.join(report['unmapped'][:8])}")


def _check_model_files(directory) -> None:
    """For inspect: config.json (when there is one) against the schema, and the tokenizer files
    (when there are any; a bare container has none) as generate loads them."""
    import os

    from .models.modeldir import CONFIG_FILE, read_config
    from .tokenizer import load_tokenizer

    config = read_config(directory) if os.path.lexists(os.path.join(directory, CONFIG_FILE)) else None
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
    if any(os.path.lexists(os.path.join(directory, n)) for n in names):
        tokenizer = load_tokenizer(directory)
        if config is not None:
            tokenizer.check_vocab(config["vocab_size"], os.path.join(directory, CONFIG_FILE))
        if tokenizer.chat_template:  # compiled by load_tokenizer; a render error shows only when it runs
            tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])


# --- generate / chat -----------------------------------------------------------------------

_DRAFT_OPTIONS = [
    click.option("--draft", type=click.Choice(["mtp", "ngram", "none"]), default=None,
                 help="Speculative decoding (docs/speculative.md): the model's MTP layer, prompt lookup, or off. "
                      "Default: mtp when the model has an MTP layer (except seeded sampling), else none."),
    click.option("--num-draft", default=3, show_default=True, type=click.IntRange(1, 7),
                 help="Tokens drafted per step."),
]


def _options(options):
    """A decorator applying click ``options`` in their listed order."""
    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f
    return apply


_draft_options = _options(_DRAFT_OPTIONS)


def _check_draft(model, draft) -> None:
    from .speculative import resolve_draft

    try:
        resolve_draft(model, draft)
    except ValueError as e:
        raise click.UsageError(f"--draft {draft}: {e}") from None


def _sampling_options(f):
    options = [
        click.option("-m", "--model", "model_path", default=None, type=click.Path(),
                     help="Container, Hugging Face or mlx-lm checkpoint directory, a GGUF file (or a directory of "
                          "split ones), or a hub id (mlx-community/...). "
                          "Default: the bundled "
                          "demo model (a tiny KJV-trained model, docs/demo-model.md)."),
        click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1),
                     help="Most tokens to generate per reply (generation also stops at the model's context "
                          "limit, and says so)."),
        click.option("--temp", "temperature", default=0.0, show_default=True, type=_Finite(min=0),
                     help="Sampling temperature; 0 is greedy."),
        click.option("--top-p", default=1.0, show_default=True, type=_Finite(0, 1, min_open=True),
                     help="Nucleus sampling: keep the smallest set of tokens whose probability reaches this."),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0),
                     help="0 disables top-k."),
        click.option("--min-p", default=0.0, show_default=True, type=_Finite(0, 1),
                     help="Drop tokens less likely than this fraction of the most likely one."),
        click.option("--seed", default=None, type=int,
                     help="Seed for sampling (reproducible output); any integer (taken modulo 2**64)."),
        click.option("--system", default=None, help="System message (needs the model's chat template)."),
    ]
    for option in reversed(options + _STREAMING_OPTIONS):
        f = option(f)
    return f


def _remember(ctx, param, value):
    if value is not None:
        ctx.meta.setdefault("colibri.load", {})[param.name] = value
    return value


# A memory budget past this (a petabyte) is a typo (1e300 would overflow the byte count).
MAX_GB = 1e6

# Expert streaming (docs/streaming.md): collected into ctx.meta, passed to load().
_STREAMING_OPTIONS = [
    click.option("--ram-gb", "ram_gb", type=_Finite(min=0, most=MAX_GB), default=None, expose_value=False,
                 callback=_remember, help="Stream routed experts from disk with this many GB of expert cache "
                                          "(resident weights come on top). Default: all experts resident."),
    click.option("--pin", "pin", default=None, expose_value=False, callback=_remember,
                 help="Pin the hottest experts: 'auto' (the model's .coli_usage) or a .coli_usage file."),
    click.option("--pin-gb", "pin_gb", type=_Finite(min=0, most=MAX_GB), default=None, expose_value=False,
                 callback=_remember, help="Pin budget inside --ram-gb (default: half of it)."),
    click.option("--expert-top-p", "expert_top_p", type=_Finite(0, 1, min_open=True), default=None,
                 expose_value=False, callback=_remember,
                 help="Router top-p over the selected experts (upstream TOPP); fewer reads, CHANGES RESULTS."),
    # Not streaming, but a load() option too: rides along on every command that loads a model.
    click.option("--dtype", "dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
                 expose_value=False, callback=_remember,
                 help="Activation and KV cache dtype. auto: float32 on the CPU backend, bfloat16 on GPUs."),
    # One model over several processes or machines (docs/distributed.md).
    click.option("--parallel", "parallel", type=click.Choice(["expert", "pipeline"]), default=None,
                 expose_value=False, callback=_remember,
                 help="Under mlx.launch (e.g. 'mlx.launch -n 2 --backend ring -- colibri generate ...' or a "
                      "--hostfile): expert (default: each rank holds a share of every MoE layer's experts) or "
                      "pipeline (a range of layers per rank). Rank 0 prints and serves. --ram-gb is per rank (each "
                      "streams its own experts). docs/distributed.md."),
    click.option("--shard-attention", "shard_attention", is_flag=True, default=None, expose_value=False,
                 callback=_remember,
                 help="With --parallel expert: split attention heads and the head's vocabulary between the ranks "
                      "(tensor parallel: less memory per rank, two more all_sums per layer and token) instead of "
                      "replicating them."),
]


def _load_options() -> dict:
    return click.get_current_context().meta.get("colibri.load", {})


def _check_load_options() -> None:
    """Flag combinations of the load options, and the --pin file, before anything is read."""
    options = _load_options()
    if "ram_gb" not in options:
        given = [f for f, k in (("--pin", "pin"), ("--pin-gb", "pin_gb")) if k in options]
        if given:
            raise click.UsageError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --ram-gb (--pin "
                                   "and --pin-gb choose which streamed experts stay in memory; without --ram-gb "
                                   "every expert is resident)")
        return
    if options.get("pin_gb") is not None and options["pin_gb"] > options["ram_gb"]:
        raise click.UsageError(f"--pin-gb {options['pin_gb']:g} is more than --ram-gb {options['ram_gb']:g} "
                               "(the pinned experts are part of the --ram-gb budget)")
    pin = options.get("pin")
    if pin is not None and pin != "auto":
        import os

        from .container.files import check_file
        from .experts.usage import read_usage

        if not os.path.lexists(pin):
            raise click.UsageError(f"--pin {pin}: no such file (give a .coli_usage file, or 'auto' for the "
                                   "model's own)")
        try:
            check_file(pin, None, "--pin's usage history")
            read_usage(pin)
        except ValueError as e:
            raise click.UsageError(f"--pin {e}") from None


def _open_for_cli(model_path):
    """``(opened model directory, tokenizer)``: every check that needs no weights (modeldir)."""
    from .models.modeldir import open_model_dir, resolve_model_path
    from .tokenizer import load_tokenizer

    if model_path is None:
        from .models import DEMO_MODEL_DIR

        click.echo(f"colibri: no -m given, using the bundled demo model ({DEMO_MODEL_DIR})", err=True)
        model_path = DEMO_MODEL_DIR
    model_path = resolve_model_path(model_path)   # a hub id (mlx-community/...) -> its cached snapshot
    opened = open_model_dir(model_path)
    tokenizer = load_tokenizer(model_path)
    tokenizer.check_vocab(opened.config["vocab_size"], opened.config_path)
    return opened, tokenizer


def _build_for_cli(opened):
    """The model's weights, loaded; a failure that is not a known error names the directory."""
    from .distributed import load_for_cli
    from .models.loading import build_model

    options = dict(_load_options())
    parallel = options.pop("parallel", None)
    shard_attention = bool(options.pop("shard_attention", False))
    try:
        model = load_for_cli(opened, parallel, options, shard_attention)   # None: one process
        if model is not None:
            return model
        model = build_model(opened, **options)
    except Exception as e:
        if is_user_error(e) or debug():
            raise
        raise click.ClickException(f"{opened.path}: cannot build the model from config.json and the shards: "
                                   f"{type(e).__name__}: {e} (COLIBRI_DEBUG=1 shows the traceback)") from None
    _note_small_budget(model)
    return model


def _note_small_budget(model) -> None:
    store = getattr(model, "expert_store", None)
    if store is None or not store.layouts:
        return
    k = model.args.num_experts_per_tok
    one = max(layout.nbytes for layout in store.layouts.values())
    if store.budget_bytes < k * one:
        click.echo(f"colibri: note: --ram-gb {store.budget_bytes / 1e9:g} holds fewer experts than one layer "
                   f"uses per token ({k} x {one / 1e6:.1f} MB = {k * one / 1e9:.3g} GB): most experts are read "
                   "from disk on every token", err=True)


def _stats_line(last, max_tokens=None, context=None) -> str:
    from . import kernels
    from .generate import peak_rss_bytes

    rss_gb = peak_rss_bytes() / 1e9
    line = (f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s | "
            f"peak memory: {last.peak_memory_gb:.2f} GB (MLX), {rss_gb:.2f} GB (process)")
    format_counters = getattr(kernels, "format_counters", None)
    line += f" | {format_counters()}" if format_counters else ""
    if last.finish_reason == "length" and max_tokens is not None and last.generation_tokens < max_tokens:
        line += (f" | stopped: context limit of {context} tokens reached (max_position_embeddings in "
                 "config.json)" if context else " | stopped: context limit reached")
    if getattr(last, "draft_stats", None):
        from .speculative import acceptance_summary

        line += f" | {acceptance_summary(last.draft_stats)}"
    if getattr(last, "expert_stats", None) is not None:
        from .experts import format_stats

        line += "\n" + format_stats(last.expert_stats)
    return line


_SAMPLING_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p"}


def _check_sampling(temperature, top_p, top_k, min_p) -> None:
    """Refuse bad sampling values before loading the model (minutes for a large one)."""
    from .generate import SamplingParams

    try:
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    except ValueError as e:
        message = str(e)
        for name, flag in _SAMPLING_FLAGS.items():
            if message.startswith(name + " "):
                message = flag + message[len(name):]
        raise click.UsageError(message) from None


def _context(opened) -> int:
    return opened.config.get("max_position_embeddings") or 4096


def _encode_prompt(tokenizer, opened, text: str, add_special_tokens: bool = True, template=None) -> list:
    """``text``'s token ids, checked against config.json (a text far past the context is refused
    from a prefix, without encoding all of it)."""
    ids, complete = tokenizer.encode_bounded(text, _context(opened), add_special_tokens)
    _check_prompt_ids(ids, opened, complete, template)
    return ids


def _encode_chat(tokenizer, opened, messages) -> list:
    # The template writes the special tokens itself (as Tokenizer.encode_chat).
    return _encode_prompt(tokenizer, opened, tokenizer.apply_chat_template(messages), add_special_tokens=False,
                          template=tokenizer.chat_template_source)


def _check_prompt_ids(ids, opened, complete: bool = True, template=None) -> None:
    """The encoded prompt against config.json, before the weights load."""
    import os

    if not ids:
        raise click.ClickException("the prompt encodes to no tokens (give some text)")
    vocab, context = opened.config["vocab_size"], _context(opened)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise click.ClickException(
            f"{os.path.join(opened.path, 'tokenizer.json')}: the prompt encodes to token id {bad[0]}, outside "
            f"the model's vocabulary (vocab_size={vocab} in {opened.config_path}): the tokenizer does not belong "
            "to this model")
    if len(ids) > context:
        # A template that inflates a short prompt is named: the fix may be there.
        rendered = f" as the chat template of {template} renders it" if template else ""
        raise click.ClickException(f"the prompt is {'' if complete else 'over '}{len(ids)} tokens{rendered}, more "
                                   f"than the model's context limit of {context} (max_position_embeddings in "
                                   f"{opened.config_path})")


def _utf8_text(text: str, what: str) -> str:
    """``text`` as given (argv and stdin decode undecodable bytes to surrogates), or a clear error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else None
        at = f"byte 0x{byte:02x}" if byte is not None else f"character {text[e.start]!r}"
        raise click.ClickException(f"{what} is not valid UTF-8 ({at} at character {e.start})") from None
    return text


def _read_stdin_text() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.ClickException(f"the prompt on stdin is not valid UTF-8 (byte 0x{data[e.start]:02x} at "
                                   f"offset {e.start})") from None


def _stream_reply(model, tokenizer, prompt_ids, opts, cache=None):
    """Print the reply as it streams; return (text, generated token ids, last response)."""
    from .generate import stream_generate

    parts, tokens, last = [], [], None
    for last in stream_generate(model, tokenizer, prompt_ids, cache=cache, **opts):
        click.echo(last.text, nl=False)
        parts.append(last.text)
        tokens.append(last.token)
    click.echo()
    return "".join(parts), tokens, last


@main.command()
@_sampling_options
@click.option("-p", "--prompt", required=True, help="The prompt ('-' reads it from stdin).")
@click.option("--no-chat-template", is_flag=True, help="Feed the prompt as is, without the chat template.")
@_draft_options
def generate(model_path, prompt, max_tokens, temperature, top_p, top_k, min_p, seed, system, no_chat_template, draft,
             num_draft):
    """Generate text for one prompt; the stats line goes to stderr.

    The prompt goes through the model's chat template (as a user message, after --system)
    unless --no-chat-template is given; a model without a template gets the plain prompt."""
    _check_sampling(temperature, top_p, top_k, min_p)
    if no_chat_template and system is not None:
        raise click.UsageError("--system needs the chat template (drop --no-chat-template)")
    _check_load_options()
    prompt = _read_stdin_text() if prompt == "-" else _utf8_text(prompt, "the prompt")
    if system is not None:
        system = _utf8_text(system, "the system message")
    opened, tokenizer = _open_for_cli(model_path)
    if no_chat_template:
        ids = _encode_prompt(tokenizer, opened, prompt)
    elif not tokenizer.chat_template:
        _without_template(tokenizer, opened, system, "generating from the plain prompt (as --no-chat-template)")
        ids = _encode_prompt(tokenizer, opened, prompt)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = _encode_chat(tokenizer, opened, messages)
    model = _build_for_cli(opened)
    _check_draft(model, draft)
    opts = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                draft=draft, num_draft=num_draft)
    _, _, last = _stream_reply(model, tokenizer, ids, opts)
    click.echo(_stats_line(last, max_tokens, model.max_length), err=True)


def _without_template(tokenizer, opened, system, instead: str) -> None:
    """A model without a chat template: ``--system`` cannot apply; say once what happens instead."""
    if system is not None:
        raise click.UsageError(f"--system needs a chat template, and the model has none "
                               f"({tokenizer.chat_template_source} has no chat_template)")
    click.echo(f"colibri: note: {opened.path} has no chat template: {instead}", err=True)


# Without a chat template, chat feeds the conversation as plain text: each message on its own line.
PLAIN_CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@main.command()
@_sampling_options
@_draft_options
def chat(model_path, max_tokens, temperature, top_p, top_k, min_p, seed, system, draft, num_draft):
    """Multi-turn chat that keeps the latent cache between turns. /reset clears it, /exit quits.

    A model without a chat template gets the conversation as plain text, one message a line."""
    _check_sampling(temperature, top_p, top_k, min_p)
    _check_load_options()
    if system is not None:
        system = _utf8_text(system, "the system message")
    opened, tokenizer = _open_for_cli(model_path)
    if not tokenizer.chat_template:
        _without_template(tokenizer, opened, system, "the conversation is fed as plain text, one message a line")
        tokenizer.chat_template, tokenizer.chat_template_source = PLAIN_CHAT_TEMPLATE, "colibri's plain-text chat"
    # The template renders now, not at the first message after minutes of loading.
    probe = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hello"}]
    _encode_chat(tokenizer, opened, probe)
    model = _build_for_cli(opened)
    _check_draft(model, draft)
    opts = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                draft=draft, num_draft=num_draft)
    session = _ChatSession(model, tokenizer, system)
    from .container import ContainerError
    # A strict decoder would fail on a bad byte and drop the rest of its buffer (the next lines):
    # keep the bytes as surrogates instead, and refuse that one line (_utf8_text).
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")
    click.echo("colibri chat: /reset clears the conversation, /exit quits.", err=True)
    while True:
        try:
            line = click.prompt(">", prompt_suffix=" ", default="", show_default=False)
        except (EOFError, click.Abort):
            break
        command = line.strip()
        if command == "/exit":
            break
        if command == "/reset":
            session.reset()
            click.echo("(conversation cleared)", err=True)
            continue
        if not command:
            continue
        try:
            last = session.turn(_utf8_text(line, "the message"), opts)
        except click.ClickException as e:  # a bad line: say so and read the next one
            click.echo(f"Error: {e.format_message()}", err=True)
            continue
        except ContainerError:  # a damaged shard (a streamed expert): no next line can fix it
            raise
        except ValueError as e:  # e.g. past the context limit: the conversation so far stays
            click.echo(f"Error: {e} (/reset starts over)", err=True)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat; the turn is undone
            click.echo("\n(reply interrupted; that message was dropped)", err=True)
            continue
        click.echo(_stats_line(last, max_tokens, model.max_length), err=True)


class _ChatSession:
    """Conversation state: messages, and the token ids the cache holds (to feed only new ones)."""

    def __init__(self, model, tokenizer, system):
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = self.model.make_cache()
        self.cached_ids: list[int] = []

    def turn(self, user_text, opts):
        """The reply's last response; on an error the conversation is as before the turn."""
        cache_offset = self.cache.offset
        try:
            return self._turn(user_text, opts)
        except BaseException:
            if self.messages and self.messages[-1] == {"role": "user", "content": user_text}:
                self.messages.pop()
            if self.cache.offset != cache_offset:  # stopped mid-reply: the cache holds a partial turn
                self.cache, self.cached_ids = self.model.make_cache(), []
            raise

    def _turn(self, user_text, opts):
        self.messages.append({"role": "user", "content": user_text})
        ids = self.tokenizer.encode_chat(self.messages)
        n = len(self.cached_ids)
        if ids[:n] != self.cached_ids or len(ids) <= n:
            # The template re-rendered earlier turns differently: start the cache over.
            self.cache, self.cached_ids, n = self.model.make_cache(), [], 0
        new_ids = ids[n:]
        text, tokens, last = _stream_reply(self.model, self.tokenizer, new_ids, opts, cache=self.cache)
        # The last generated token was sampled but never fed through the model.
        self.cached_ids = ids + tokens[:-1]
        self.messages.append({"role": "assistant", "content": text})
        return last


# --- bench / serve -------------------------------------------------------------------------

_MODEL_OPTION = click.option("-m", "--model", "model_path", default=None, type=click.Path(),
                             help="Container, Hugging Face or mlx-lm checkpoint directory, a GGUF file (or a directory "
                                  "of split ones), or a hub id (mlx-community/...). Default: the bundled demo model.")


_with_streaming_options = _options(_STREAMING_OPTIONS)


@main.command()
@_MODEL_OPTION
@click.option("--prompt-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--gen-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--repeat", default=3, show_default=True, type=click.IntRange(min=1), help="Measured runs.")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1), help="Sequences per run.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random prompt ids.")
@_with_streaming_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def bench(model_path, prompt_tokens, gen_tokens, repeat, batch, seed, as_json):
    """Prompt and generation tok/s on random prompts: a warm-up run, then --repeat runs (docs/serve.md)."""
    import json

    from .bench import format_table, report_json, run_bench

    _check_load_options()
    opened, tokenizer = _open_for_cli(model_path)
    if tokenizer.chat_template:  # bench feeds random ids, but a template that cannot render is a broken model
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    context = _context(opened)
    if prompt_tokens + gen_tokens > context:
        raise click.ClickException(f"--prompt-tokens {prompt_tokens} + --gen-tokens {gen_tokens} = "
                                   f"{prompt_tokens + gen_tokens} exceeds the model's context limit of {context} "
                                   f"tokens (max_position_embeddings in {opened.config_path})")
    model = _build_for_cli(opened)
    name = model_path if model_path is not None else "demo"
    report = run_bench(model, prompt_tokens, gen_tokens, repeat, batch, seed, model_name=name)
    click.echo(json.dumps(report_json(report), indent=1) if as_json else format_table(report))


@main.command()
@_MODEL_OPTION
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1),
              help="Default when a request gives none.")
@click.option("--temp", "temperature", default=0.0, show_default=True, type=_Finite(min=0),
              help="Default sampling temperature; 0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=_Finite(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 disables top-k.")
@click.option("--min-p", default=0.0, show_default=True, type=_Finite(0, 1))
@click.option("--draft", type=click.Choice(["mtp", "ngram", "none"]), default=None,
              help="Speculative decoding for requests that name no draft (docs/speculative.md): the model's MTP "
                   "layer, prompt lookup, or off (the default). Drafts fill the decode rows a step has room for: "
                   "up to 4 requests at once speculate.")
@click.option("--num-draft", default=3, show_default=True, type=click.IntRange(1, 7),
              help="Tokens drafted per step, at most.")
@click.option("--api-key", default=None, envvar="COLIBRI_API_KEY",
              help="Require 'Authorization: Bearer KEY' (401 otherwise; /health stays open). Env: COLIBRI_API_KEY.")
@click.option("--allow-origin", default=None,
              help="CORS: the Access-Control-Allow-Origin value to send ('*' or an origin); off by default.")
@click.option("--max-connections", default=128, show_default=True, type=click.IntRange(min=1),
              help="Requests served at once (a worker thread each); 4x as many more wait, then 503 with "
                   "Retry-After.")
@click.option("--read-timeout", default=30.0, show_default=True, type=_Finite(min=0, min_open=True),
              help="Seconds a request may take to arrive (a half-sent one gets 408; an idle keep-alive is closed).")
@click.option("--decode-concurrency", default=32, show_default=True, type=click.IntRange(min=1),
              help="Requests decoded together (continuous batching).")
@click.option("--prompt-concurrency", default=8, show_default=True, type=click.IntRange(min=1),
              help="Prompts prefilled together (continuous batching).")
@click.option("--prefill-step-size", default=2048, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens per prefill chunk (continuous batching).")
@click.option("--prompt-cache-bytes", default=None, type=_ByteSize(),
              help="Byte bound of the prompt cache (e.g. 8GB; default unbounded, as mlx_lm.server; at most 10 entries).")
@_with_streaming_options
def serve(model_path, host, port, max_tokens, temperature, top_p, top_k, min_p, draft, num_draft, api_key,
          allow_origin, max_connections, read_timeout, decode_concurrency, prompt_concurrency, prefill_step_size,
          prompt_cache_bytes):
    """OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models (docs/serve.md)."""
    from .serve import SamplingDefaults, model_id_for, serve as run_server

    _check_load_options()
    opened, tokenizer = _open_for_cli(model_path)
    if tokenizer.chat_template:  # /v1/chat/completions would fail on every request: say so now
        tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
    model = _build_for_cli(opened)
    _check_draft(model, draft)
    defaults = SamplingDefaults(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, draft=draft, num_draft=num_draft)
    try:
        run_server(model, tokenizer, host, port, model_id_for(model_path), defaults,
                   engine_options=dict(decode_concurrency=decode_concurrency, prompt_concurrency=prompt_concurrency,
                                       prefill_step_size=prefill_step_size, prompt_cache_bytes=prompt_cache_bytes),
                   max_connections=max_connections, read_timeout=read_timeout, api_key=api_key,
                   allow_origin=allow_origin)
    except OSError as e:  # address in use, host not found
        raise click.ClickException(f"cannot serve on {host}:{port}: {e}") from None


def _add_convert_command():
    # The command module imports only click; the converter itself loads when the command runs.
    from .convert.command import convert_command

    main.add_command(convert_command)


_add_convert_command()


if __name__ == "__main__":
    main()
