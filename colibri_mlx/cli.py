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


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def inspect(directory, as_json):
    """List every tensor of a container: fmt, gs, O x I, bytes, totals; exit 1 if any cannot be read."""
    import json

    from .container import ContainerError
    from .container.inspect import format_table, inspect_container, report_json

    try:
        report = inspect_container(directory)
    except ContainerError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report_json(report), indent=1) if as_json else format_table(report))
    if not report.ok:
        raise SystemExit(1)


def _add_convert_command():
    # The command module imports only click; the converter itself loads when the command runs.
    from .convert.command import convert_command

    main.add_command(convert_command)


_add_convert_command()


if __name__ == "__main__":
    main()
