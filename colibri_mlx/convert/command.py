"""The `convert` command (click). Imports only click; the converter loads when it runs.

Option names and meanings are upstream's (`c/tools/convert_fp8_to_int4.py`); `--recipe`,
`--revision`, `--no-stats` and `--no-progress` are ours.
"""

from __future__ import annotations

import click

_RECIPE_HELP = ("named option mix: default (int4 g64, int8 io), e8x4g64 / wq-v0 (int8 spine, int4 g64 "
                "experts), e8 (fmt 6 experts), e8-int8, int3-up, int8, row4; explicit options override it")


def _bits_option(flag: str, help_text: str):
    return click.option(flag, default=None, metavar="N|e8" if flag in ("--xbits", "--gate-bits", "--up-bits",
                                                                         "--down-bits") else "N",
                        help=help_text)


@click.command("convert", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--indir", type=click.Path(file_okay=False), help="local checkpoint directory (*.safetensors)")
@click.option("--repo", help="Hugging Face repo id: download a shard, convert it, delete it, next")
@click.option("--outdir", required=True, type=click.Path(file_okay=False), help="output container directory")
@click.option("--recipe", default=None, help=_RECIPE_HELP)
@_bits_option("--ebits", "bits for resident weights (default 4; 8 with --mtp/--indexer)")
@_bits_option("--io-bits", "bits for embed_tokens / lm_head (default 8)")
@_bits_option("--xbits", "bits for routed experts, or e8 for fmt 6 (default = ebits)")
@_bits_option("--shared-bits", "bits for shared experts (default = ebits)")
@_bits_option("--o-bits", "bits for attention o_proj (default = ebits)")
@_bits_option("--kvb-bits", "bits for kv_b_proj (default = ebits)")
@_bits_option("--attn-bits", "bits for q_a/q_b/kv_a projections (default = ebits)")
@_bits_option("--dmlp-bits", "bits for the dense layers' MLP (default = ebits)")
@_bits_option("--gate-bits", "bits for routed experts' gate_proj (default = xbits)")
@_bits_option("--up-bits", "bits for routed experts' up_proj, e.g. 3 = int3-g64 (default = xbits)")
@_bits_option("--down-bits", "bits for routed experts' down_proj (default = xbits)")
@click.option("--group-size", type=int, default=None,
              help="int4 group size (default 64; 0 = per-row); one of 16 32 48 64 96 128 192 256")
@click.option("--n-layers", type=click.IntRange(min=1), default=None,
              help="main layers; layer N is the MTP head (default: config.json num_hidden_layers)")
@click.option("--mtp", is_flag=True, help="convert only the MTP head (layer n_layers) -> out-mtp-*")
@click.option("--indexer", is_flag=True, help="convert only the DSA indexer weights -> out-idx-*")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="worker processes encoding tensors in parallel (output identical to --jobs 1)")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="upstream's shard-parallel option; here the same pool as --jobs (max of the two)")
@click.option("--min-free-gb", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="--repo: refuse to start / stop when less disk is free")
@click.option("--revision", default=None, help="--repo: branch, tag or commit")
@click.option("--stats/--no-stats", default=True, show_default=True,
              help="decode every tensor to report the relative RMS reconstruction error")
@click.option("--progress/--no-progress", default=True, show_default=True, help="progress bar")
def convert_command(indir, repo, outdir, recipe, n_layers, mtp, indexer, jobs, workers, min_free_gb,
                    revision, stats, progress, **bit_options):
    """Convert a Hugging Face checkpoint (BF16/F16/F32, FP8 block-scaled, NVFP4) into a colibri
    container. Resumable: rerun the same command after an interruption."""
    import math

    from ..container import ContainerError
    from .classify import ConvertError
    from .converter import convert

    if not math.isfinite(min_free_gb):
        raise click.BadParameter(f"{min_free_gb} is not a finite number", param_hint="'--min-free-gb'")
    try:
        convert(outdir, indir=indir, repo=repo, recipe=recipe, n_layers=n_layers, mtp=mtp, indexer=indexer,
                jobs=jobs, workers=workers, min_free_gb=min_free_gb, revision=revision, stats=stats,
                progress=progress, **bit_options)
    except (ConvertError, ContainerError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:  # a full disk, a read-only --outdir: one line naming the file (cli's describe)
        from ..errors import describe_os_error

        raise click.ClickException(describe_os_error(e)) from None
