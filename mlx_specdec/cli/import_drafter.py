"""`mlx-specdec import-drafter`: an Apple ReDrafter checkpoint made into a head `--drafter` loads."""

from __future__ import annotations

import sys
from datetime import date
from pathlib import Path

from ..errors import UserError
from .args import MODEL_HELP


def add_parser(sub) -> None:
    p = sub.add_parser("import-drafter", help="import an Apple ReDrafter drafter checkpoint as a head",
                       description="Convert a drafter trained by Apple's recurrent_drafting (a directory "
                                   "with config.json, model_type recurrent_drafting_drafter, and "
                                   "model.safetensors) into a head directory for --drafter, checked "
                                   "against the model it was trained for.")
    p.add_argument("source", help="the drafter's directory (config.json + model.safetensors)")
    p.add_argument("--model", "-m", default="default", help="the LLM it was trained for; " + MODEL_HELP)
    p.add_argument("--output", "-o", required=True, help="head directory to write")
    p.add_argument("--top-k", type=int, default=None,
                   help="keep this many of the head's logits per draft step, as Apple's drafter does "
                        "(default 50; 0 = all)")
    p.add_argument("--force", action="store_true", help="overwrite an existing head directory")
    p.set_defaults(func=cmd_import_drafter)


def _model_sizes(lm) -> tuple:
    """(hidden size, vocabulary size) from the model's config.json: its weights are not needed."""
    config = lm.config.get("text_config") or lm.config
    try:
        return int(config["hidden_size"]), int(config["vocab_size"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{lm.path}/config.json states no hidden_size and vocab_size") from None


def _check_sizes(cfg: dict, lm, src: Path) -> None:
    hidden, vocab = _model_sizes(lm)
    if cfg["hidden_size"] != hidden:
        raise UserError(f"{src}: the drafter's hidden_size is {cfg['hidden_size']}, but {lm.name} has "
                        f"hidden size {hidden}: it was trained for another model")
    if cfg["vocab_size"] != vocab:
        raise UserError(f"{src}: the drafter's vocab_size is {cfg['vocab_size']}, but {lm.name} has "
                        f"vocabulary size {vocab}: it was trained for another model")


def _card(src: Path, cfg: dict, fields: dict, lm, dtype: str) -> str:
    H, X, N, V = (cfg[k] for k in ("hidden_size", "exit_dim", "num_draft_layers", "vocab_size"))
    proj = f"an input projection to {X}" if fields["exit_dim"] else f"no input projection (width {2 * H})"
    rec = "SiLU(U s + W e + b), s_0 = 0" if fields["recurrence"] == "rnn" else "s_t = s_(t-1) + e_t"
    top = fields["logits_top_k"]
    return f"""# ReDrafter head imported from an Apple `recurrent_drafting` checkpoint

Made by `mlx-specdec import-drafter` on {date.today().isoformat()} from `{src}` for `{lm.name}`.
Not trained here: how well it drafts is the source's; nothing was measured at import.

| | |
|---|---|
| source | `{src}` (model_type `recurrent_drafting_drafter`) |
| model | `{lm.name}`: hidden size {H}, vocabulary {V}; the tokenizer's sha256 is in `config.json` |
| recurrence | {rec} (Apple's `rnn: {str(cfg.get('rnn', False)).lower()}`) |
| layers | {proj}, {N} residual blocks, a {V}-way output with no bias |
| draft logits | {f"the {top} largest kept per step, as Apple's drafter does" if top else "all kept"} |
| weights | `model.safetensors` in {dtype} |

Apple's tensor names map to ours as `rnn_w` -> `W`, `rnn_u` -> `U` (its bias -> `W.bias`),
`input_proj` -> `input_proj`, `lm_head.i.linear` -> `blocks.i`, `lm_head.{N}` -> `proj`; Apple feeds
`[hidden, state]` and this head `[state, hidden]`, so the feature axis is permuted to match
(`mlx_specdec/redrafter_head/apple.py`).
"""


def cmd_import_drafter(args) -> int:
    import mlx.core as mx

    from ..model.loader import load_tokenizer_only
    from ..redrafter_head import apple
    from ..redrafter_head.model import CONFIG_FILE, DrafterConfig, DrafterHead, save_drafter, tokenizer_hash

    src = Path(args.source).expanduser()
    out = Path(args.output).expanduser()
    if args.top_k is not None and args.top_k < 0:
        raise UserError("--top-k is 0 (all logits) or a positive count")
    if (out / CONFIG_FILE).exists() and not args.force:
        raise UserError(f"{out} already holds a head (--force overwrites it)")
    cfg = apple.read_apple_config(src)
    lm = load_tokenizer_only(args.model)  # the sizes and the tokenizer: the weights stay on disk
    if args.model not in (None, "", "default") and not Path(args.model).exists():
        lm.name = args.model  # a hub id, as `load_model` names it
    _check_sizes(cfg, lm, src)
    weights = apple.read_apple_weights(src)
    apple.check_weights(src, cfg, weights)
    top_k = apple.APPLE_TOP_K if args.top_k is None else args.top_k
    fields, converted = apple.convert(cfg, weights, top_k=top_k)
    config = DrafterConfig(**fields, model_name=lm.name, tokenizer_hash=tokenizer_hash(lm.tokenizer))
    head = DrafterHead(config)
    head.load_weights([(k, mx.array(v)) for k, v in converted.items()], strict=True)
    dtype = apple.source_dtype(cfg) or "float32"
    save_drafter(head, out, dtype=getattr(mx, dtype))
    (out / "CARD.md").write_text(_card(src, cfg, fields, lm, dtype))
    print(f"wrote {out}: {head.num_params():,} parameters, {cfg['num_draft_layers']} blocks, "
          f"rnn={str(cfg.get('rnn', False)).lower()}; use it with --model {args.model} --drafter {out}",
          file=sys.stderr)
    return 0
