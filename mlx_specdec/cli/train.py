"""`mlx-specdec train-drafter`, `train-apar` and `train-fork-probe`: training on the model's own answers."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List

from ..errors import UserError
from .args import _add_model_args, _comma_list, load_engine

TRAIN_PROMPTS_DEFAULT = "data/train_prompts.jsonl,data/train_prompts_extra.jsonl"
#: the benchmark prompt set at the repository root (this file is mlx_specdec/cli/train.py)
BENCHMARK_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts.jsonl"


def add_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="distil a ReDrafter draft head for a model",
                       description="Generate the model's own greedy answers to a prompt set "
                                   "(resumable), then train a ReDrafter RNN draft head on its "
                                   "hidden states (resumable from checkpoints), evaluate it on "
                                   "held-out prompts and save it with a training.json report.")
    _add_training_io_args(p, "models/drafter-smollm2-135m", "where the head is saved",
                          "distillation cache (default: $MLX_SPECDEC_HOME/drafter-data/<output name>)",
                          "drafter-checkpoints")
    p.add_argument("--max-new-tokens", type=int, default=192, help="answer length cap (default: %(default)s)")
    p.add_argument("--data-batch", default="auto",
                   help="prompts per generation batch, or auto: time a few batch sizes on a few short "
                        "answers and take the fastest (default: %(default)s)")
    p.add_argument("--budget-minutes", type=float, default=None, metavar="N",
                   help="one wall-clock budget for the whole command: time the data generation on a first "
                        "block of prompts, distil as many as fit in about half of it, train in the rest "
                        "(less a reserve for the held-out evaluation); the same command resumes the plan"),
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="K most frequent answer tokens the head predicts (default: %(default)s)")
    p.add_argument("--draft-length", type=int, default=5, help="tokens trained per window (default: %(default)s)")
    p.add_argument("--output-kind", default="llm_head",
                   help="head output: llm_head (predict the LLM's next hidden state, score with the LLM's own "
                        "output rows) or draft_vocab (a learned K-way projection) (default: %(default)s)")
    p.add_argument("--feature-loss", type=float, default=1.0,
                   help="weight of the hidden-state regression for llm_head (default: %(default)s)")
    p.add_argument("--soft-targets", type=float, default=0.0, metavar="A",
                   help="share of the token loss taken against the LLM's whole distribution over the draft "
                        "vocabulary instead of its greedy token alone, 0-1 (default: %(default)s = hard labels)")
    p.add_argument("--blocks", type=int, default=2, help="residual blocks (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, help="windows per step (default: %(default)s)")
    p.add_argument("--epochs", type=float, default=2.0, help="epochs (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this step (resume later)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this many minutes, evaluate and save the head as it is "
                        "(resume later with the same options)")
    p.add_argument("--skip-k-measure", action="store_true", help="skip the draft-vocabulary coverage/timing table")
    p.add_argument("--data-only", action="store_true",
                   help="generate (or resume) the distillation data and stop: a long run over sessions")
    p.add_argument("--no-generate", action="store_true",
                   help="train on the data shards already generated (a data run stopped part-way); "
                        "generate nothing")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="go on training a saved head on this data: its weights and draft vocabulary "
                        "(--draft-vocab is then unused), a fresh optimizer whose warm-up climbs to --lr "
                        "again (so pass a lower one, e.g. 3e-4); a larger --blocks grows it by blocks "
                        "that start as the identity")
    p.set_defaults(func=cmd_train_drafter)

    p = sub.add_parser("train-apar", help="fine-tune an APAR adapter (LoRA + [Fork]/[Child]) for a model",
                       description="Turn the model's own greedy answers to a prompt set (reused from the "
                                   "drafter's distillation data, generated if missing) into paragraph trees "
                                   "with APAR's extraction rules, then train LoRA layers and two new tokens "
                                   "so the model forks where the structure allows (resumable from "
                                   "checkpoints); save the adapter with a training.json report.")
    _add_training_io_args(p, "models/apar-smollm2-135m", "where the adapter is saved",
                          "the model's greedy answers, one directory per prompt file "
                          "(default: $MLX_SPECDEC_HOME/drafter-data/<model>)", "apar-checkpoints")
    p.add_argument("--layout", default="tree",
                   help="tree: one packed paragraph tree per answer under a tree mask; streams: one "
                        "sequence per stream, loss masked up to [Child] (the reference); skeleton: a skeleton "
                        "adapter (LoRA only on a thread after it forks, children and unforked answers are the "
                        "base model's text), trained on root streams only (default: %(default)s)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default: %(default)s)")
    p.add_argument("--scale", type=float, default=20.0, help="LoRA scale (default: %(default)s)")
    p.add_argument("--lora-layers", type=int, default=-1, help="LoRA on the last N blocks; -1 = all (default)")
    p.add_argument("--lr", type=float, default=2e-4, help="LoRA peak learning rate (default: %(default)s)")
    p.add_argument("--rows-lr", type=float, default=2e-3,
                   help="peak learning rate of the two new token rows (default: %(default)s)")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs (default: %(default)s)")
    p.add_argument("--tokens-per-batch", type=int, default=2048,
                   help="padded tokens per step (default: %(default)s)")
    p.add_argument("--negative-ratio", type=float, default=1.0,
                   help="unstructured (code/math/markup) answers per structured one (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this step (resume later)")
    p.add_argument("--compile", action="store_true", help="mx.compile the training step")
    p.add_argument("--kl-weight", type=float, default=0.0,
                   help="> 0: only [Fork]/EOS decisions keep hard labels; the text learns the frozen base "
                        "model's own distribution (this weight x KL), so answers stay the base's "
                        "(default: %(default)s = cross-entropy everywhere)")
    p.add_argument("--init-adapter", default=None,
                   help="start from this adapter's weights (same --rank/--scale/--lora-layers)")
    p.set_defaults(func=cmd_train_apar)

    p = sub.add_parser("train-fork-probe", help="train an APAR adapter's fork probe (the original model decides the first fork)",
                       description="Run the original model over its own greedy answers (the adapter's training data), "
                                   "label every fork point by APAR's extraction rules, and fit one linear [Fork] row "
                                   "on its final hidden state; save fork_probe.safetensors and fork_probe.json next to "
                                   "the adapter. With it, apar decodes with the original model until the first fork.")
    _add_model_args(p)
    p.add_argument("--adapter", default="models/apar-smollm2-135m",
                   help="the full APAR adapter the probe goes with (default: %(default)s)")
    p.add_argument("--prompts", default=TRAIN_PROMPTS_DEFAULT,
                   help="comma list of JSON-lines prompt files (id, prompt) (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="the model's greedy answers (default: $MLX_SPECDEC_HOME/drafter-data/<model>)")
    p.add_argument("--features", default=None,
                   help="cache of the hidden states (default: $MLX_SPECDEC_HOME/apar-probe/<data>.npz)")
    p.add_argument("--steps", type=int, default=400, help="full-batch Adam steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate (default: %(default)s)")
    p.set_defaults(func=cmd_train_fork_probe)


def _add_training_io_args(p, output: str, output_help: str, data_dir_help: str, checkpoints: str) -> None:
    """The model, the prompt files, and where the data, the checkpoints and the result go."""
    _add_model_args(p)
    p.add_argument("--prompts", default=TRAIN_PROMPTS_DEFAULT,
                   help="comma list of JSON-lines prompt files (id, prompt) (default: %(default)s)")
    p.add_argument("--output", "-o", default=output, help=output_help + " (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help=data_dir_help)
    p.add_argument("--checkpoint-dir", default=None,
                   help=f"training checkpoints (default: $MLX_SPECDEC_HOME/{checkpoints}/<output name>)")


def _training_prompt_files(value: str) -> List[Path]:
    prompts = [Path(p) for p in _comma_list(value)]
    for prompt_file in prompts:
        if not prompt_file.exists():
            raise UserError(f"no prompt file {prompt_file}")
        if prompt_file.resolve() == BENCHMARK_PROMPTS:
            raise UserError("benchmarks/prompts.jsonl is the benchmark set; never train on it")
    return prompts


def _log(msg) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_train_drafter(args) -> int:
    from ..redrafter_head.train import TrainConfig, run_pipeline
    from ..model.default import home

    started = time.perf_counter()  # the budget counts from here, model loading included
    if args.draft_vocab <= 0 or args.draft_length <= 0 or args.batch_size <= 0:
        raise UserError("--draft-vocab, --draft-length and --batch-size must be positive")
    if args.epochs <= 0 or args.lr <= 0:
        raise UserError("--epochs and --lr must be positive")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise UserError("--max-minutes must be positive")
    if not 0.0 <= args.soft_targets <= 1.0:
        raise UserError("--soft-targets is a share between 0 and 1")
    prompts = _training_prompt_files(args.prompts)
    if args.output_kind not in ("draft_vocab", "llm_head"):
        raise UserError("--output-kind is draft_vocab or llm_head")
    if args.data_only and args.no_generate:
        raise UserError("--data-only and --no-generate together would do nothing")
    data_batch = _data_batch(args.data_batch)
    if args.budget_minutes is not None:
        if args.budget_minutes <= 0:
            raise UserError("--budget-minutes must be positive")
        clash = [flag for flag, on in (("--max-minutes", args.max_minutes is not None),
                                       ("--max-steps", args.max_steps is not None), ("--data-only", args.data_only),
                                       ("--no-generate", args.no_generate)) if on]
        if clash:
            raise UserError(f"--budget-minutes plans the whole run; leave out {', '.join(clash)}")
    engine = load_engine(args)
    tag = Path(args.output).name
    data_dir = Path(args.data_dir) if args.data_dir else home() / "drafter-data" / tag
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else home() / "drafter-checkpoints" / tag
    cfg = TrainConfig(draft_vocab_size=args.draft_vocab, draft_length=args.draft_length,
                      num_blocks=args.blocks, batch_size=args.batch_size, epochs=args.epochs,
                      lr=args.lr, seed=args.seed, checkpoint_every=args.checkpoint_every,
                      max_steps=args.max_steps, max_minutes=args.max_minutes,
                      output=args.output_kind, feature_loss=args.feature_loss,
                      soft_targets=args.soft_targets, init_from=str(Path(args.init_from).resolve()) if args.init_from else None)
    if args.budget_minutes is not None:
        from ..redrafter_head.budget import run_budget
        run_budget(engine.lm, prompts, data_dir, Path(args.output), ckpt, cfg, args.budget_minutes,
                   args.max_new_tokens, data_batch, started, _log)
        return 0
    run_pipeline(engine.lm, prompts, data_dir, Path(args.output), ckpt, cfg,
                 max_new_tokens=args.max_new_tokens, data_batch=_batch_measure(engine.lm, prompts, data_batch),
                 measure_k=not args.skip_k_measure, log=_log, data_only=args.data_only,
                 generate=not args.no_generate, started=started)
    return 0


def _data_batch(value: str):
    """--data-batch: "auto" or a positive whole number."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) <= 0:
        raise UserError(f"--data-batch is a positive whole number or auto, not {value!r}")
    return int(value)


def _batch_measure(lm, prompts, data_batch):
    """The batch size, or for auto a callable that measures it once on the first prompts (called only
    when there is data to generate)."""
    if data_batch != "auto":
        return data_batch
    from ..redrafter_head.budget import batch_table_line, measure_batches, pick_batch
    from ..redrafter_head.data import load_train_prompts, row_messages

    chosen = []

    def measure() -> int:
        if not chosen:
            rows = load_train_prompts(prompts[0])[:64]
            begin = time.perf_counter()
            table = measure_batches(lm, [lm.encode_chat(row_messages(r)) for r in rows])
            chosen.append(pick_batch(table))
            _log(batch_table_line(table, chosen[0], time.perf_counter() - begin))
        return chosen[0]
    return measure


def cmd_train_apar(args) -> int:
    from ..apar.answers import default_data_dir
    from ..apar.train import AparTrainConfig, run_train_apar
    from ..model.default import home

    for flag in ("rank", "tokens_per_batch", "checkpoint_every"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive")
    if args.epochs <= 0 or args.lr <= 0 or args.rows_lr <= 0 or args.scale <= 0:
        raise UserError("--epochs, --lr, --rows-lr and --scale must be positive")
    if args.negative_ratio < 0 or args.kl_weight < 0:
        raise UserError("--negative-ratio and --kl-weight must be >= 0")
    if args.init_adapter and not (Path(args.init_adapter) / "adapter_config.json").exists():
        raise UserError(f"--init-adapter {args.init_adapter}: no APAR adapter there")
    if args.layout not in ("tree", "streams", "skeleton"):
        raise UserError("--layout is tree, streams or skeleton")
    if args.layout == "skeleton" and (args.kl_weight > 0 or args.compile):
        raise UserError("--layout skeleton trains without --kl-weight and --compile (the base text is not trained)")
    prompts = _training_prompt_files(args.prompts)
    engine = load_engine(args)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir(engine.lm)
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else home() / "apar-checkpoints" / Path(args.output).name
    cfg = AparTrainConfig(rank=args.rank, scale=args.scale, lora_layers=args.lora_layers, lr=args.lr,
                          rows_lr=args.rows_lr, epochs=args.epochs, tokens_per_batch=args.tokens_per_batch,
                          negative_ratio=args.negative_ratio, layout=args.layout, seed=args.seed,
                          checkpoint_every=args.checkpoint_every, max_steps=args.max_steps,
                          compile=args.compile, kl_weight=args.kl_weight,
                          init_adapter=str(Path(args.init_adapter).resolve()) if args.init_adapter else None)
    run_train_apar(engine.lm, prompts, data_dir, Path(args.output), ckpt, cfg, log=_log)
    return 0


def cmd_train_fork_probe(args) -> int:
    from ..apar.probe import run_train_probe
    from ..apar.answers import default_data_dir
    from ..model.default import home

    if args.steps <= 0 or args.lr <= 0:
        raise UserError("--steps and --lr must be positive")
    prompts = _training_prompt_files(args.prompts)
    engine = load_engine(args)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir(engine.lm)
    features = Path(args.features) if args.features else home() / "apar-probe" / f"{data_dir.name}.npz"
    run_train_probe(engine.lm, Path(args.adapter), prompts, data_dir, features, steps=args.steps, lr=args.lr,
                    log=_log)
    return 0
