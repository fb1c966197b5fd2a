"""A model directory, opened and checked before any weight is read.

:func:`open_model_dir` is everything that can fail without touching tensor bytes, in the order a
user would fix it: the path is a directory, it has a config.json (else it is not a model
directory at all), config.json is UTF-8 JSON holding an object that fits the model's schema
(``config_schema``), every ``*.safetensors`` is a regular file inside the directory (or a Hugging
Face cache blob) with a valid header holding tensors, and config.json's layer and expert counts
match the shards.
Each failure is one message naming the file and the key or tensor. It costs a header read per
shard: seconds for the largest models, against minutes to load their weights.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..container import Container, ContainerError
from ..container.files import read_json_object
from ..errors import ConfigError
from .config_schema import check_against_shards, validate_config

CONFIG_FILE = "config.json"


@dataclass
class ModelDir:
    """A checked model directory: its validated config.json and its opened shards."""

    path: str
    config: dict
    container: Container

    @property
    def config_path(self) -> str:
        return os.path.join(self.path, CONFIG_FILE)


# "owner/name" as the Hugging Face hub spells a repository id.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What a model directory needs from a hub repository (weights, config, tokenizer, chat template).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py"]


def resolve_model_path(path) -> str:
    """A local directory as given; else a hub id (``mlx-community/...``) resolved as mlx-lm does,
    through ``huggingface_hub.snapshot_download``: the local cache first, a download when allowed.
    With ``HF_HUB_OFFLINE=1`` only the cache is used; a repository not in it is an error that
    says so."""
    path = os.fspath(path)
    if os.path.exists(path) or not HUB_ID.match(path):
        return path
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise FileNotFoundError(f"{path}: no such directory (a Hugging Face hub id needs the huggingface_hub "
                                "package: pip install huggingface_hub)") from None
    from huggingface_hub import constants

    try:
        return snapshot_download(path, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError:
        where = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(f"{path}: no such directory, and the Hugging Face hub repository {path!r} is "
                                    f"not in the cache ({where}) while HF_HUB_OFFLINE is set: download it "
                                    f"first (huggingface-cli download {path}) or unset HF_HUB_OFFLINE") from None
        raise FileNotFoundError(f"{path}: no such directory, and the Hugging Face hub repository {path!r} could "
                                f"not be downloaded (no connection?) and is not in the cache ({where})") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{path}: no such directory, and no Hugging Face hub repository {path!r} "
                                "(or it is private: log in with huggingface-cli login)") from None


def check_model_path(path) -> str:
    """``path`` as a string if it is a directory holding a config.json; else a clear error."""
    path = os.fspath(path)
    if not path:
        raise FileNotFoundError("the model directory path is empty (give the directory that holds config.json)")
    if not os.path.exists(path):
        if path.endswith(".gguf"):
            raise FileNotFoundError(f"{path}: no such GGUF file")
        raise FileNotFoundError(f"{path}: model directory does not exist")
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                raise NotADirectoryError(f"{path}: a GGUF file, but its name does not end in .gguf (rename it)")
        raise NotADirectoryError(f"{path}: is a file, not a model directory (give the directory that holds "
                                 "config.json and the *.safetensors shards)")
    if not os.path.lexists(os.path.join(path, CONFIG_FILE)):
        raise FileNotFoundError(f"{path}: not a model directory: it has no config.json{_hint(path)}")
    return path


def _hint(path: str) -> str:
    """Where the model directory probably is, when ``path`` is one level above it."""
    snapshots = os.path.join(path, "snapshots")
    if os.path.isdir(snapshots):
        revs = sorted(os.listdir(snapshots))[:1]
        where = os.path.join(snapshots, revs[0]) if revs else snapshots + "/<revision>"
        return f" (a Hugging Face cache repository: give one of its snapshots, e.g. {where})"
    try:
        entries = sorted(os.listdir(path))[:64]
    except OSError:
        return ""
    inner = [e for e in entries if os.path.isfile(os.path.join(path, e, CONFIG_FILE))]
    if inner:
        return f" (did you mean {os.path.join(path, inner[0])}?)"
    return ""


def read_config(path) -> dict:
    """config.json of the model directory ``path``, validated against the schema."""
    path = check_model_path(path)
    cfg = os.path.join(path, CONFIG_FILE)
    config = read_json_object(cfg, path, CONFIG_FILE, error=ConfigError)
    validate_config(config, cfg)
    return config


def open_model_dir(path) -> ModelDir:
    """Check everything short of the weights (module docstring); the opened directory. A GGUF
    file (or a directory of split ones) opens as ``gguf_checkpoint.GgufModelDir``."""
    from .gguf_checkpoint import is_gguf_path, open_gguf

    if is_gguf_path(path):
        return open_gguf(path)
    config = read_config(path)
    path = os.fspath(path)
    container = Container(path, config=config)
    for shard in container.shards:  # a shard is read for its tensors: one without any is damaged
        if not container.shard_tensors(shard):
            raise ContainerError(f"{shard}: a safetensors shard that holds no tensors (an interrupted write, or the "
                                 "wrong file?)")
    check_against_shards(config, container.names(), os.path.join(path, CONFIG_FILE), path)
    return ModelDir(path, config, container)
