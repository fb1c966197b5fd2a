#!/usr/bin/env python3
"""Hugging Face checkpoint -> colibri container; the same command as `colibri convert`.

    python scripts/convert/convert_hf.py --indir HF_DIR --outdir OUT [--recipe default] [--jobs 2]
    python scripts/convert/convert_hf.py --repo zai-org/GLM-5.2-FP8 --outdir OUT --min-free-gb 20
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from colibri_mlx.convert.command import convert_command  # noqa: E402

if __name__ == "__main__":
    convert_command(prog_name=os.path.basename(sys.argv[0]))
