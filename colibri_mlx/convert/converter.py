"""`convert()`: the one entry point behind `colibri convert` and scripts/convert/convert_hf.py."""

from __future__ import annotations

import fnmatch
import os
import sys
import tempfile
from contextlib import ExitStack
from typing import Callable, Optional

from .classify import ConvertError
from .pipeline import (METADATA_FILES, METADATA_PATTERNS, Conversion, OutdirLock, Summary, check_metadata,
                       copy_metadata, list_shards, read_json, read_weight_map, shards_for_mode)
from .recipes import describe, resolve_plan

DEFAULT_N_LAYERS = 78  # upstream's default (GLM-5.2); used only when config.json is absent


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def convert(outdir: str, indir: Optional[str] = None, repo: Optional[str] = None, *,
            recipe: Optional[str] = None, n_layers: Optional[int] = None, mtp: bool = False,
            indexer: bool = False, jobs: int = 1, workers: int = 1, min_free_gb: float = 20.0,
            revision: Optional[str] = None, stats: bool = True, progress: bool = True,
            log: Callable[[str], None] = _log, **bit_options) -> Summary:
    """Convert a Hugging Face checkpoint (local `indir` or Hub `repo`) into a colibri container.

    `bit_options` are ebits, io_bits, xbits, shared_bits, o_bits, kvb_bits, attn_bits,
    dmlp_bits, gate_bits, up_bits, down_bits, group_size (None = recipe/upstream default).
    The whole plan (options, recipe, source, output directory state, source shapes against
    config.json) is validated before the output directory is created or written.
    Returns the per-class summary of the whole container pass.
    """
    if (indir is None) == (repo is None):
        raise ConvertError("give exactly one of --indir DIR or --repo ID")
    if mtp and indexer:
        raise ConvertError("--mtp and --indexer are separate passes; run them one at a time")
    mode = "mtp" if mtp else "indexer" if indexer else "main"
    resolve_plan(bit_options, recipe, mode, n_layers or DEFAULT_N_LAYERS)  # bad options: no I/O at all
    if indir is not None:
        if not os.path.isdir(indir):
            raise ConvertError(f"--indir {indir}: not a directory")
        if os.path.exists(outdir) and os.path.samefile(indir, outdir):
            raise ConvertError(f"--outdir {outdir} is the --indir directory; write the container to a new directory")
        return _convert_local(indir, outdir, mode, recipe, n_layers, bit_options, max(jobs, workers), stats,
                              progress, log)
    return _convert_repo(repo, outdir, mode, recipe, n_layers, bit_options, max(jobs, workers), min_free_gb,
                         revision, stats, progress, log)


def _check_config(config: Optional[dict], source: str) -> None:
    """A config.json of a model type the engine runs must load once converted: check it now,
    not after hours of conversion. Other model types convert as upstream converts them."""
    if not config:
        return
    from ..models.config_schema import MODEL_TYPES, validate_config

    if config.get("model_type") in MODEL_TYPES:
        try:
            validate_config(config, source)
        except ValueError as e:
            raise ConvertError(f"{e} (the container would not load; fix config.json first)") from None
    layers = config.get("num_hidden_layers")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ConvertError(f"{source}: num_hidden_layers: got {layers!r}; expected an integer >= 1")


def _check_complete(config: Optional[dict], shards: list[str], weight_map: Optional[dict], source: str,
                    indir: str, n_layers: int, log) -> None:
    """The main pass's tensors are all there. With an index (a release checkpoint), every tensor it
    names below layer ``n_layers`` must be in the shard it names, and the checkpoint must hold every
    tensor config.json implies (the loader's rules, as `colibri inspect` applies them) and no layer
    or expert config.json does not count: a container converted without them would not load, and
    the conversion may take hours. Without an index (a hand-made or partial checkpoint, converted
    as upstream converts it) a shortfall is a warning."""
    from ..container import read_shard_header
    from ..container.inspect import find_missing
    from ..models.config_schema import MODEL_TYPES, check_against_shards
    from .classify import layer_index

    held: dict[str, set] = {os.path.basename(p): set(read_shard_header(p).tensors) for p in shards}
    index = os.path.join(indir, "model.safetensors.index.json")
    for name, shard in (weight_map or {}).items():
        if layer_index(name) < n_layers and shard in held and name not in held[shard]:
            raise ConvertError(f"{index}: names tensor {name!r} in {shard}, which does not hold it (a damaged or "
                               "re-saved shard, or the index of another download?)")
    if not config or config.get("model_type") not in MODEL_TYPES:
        return
    names = set().union(*held.values())
    try:
        check_against_shards(config, names, source, indir)
        missing = find_missing(config, names).required
        if missing:
            plural = "s" if len(missing) > 1 else ""
            raise ConvertError(f"{indir}: the checkpoint lacks {len(missing):,} tensor{plural} "
                               f"{source} implies ({missing[0]}{', ...' if len(missing) > 1 else ''}; a shard "
                               "missing from the download, or another model's config.json?)")
    except ValueError as e:  # ConfigError, ConvertError
        if weight_map is None:
            log(f"[plan] WARNING: {e}; the container will not load as it is")
            return
        raise ConvertError(f"{e}; the container would not load") from None


def _refuse_container(indir: str, shards: list[str]) -> None:
    """`--indir` pointing at one of our containers would be re-quantized (or refused tensor by
    tensor as 'U8 is not a supported weight encoding'): say what it is instead."""
    from ..container import STAMP_KEY, ContainerError, read_shard_header
    from ..container.reader import UPSTREAM_STAMP_KEY

    marks = [n for n in (".out-progress.json", ".out-mtp-progress.json", ".out-idx-progress.json")
             if os.path.exists(os.path.join(indir, n))]
    for path in shards:
        try:
            header = read_shard_header(path)  # the container's parser: U8 shapes are free there
        except ContainerError:
            continue  # a damaged shard: check_sources names it
        meta = header.metadata
        if STAMP_KEY in meta or UPSTREAM_STAMP_KEY in meta or "colibri_mlx.convert" in meta or \
                any(n.endswith(".qs") for n in header.tensors):
            marks.append(os.path.basename(path))
            break
    if marks:
        raise ConvertError(f"--indir {indir} is already a colibri container ({marks[0]}); it needs no conversion: "
                           f"run it with `colibri generate -m {indir}` (--indir takes a Hugging Face checkpoint)")


def _plan(config: Optional[dict], n_layers, recipe, mode, bit_options, log):
    if n_layers is None:
        if config and config.get("num_hidden_layers") is not None:
            n_layers = int(config["num_hidden_layers"])
        else:
            n_layers = DEFAULT_N_LAYERS
            log(f"[plan] no num_hidden_layers in config.json: --n-layers defaults to {n_layers} (GLM-5.2)")
    plan = resolve_plan(bit_options, recipe, mode, n_layers)
    log(describe(plan, mode))
    if mode == "mtp" and plan.ebits != "e8" and plan.ebits < 8 and plan.group_size <= 0:
        log(f"WARNING: --mtp with --ebits {plan.ebits} and per-row scales zeroes eh_proj's embedding half "
            "(MTP acceptance ~0%, upstream issue #8); use --ebits 8 or a group size")
    return plan


def _expected_shapes(config: Optional[dict], log) -> Optional[dict]:
    """config.json's [O, I] of every 2-D weight, or None (with a warning) where it implies none."""
    from ..container import expected_shapes

    if config is None:
        log("[plan] WARNING: no config.json: source tensor shapes are not checked")
        return None
    try:
        return expected_shapes(config)
    except (KeyError, ValueError) as e:
        # Upstream converts any checkpoint; only the engine needs a known model_type.
        log(f"[plan] WARNING: source tensor shapes are not checked ({e.args[0] if e.args else e})")
        return None


def _finish(summary: Summary, outdir: str, log):
    log(summary.table())
    log(f"container -> {outdir}")
    return summary


def _convert_local(indir, outdir, mode, recipe, n_layers, bit_options, jobs, stats, progress, log):
    config = read_json(os.path.join(indir, "config.json"))
    all_shards = list_shards(indir)
    _refuse_container(indir, all_shards)
    _check_config(config, os.path.join(indir, "config.json"))
    plan = _plan(config, n_layers, recipe, mode, bit_options, log)
    weight_map = read_weight_map(os.path.join(indir, "model.safetensors.index.json"))
    shards = shards_for_mode(all_shards, weight_map, mode, plan.n_layers)
    conversion = Conversion(outdir, plan, mode, jobs, stats, progress, name_by_index=False, log=log,
                            expected_shapes=_expected_shapes(config, log))
    conversion.check_outdir()
    if conversion.check_sources(shards) == 0:
        raise ConvertError(_nothing_to_convert(indir, mode, plan.n_layers))
    if mode == "main" and (n_layers is None or n_layers == (config or {}).get("num_hidden_layers")):
        _check_complete(config, shards, weight_map, os.path.join(indir, "config.json"), indir, plan.n_layers, log)
    check_metadata(indir)
    with OutdirLock(outdir):
        summary = conversion.run(shards)
        if mode == "main":  # the --mtp/--indexer passes add to a container that has its metadata
            copied, missing = copy_metadata(indir, outdir)
            log(f"[meta] copied: {', '.join(copied) or 'nothing'}")
            if missing:
                log(f"[meta] WARNING: {', '.join(missing)} not found in {indir} (the engine needs config.json, "
                    "chat needs tokenizer.json)")
    return _finish(summary, outdir, log)


def _convert_repo(repo, outdir, mode, recipe, n_layers, bit_options, jobs, min_free_gb, revision,
                  stats, progress, log):
    from .hub import HubSource, require_free

    require_free(outdir, min_free_gb, starting=True)
    hub = HubSource(repo, outdir, revision)
    meta_names = [n for n in hub.sizes if n in METADATA_FILES
                  or any(fnmatch.fnmatch(n, p) for p in METADATA_PATTERNS)]
    # Planning reads config.json and the index from a scratch directory: the output is
    # touched only once the plan and its state are known good.
    with ExitStack() as locked:
        with tempfile.TemporaryDirectory(prefix="colibri-convert-meta-") as meta_dir:
            hub.fetch_metadata(meta_names, meta_dir)
            config = read_json(os.path.join(meta_dir, "config.json"))
            _check_config(config, f"{repo}/config.json")
            plan = _plan(config, n_layers, recipe, mode, bit_options, log)
            weight_map = hub.weight_map(meta_dir) if mode != "main" else None
            shards = shards_for_mode(hub.shards, weight_map, mode, plan.n_layers)
            # Upstream's --repo naming: out-NNNNN is the source shard's index, even for empty outputs.
            conversion = Conversion(outdir, plan, mode, jobs, stats, progress, name_by_index=True, log=log,
                                    expected_shapes=_expected_shapes(config, log))
            conversion.check_outdir()
            locked.enter_context(OutdirLock(outdir))
            if mode == "main":
                copied, _ = copy_metadata(meta_dir, outdir)
                log(f"[meta] copied: {', '.join(copied) or 'nothing'}")
        sizes = {s: hub.sizes.get(s) or 0 for s in shards}
        summary = conversion.run(shards, sizes=sizes, fetch=hub.fetch_shard, release=hub.release,
                                 before_shard=lambda: require_free(outdir, min_free_gb, starting=False))
    hub.cleanup()
    if not summary.rows:
        raise ConvertError(_nothing_to_convert(f"--repo {repo}", mode, plan.n_layers))
    return _finish(summary, outdir, log)


def _nothing_to_convert(source: str, mode: str, n_layers: int) -> str:
    what = {"main": "no tensors of the main pass",
            "mtp": f"no multi-token-prediction layer (model.layers.{n_layers}.*)",
            "indexer": f"no DSA indexer tensors (model.layers.<i>.self_attn.indexer.*, i < {n_layers})"}[mode]
    return f"{source}: {what}; nothing to convert (is --n-layers right, or is this the wrong checkpoint?)"
