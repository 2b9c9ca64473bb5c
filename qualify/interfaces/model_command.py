"""``qualify model inspect MODEL``: load a model the way a lane would (``--model``'s loader) and
print what it is, or refuse it in one line (exit 2). MODEL is a published model's name
(``qualify.engines.model_source.PUBLISHED_MODELS``), a Hugging Face directory or a GGUF file."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from qualify.core.arguments import OneLineParser

_OUT = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)


def model_inspect_cli(argv: Sequence[str]) -> int:
    """Geometry, tokenizer and every file's digest of MODEL; 0 when it loads whole, 2 when refused."""
    from qualify.engines.model_source import PUBLISHED_MODELS, load_model, resolve_model

    parser = OneLineParser(prog="qualify model inspect",
                           description="load a model as a lane would and print what it is")
    parser.add_argument("model", metavar="MODEL",
                        help=f"a published model ({', '.join(PUBLISHED_MODELS)}), a Hugging Face "
                             "directory or a GGUF file")
    args = parser.parse_args(list(argv))
    model = load_model(resolve_model(args.model))
    geometry = model.geometry
    config = model.config
    scaling = config.rope_scaling
    rope = "" if scaling is None else (
        f" scaled by {len(scaling.frequency_factors)} frequency factors up to x{scaling.factor:g}"
        if scaling.rope_type == "frequency-factors" else f" scaled {scaling.rope_type} x{scaling.factor:g}")
    _OUT.print(f"model {args.model}: {model.kind}, {config.architecture}, {geometry.layers} layers, hidden {geometry.hidden}, "
               f"{geometry.heads} heads / {geometry.kv_heads} KV heads x {geometry.head_dim}, intermediate "
               f"{model.config.intermediate}, vocab {geometry.vocab}, max positions {geometry.max_positions}, "
               f"RoPE theta {geometry.rope_theta:g}{rope}, RMS norm eps {model.config.rms_norm_eps:g}")
    parameters = sum(int(weight.size) for weight in model.weights.values())
    _OUT.print(f"weights: {len(model.weights)} tensors, {parameters} parameters, float32 ("
               f"{'tied LM head' if config.tied_head else 'untied lm_head'}{', Q/K/V biases' if config.qkv_bias else ''})")
    _OUT.print(f"tokenizer: {model.tokenizer.get_vocab_size(with_added_tokens=True)} tokens")
    published = PUBLISHED_MODELS.get(args.model)
    if published is not None:
        _OUT.print(f"published: {published.upstream}; license {published.license}; "
                   f"{published.distribution} {published.version}")
    for entry in model.files:  # whole digests, never cut to the terminal's width
        _OUT.print(f"file {entry.name}: {entry.size_bytes} bytes, sha256 {entry.sha256}")
    return 0
