"""What a `train-drafter` run cost here, and what the same job would cost for a 7B 4-bit model
on an M-series Mac (docs/training.md): `estimate_mac`, `cost_report`, `cost_lines`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

AUTO_BATCHES = (8, 16, 32, 64)  # the batch sizes `--data-batch auto` measures, and the estimate weighs


def pick_batch(table: Dict[int, float]) -> int:
    """The batch with the most tokens per second (the smaller one on a tie: less padding, less memory)."""
    if not table:
        raise ValueError("no batch sizes were measured")
    return min(table, key=lambda b: (-table[b], b))

@dataclass(frozen=True)
class Mac:
    """An M-series Mac's memory bandwidth and GPU fp32 peak (sources in docs/training.md)."""
    name: str
    bandwidth: float  # bytes / s
    flops: float  # FLOP / s


MACS = (Mac("M2 Pro", 200e9, 6.8e12), Mac("M3 Max", 400e9, 14.2e12))


@dataclass(frozen=True)
class Target:
    """The model the estimate is for: a 7B Llama-shaped model in 4-bit (Mistral-7B's shapes)."""
    name: str = "7B 4-bit"
    weight_bytes: float = 3.8e9  # 4-bit weights with group scales
    params: float = 7.2e9  # 2 FLOP per parameter per token
    kv_bytes_per_token: float = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x fp16
    hidden_size: int = 4096
    embed_size: int = 4096


TRAIN_EFFICIENCY = 0.5  # share of the GPU's peak the head's training matmuls reach (an assumption)


def decode_seconds(batch: int, context: float, target: Target, mac: Mac) -> float:
    """One decode forward of `batch` rows at `context` keys: reading the weights and the KV cache once
    at the memory bandwidth, or the matmuls at the GPU's peak, whichever is longer."""
    read = (target.weight_bytes + batch * context * target.kv_bytes_per_token) / mac.bandwidth
    compute = batch * 2 * target.params / mac.flops
    return max(read, compute)


def head_train_flops(hidden: int, embed: int, draft_vocab: int, blocks: int, draft_length: int,
                     batch: int, output: str = "llm_head") -> float:
    """FLOP of one training step of the head: per window and draft position the multiply-adds of
    U, W (E x E each), the blocks ((D+E)^2 each) and the output (llm_head: (D+E) x D then D x K;
    draft_vocab: (D+E) x K), times 2 FLOP per multiply-add, times 3 for forward + backward."""
    width = hidden + embed
    out = width * hidden + hidden * draft_vocab if output == "llm_head" else width * draft_vocab
    macs = 2 * embed * embed + blocks * width * width + out
    return 3 * 2 * macs * draft_length * batch


def estimate_mac(data_tokens: int, context: float, train_steps: int, draft_vocab: int, blocks: int,
                 draft_length: int, batch_size: int, output: str, target: Target = Target(),
                 mac: Mac = MACS[0], batches: Sequence[int] = AUTO_BATCHES) -> Dict[str, float]:
    """Minutes the same job (as many answer tokens, as many training steps) would take for `target`
    on `mac`: data at the best of `batches` (batch / decode_seconds), training at TRAIN_EFFICIENCY
    of the peak. Prefill, evaluation and saving are left out (small beside decoding)."""
    rates = {b: b / decode_seconds(b, context, target, mac) for b in batches}
    batch = pick_batch(rates)
    step_flops = head_train_flops(target.hidden_size, target.embed_size, draft_vocab, blocks,
                                  draft_length, batch_size, output)
    step_s = step_flops / (TRAIN_EFFICIENCY * mac.flops)
    data_min = data_tokens / rates[batch] / 60
    train_min = train_steps * step_s / 60
    return {"mac": mac.name, "bandwidth_gb_s": mac.bandwidth / 1e9, "gpu_tflop_s": mac.flops / 1e12,
            "data_batch": batch, "data_tokens_per_s": round(rates[batch], 1),
            "train_steps_per_s": round(1 / step_s, 2), "data_minutes": round(data_min, 1),
            "train_minutes": round(train_min, 1), "total_minutes": round(data_min + train_min, 1),
            "hidden_state_gb": round(data_tokens * target.hidden_size * 2 / 1e9, 2)}


def cost_lines(cost: Dict[str, object]) -> List[str]:
    here = cost["here"]
    lines = [f"cost here: data {here['data_tokens_per_s']} tokens/s at batch {here['data_batch']} "
             f"({here['data_tokens']} tokens, {here['data_minutes']} min), training "
             f"{here['train_steps_per_s']} steps/s ({here['train_steps']} steps, {here['train_minutes']} min, "
             f"{here['train_gflop_s']} GFLOP/s), {here['total_minutes']} min in all"]
    for e in cost["estimate_7b_4bit"]:
        lines.append(f"estimate 7B 4-bit on {e['mac']} ({e['bandwidth_gb_s']:g} GB/s, {e['gpu_tflop_s']:g} TFLOP/s): "
                     f"data {e['data_tokens_per_s']} tokens/s at batch {e['data_batch']} -> {e['data_minutes']} min, "
                     f"training {e['train_steps_per_s']} steps/s -> {e['train_minutes']} min, "
                     f"{e['total_minutes']} min in all ({e['hidden_state_gb']} GB of hidden states)")
    return lines


CONTEXT_PROMPT = 64  # prompt tokens (chat template included) assumed ahead of each answer in the KV term


def cost_report(data_stats: Dict, result, cfg, data_tokens: int, mean_answer: float, hidden: int,
                embed: int, draft_vocab: int, total_s: float) -> Dict[str, object]:
    """Measured here (data tokens/s at the batch used, training steps/s, minutes) and the same job's
    estimate for a 7B 4-bit model on each of MACS. `data_stats`: tokens, seconds, batch of the data
    generated (none on a run that only trained); `result`: the TrainResult."""
    seconds = data_stats.get("seconds") or 0.0
    step_flops = head_train_flops(hidden, embed, draft_vocab, cfg.num_blocks, cfg.draft_length,
                                  cfg.batch_size, cfg.output)
    here = {"data_batch": data_stats.get("batch"), "data_tokens": int(data_stats.get("tokens", 0)),
            "data_minutes": round(seconds / 60, 1),
            "data_tokens_per_s": round(data_stats["tokens"] / seconds, 1) if seconds else None,
            "train_steps": result.steps, "train_minutes": round(result.wall_s / 60, 1),
            "train_steps_per_s": round(result.steps_per_s, 2),
            "train_gflop_s": round(step_flops * result.steps_per_s / 1e9, 1),
            "total_minutes": round(total_s / 60, 1)}
    context = CONTEXT_PROMPT + mean_answer / 2
    target = Target()
    estimates = [estimate_mac(data_tokens, context, result.steps, draft_vocab, cfg.num_blocks,
                              cfg.draft_length, cfg.batch_size, cfg.output, target, mac) for mac in MACS]
    return {"here": here, "estimate_7b_4bit": estimates,
            "assumptions": {"weight_bytes": target.weight_bytes, "params": target.params,
                            "kv_bytes_per_token": target.kv_bytes_per_token, "mean_context": round(context, 1),
                            "hidden_size": target.hidden_size, "train_efficiency": TRAIN_EFFICIENCY,
                            "data_tokens": data_tokens, "train_steps": result.steps}}
