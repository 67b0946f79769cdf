"""Issue 18's data and heads on a lent GPU, inside one call's deadline: the default model's own
greedy answers to every training prompt file (several `train-drafter --data-only` processes at once:
a 135M model's batched decode on an H100/H200 is bound by kernel launches and the host, so
processes side by side fill the GPU), then several heads trained side by side on all of it (the
configurations below, chosen by held-out acceptance afterwards), then every head and the shipped
one measured on the same held-out answers. On the CPU here the same data takes ~3 h per million
tokens; there it is minutes.

    bash benchmarks/device/cuda_distill.sh           # there, after the parts are in $X
    python benchmarks/device/distill_on_gpu.py --quick --budget 900 --out /tmp/dq    # a check here

Every phase stops at its share of `--budget` (a process past it is stopped; generation keeps its
finished shards, training saves the head as it stands: `--max-minutes`), and writes what it has
under --out as it ends, so a call stopped at its limit still returns what was made. What comes back
(at most 8 files): log.txt, heldout.md, heldout.json and one tar per head (model, config, training.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "drafter-smollm2-135m"
# one generation process per group; the largest file is cut in four so the groups take about as long
# (the fifth lease: ~2,500 tokens/s per process with six side by side, the large file's thirds 220 s)
LARGE_PARTS = 4
GROUPS = [["train_prompts_natural"], ["train_prompts_natural2"],
          *[[f"train_prompts_large#{k}"] for k in range(LARGE_PARTS)],
          ["train_prompts_followups2", "train_prompts_followups", "train_prompts", "train_prompts_extra"]]
# (name, residual blocks, peak learning rate, tokens trained per window); all go on from the shipped
# head, more blocks starting as the identity (drafter/train.py grown_weights). The fifth lease trained
# four from v6 (5 positions: 2 blocks at lr 7e-4 and 1.5e-3, 4 blocks; 2 blocks on 3 positions, which
# won and ships as v9); these are what it left open: more blocks and more positions on v9's recipe.
HEADS = [("b2_len3", 2, 5e-4, 3), ("b4_len3", 4, 7e-4, 3), ("b2_len4", 2, 7e-4, 4), ("b3_len3", 3, 7e-4, 3)]
NATURAL = ("train_prompts_natural", "train_prompts_natural2")  # the held-out set heads are chosen by
# MLX's CUDA allocator lets one process cache freed buffers up to 95 % of the GPU's memory: six
# processes decoding with a new key count every step ran the H200 (143 GB) out of memory within
# seconds. Each process here keeps at most CACHE_GB cached.
CACHE_GB = 6
PRELUDE = (f"import sys, runpy, mlx_specdec, mlx.core as mx; mx.set_cache_limit({CACHE_GB} << 30); "
           "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")
SHARES = {"generate": 0.38, "train": 0.82, "evaluate": 0.94}  # each phase ends at this share of the budget


class Run:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.out, self.work = Path(args.out), Path(args.work)
        self.out.mkdir(parents=True, exist_ok=True)
        for sub in ("prompts", "data", "heads", "checkpoints", "logs"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def deadline(self, phase: str) -> float:
        return SHARES[phase] * self.args.budget

    def log(self, message: str) -> None:
        line = f"[{self.elapsed():6.0f} s] {message}"
        print(line, flush=True)
        with open(self.out / "log.txt", "a") as f:
            f.write(line + "\n")

    def spawn(self, name: str, argv: list, **env) -> subprocess.Popen:
        log = open(self.work / "logs" / f"{name}.log", "w")
        return subprocess.Popen([sys.executable, "-c", PRELUDE, *argv], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **env))

    def wait_all(self, procs: dict, phase: str, grace: float = 0) -> dict:
        """Wait for every process until the phase's deadline (+ grace); stop the ones still running then."""
        while any(p.poll() is None for p in procs.values()) and self.elapsed() < self.deadline(phase) + grace:
            time.sleep(2)
        for name, p in procs.items():
            if p.poll() is None:
                self.log(f"{name}: past the {phase} deadline, stopped")
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        codes = {name: p.returncode for name, p in procs.items()}
        for name, code in codes.items():
            tail = (self.work / "logs" / f"{name}.log").read_text(errors="replace").replace("\r", "\n")
            lines = [ln for ln in tail.splitlines() if ln.strip()][-3:]
            self.log(f"{name}: rc {code}; " + " | ".join(lines))
        return codes

    def shards(self, prompt_file: Path, split: str) -> list:
        """The finished shards of one prompt file's split (a stopped process leaves .tmp ones)."""
        return sorted((self.work / "data" / prompt_file.stem / split).glob("shard-[0-9]*[0-9].npz"))

    # -- prompts and data ---------------------------------------------------------------------
    def prompt_file(self, entry: str) -> Path:
        """data/<name>.jsonl, or part k of it (`name#k`) written under the work folder; --quick keeps
        the first rows of each file only."""
        name, _, part = entry.partition("#")
        rows = [r for r in (ROOT / "data" / f"{name}.jsonl").read_text().splitlines() if r.strip()]
        if not part and not self.args.quick:
            return ROOT / "data" / f"{name}.jsonl"
        if part:
            rows = rows[int(part)::LARGE_PARTS]  # every LARGE_PARTS-th row: each part a fair sample
        if self.args.quick:  # a few answers of each split
            from mlx_specdec.redrafter_head.data import is_validation
            held = [is_validation(json.loads(r).get("id", n + 1)) for n, r in enumerate(rows)]
            rows = ([r for r, h in zip(rows, held) if not h][: self.args.quick_rows]
                    + [r for r, h in zip(rows, held) if h][:2])
        path = self.work / "prompts" / f"{name}{'_' + part if part else ''}.jsonl"
        path.write_text("\n".join(rows) + "\n")
        return path

    def generate(self) -> list:
        groups = [[self.prompt_file(e) for e in group] for group in GROUPS]
        a = self.args
        procs = {f"generate{i}": self.spawn(f"generate{i}", [
            "mlx_specdec.cli", "train-drafter", "--model", "default", "--dtype", a.dtype,
            "--prompts", ",".join(map(str, files)), "--data-only", "--data-batch", str(a.data_batch),
            "--max-new-tokens", str(a.max_new_tokens), "--data-dir", str(self.work / "data"),
            "--output", str(self.work / "heads" / f"generate{i}")]) for i, files in enumerate(groups)}
        self.wait_all(procs, "generate")
        files = [f for group in groups for f in group]
        self.log("data: " + json.dumps(self.data_summary(files)))
        return files

    def data_summary(self, files: list) -> dict:
        summary = {}
        for f in files:
            for split in ("train", "valid"):
                shards = self.shards(f, split)
                offsets = [np.load(s)["offsets"] for s in shards]
                summary[f"{f.stem}/{split}"] = {"shards": len(shards), "answers": sum(len(o) - 1 for o in offsets),
                                                "tokens": int(sum(o[-1] for o in offsets))}
        summary["total_tokens"] = sum(v["tokens"] for v in summary.values())
        return summary

    # -- heads --------------------------------------------------------------------------------
    def train(self, files: list) -> list:
        a = self.args
        present = [f for f in files if self.shards(f, "train")]
        if not present:
            self.log("no finished train shards: nothing to train")
            return []
        argv = {}
        for name, blocks, lr, length in HEADS:
            argv[name] = [
                "mlx_specdec.cli", "train-drafter", "--model", "default", "--dtype", a.dtype,
                "--prompts", ",".join(map(str, present)), "--data-dir", str(self.work / "data"), "--no-generate",
                "--init-from", str(SHIPPED), "--blocks", str(blocks), "--lr", str(lr),
                "--draft-length", str(length), "--batch-size", str(a.batch_size), "--epochs", str(a.epochs),
                "--checkpoint-every", "1000",
                "--output", str(self.work / "heads" / name), "--checkpoint-dir", str(self.work / "checkpoints" / name)]
        self.log(f"training {len(argv)} heads on {len(present)} files, {a.epochs} epochs")
        codes = self.train_until_deadline(argv)
        failed = [name for name, code in codes.items() if code != 0]
        if failed and self.deadline("train") - self.elapsed() > a.train_startup + 60:
            # an MLX backend that cannot compile the training step (a first run on a new GPU backend)
            self.log(f"{', '.join(failed)} failed: again without mx.compile")
            self.train_until_deadline({name: argv[name] for name in failed}, MLX_DISABLE_COMPILE="1")
        done = [name for name, *_ in HEADS if (self.work / "heads" / name / "model.safetensors").exists()]
        for name in done:
            report = json.loads((self.work / "heads" / name / "training.json").read_text())
            self.log(f"{name}: " + json.dumps({"steps": report["train"]["steps"], "wall_s": report["train"]["wall_s_this_run"],
                                              "loss": report["train"]["final_loss_mean_last_50"],
                                              "valid": report.get("valid")}))
            with tarfile.open(self.out / f"head_{name}.tar", "w") as tar:
                for f in ("model.safetensors", "config.json", "training.json"):
                    tar.add(self.work / "heads" / name / f, arcname=f"{name}/{f}")
        return done

    def train_until_deadline(self, argv: dict, **env) -> dict:
        """Each head's training, side by side, told to stop (and save) before the train deadline."""
        minutes = max(0.5, (self.deadline("train") - self.elapsed() - self.args.train_startup) / 60)
        procs = {name: self.spawn(name, [*args, "--max-minutes", f"{minutes:.2f}"], **env) for name, args in argv.items()}
        # they stop themselves by the deadline; the grace covers a slow start, the held-out measure and the save
        return self.wait_all(procs, "train", grace=self.deadline("evaluate") - self.deadline("train") - 45)

    def evaluate(self, files: list, heads: list) -> None:
        """Every head and the shipped one on the same held-out answers: the natural prompts' (how
        heads are chosen here) and all files' together."""
        with_valid = [f for f in files if self.shards(f, "valid")]
        sets = {"natural": [f for f in with_valid if f.stem.startswith(NATURAL)], "all": with_valid}
        dirs = ",".join([str(SHIPPED)] + [str(self.work / "heads" / h) for h in heads])
        procs = {f"heldout_{k}": self.spawn(f"heldout_{k}", [
            "benchmarks.drafter_heldout", "--dtype", self.args.dtype, "--heads", dirs,
            "--data", ",".join(str(self.work / "data" / f.stem) for f in v), "--json", str(self.work / f"heldout_{k}.json")])
            for k, v in sets.items() if v}
        self.wait_all(procs, "evaluate")
        tables, figures = [], {}
        for k in sets:
            log = self.work / "logs" / f"heldout_{k}.log"
            if log.exists():
                tables.append(f"## held-out answers: {k}\n\n" + log.read_text(errors="replace"))
            if (self.work / f"heldout_{k}.json").exists():
                figures[k] = json.loads((self.work / f"heldout_{k}.json").read_text())
        (self.out / "heldout.md").write_text("\n".join(tables))
        (self.out / "heldout.json").write_text(json.dumps(figures, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, required=True, help="seconds this script may take in all")
    ap.add_argument("--out", required=True, help="what comes back (log, held-out tables, head tars)")
    ap.add_argument("--work", default="/tmp/distill", help="data, heads and logs of the processes")
    ap.add_argument("--dtype", default="float32", help="the LLM's dtype for data, training and measure")
    ap.add_argument("--data-batch", type=int, default=128, help="prompts per generation batch")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=512, help="windows per training step")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--train-startup", type=float, default=60,
                    help="seconds a training process takes before its first step (data, model, checks)")
    ap.add_argument("--quick", action="store_true", help="a few rows of each file, short answers (a check)")
    ap.add_argument("--quick-rows", type=int, default=12)
    args = ap.parse_args()
    if args.quick:
        args.max_new_tokens, args.data_batch, args.epochs = 8, 8, 0.5
    run = Run(args)
    run.log(f"budget {args.budget:.0f} s: " + ", ".join(f"{k} until {run.deadline(k):.0f} s" for k in SHARES))
    files = run.generate()
    heads = run.train(files)
    run.evaluate(files, heads)
    run.log("done")


if __name__ == "__main__":
    main()
