"""The synthetic bench's report (bench_synthetic.py) in Markdown or JSON, and `bench --synthetic`'s
entry point (cli/bench.py hands it the parsed arguments)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

from .errors import UserError

FORMATS = ("md", "json")


def cmd_synthetic(args) -> int:
    """`mlx-specdec bench --synthetic NAME [--layers N] [--rounds R] [--contexts LIST]`."""
    from . import gpu_prediction
    from .bench_synthetic import run_synthetic
    from .synthetic_shapes import preset

    if args.format not in FORMATS:
        raise UserError(f"a synthetic bench reports md or json, not {args.format!r}")
    shape = preset(args.synthetic)  # an unknown name: one line, before anything is built
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--contexts takes a comma list of token counts, not {args.contexts!r}") from None
    result = run_synthetic(args.synthetic, layers=args.layers, rounds=args.rounds, contexts=contexts,
                           dtype_choice=args.dtype, dequantize_choice=args.dequantize)
    result["prediction"] = {"inputs": gpu_prediction.inputs(), "model": gpu_prediction.__doc__.split("\n\n")[1],
                            "rows": gpu_prediction.predict(shape)}
    text = render(result, args.format)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def render(result: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result, indent=1) + "\n"
    return markdown(result)


def _table(header: List[str], rows: List[list]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return lines + [""]


def markdown(result: dict) -> str:
    env, model, params = result["environment"], result["model"], result["params"]
    m = env["machine"]
    out = [f"# Synthetic bench: {model['name']}", "", "## Environment", "",
           f"- date: {env['date']}; git commit: {env['git_commit']}",
           f"- machine: {m['device']} {m['device_name']}".rstrip() + f"; {m['cpu']}, {m['cores']} cores, {m['system']}, "
           f"BLAS {m['blas'] or '-'}; RAM {env['ram_gb']} GB",
           f"- MLX {env['mlx']}, mlx-lm {env['mlx_lm']}, Python {env['python']}", "", "## Model", "",
           f"- mlx-lm llama, random weights: {model['layers']} layers, hidden {model['hidden']}, FFN {model['ffn']}, "
           f"{model['heads']} heads / {model['kv_heads']} KV heads, vocabulary {model['vocab']}, "
           f"{model['params'] / 1e9:.2f} B parameters, window {model['max_positions']}",
           f"- checkpoint {model['checkpoint']}; here: {model['weights_on_this_machine']}; weights "
           f"{model['weight_layout']}; {model['weights_mb_built']} MB built",
           f"- **{model['scaling']}**",
           f"- medians of {params['rounds']} round(s), each in its own rotated order; every case warmed up once, at "
           "the first context that has it" + (" (scaled figures multiply a layer's noise by the depth: one round is "
                                              "rough)" if params["rounds"] == 1 and model["layers_built"] < model["layers"]
                                              else ""), ""]
    contexts = params["contexts"]
    by = {(r["context"], r["tokens"]): r for r in result["verify_cost"]}
    out += ["## (a) Verify cost: a T-token forward (one row, every logit) against one token", "",
            "ms, and in brackets the multiple of the one-token forward at the same context.", ""]
    out += _table(["T"] + [f"{c} ctx" for c in contexts],
                  [[t] + [f"{by[c, t]['ms']} ({by[c, t]['ratio']}x)" for c in contexts]
                   for t in range(1, params["max_tokens"] + 1)])
    ends = result["ends_ms"]
    out += [f"As measured over the {model['layers_built']} layers built: the one-token forward "
            + ", ".join(f"{by[c, 1]['measured_ms']} ms at {c}" for c in contexts)
            + f"; the ends (embedding, norm, vocabulary projection) {ends['1']} ms for one token, "
            f"{ends[str(params['max_tokens'])]} ms for {params['max_tokens']}.", ""]
    out += ["## (b) Fixed cost per step beyond the verify", "",
            f"ReDrafter: the head drafting its {params['chain_depths']}-deep greedy chain (float32, as loaded; not "
            "scaled: the head does not depend on the depth). APAR: a forked thread's step through the forkable "
            "pool (its positions and path mask) less a plain one-token step; host ms = the pool's step work alone.", ""]
    out += _table(["what", "context", "ms", "host ms", "x one-token forward"],
                  [[r["what"], r["context"], r["ms"], r["host_ms"], r["x_one_token_forward"]] for r in result["overheads"]])
    out += ["## (c) TriForce's middle level: a one-token forward over the retrieval cache", ""]
    out += (_table(["context", "budget", "ms", "full cache ms", "x full"],
                   [[r["context"], r["budget"], r["ms"], r["full_ms"], r["x_full"]] for r in result["retrieval"]])
            if result["retrieval"] else ["(no context of 8K or more asked)", ""])
    out += ["## (d) APAR: k threads decoding one token each in one forward over a shared prefix", ""]
    out += _table(["context", "k", "ms", "host ms", "x one thread", "x plain step"],
                  [[r["context"], r["threads"], r["ms"], r["host_ms"], r["x_one_thread"], r["x_plain_step"]]
                   for r in result["threads"]])
    memory = result["memory"]
    out += ["## (e) Memory (MLX's peak while measuring each context; layers as built, not scaled)", ""]
    out += _table(["context", "peak MB", "contiguous KV MB"],
                  [[r["context"], r["peak_mb"], r["kv_mb_built"]] for r in memory["per_context"]])
    out += [f"Peak while building the model: {memory['peak_mb_build']} MB; peak of the run: {memory['peak_mb_run']} MB.",
            ""]
    prediction = result.get("prediction")
    if prediction:
        from .gpu_prediction import markdown as prediction_table

        inputs = prediction["inputs"]
        gpus = ", ".join(f"{k} {v['bandwidth_gb_s']:.0f} GB/s, {v['tflops']} TFLOPS" for k, v in inputs["gpus"].items())
        out += ["## PREDICTION for Apple GPUs (a bandwidth model, not a measurement)", "",
                f"Inputs: {gpus}; efficiency {inputs['bandwidth_efficiency']} of bandwidth, "
                f"{inputs['compute_efficiency']} of compute; acceptance measured on the default model "
                f"(ReDrafter {list(inputs['redrafter_acceptance'])} by depth, APAR {inputs['apar_tokens_per_step']} "
                f"tokens a step, TriForce middle level {inputs['triforce_acceptance']}, g {inputs['triforce_gamma']}). "
                "4-bit cells: in brackets with few-row 4-bit matmuls costing as measured upstream (docs/benchmarking.md). "
                "The model: mlx_specdec/gpu_prediction.py.", "", prediction_table(prediction["rows"])]
    return "\n".join(out)
