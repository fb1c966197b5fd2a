"""colibri_mlx: DeepSeek-V3 / Kimi-K2 / GLM-5.x mixture-of-experts inference on MLX,
straight from colibri's quantized containers."""

__version__ = "0.1.0"


def load(path=None, **options):
    """Load a container or Hugging Face checkpoint directory -> (model, tokenizer)."""
    from .models import load as _load

    return _load(path, **options)


def generate(model, tokenizer, prompt, **kwargs):
    from .generate import generate as _generate

    return _generate(model, tokenizer, prompt, **kwargs)


def stream_generate(model, tokenizer, prompt, **kwargs):
    from .generate import stream_generate as _stream_generate

    return _stream_generate(model, tokenizer, prompt, **kwargs)
