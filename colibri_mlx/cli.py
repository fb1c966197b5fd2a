"""The `colibri` command line.

Each subcommand parses options here and imports its implementation lazily, so that
`colibri --help` stays instant and a missing optional dependency only affects its command.
"""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="colibri")
def main():
    """colibri_mlx: run DeepSeek-V3/R1, Kimi-K2 and GLM-5.x mixture-of-experts models
    from colibri containers (or Hugging Face checkpoints) on MLX."""


if __name__ == "__main__":
    main()
