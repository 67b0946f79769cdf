"""A small simulator of pp-ar, pp-spec and pipeinfer on N pipeline stages, from measured costs.

    python benchmarks/pipeline_sim.py --costs benchmarks/results/issue17_stage_cost.json \
        [--alpha 0.5] [--nodes 2,4,8] [--link-ms 0,1,5] [--contention 1.0]

It replays the head's policy of `mlx_specdec/distributed/head.py` in simulated time, 0.25 ms a
tick: stage 0 is the head (its layers, the drafter, verification: one thread), stages 1..N-1 are
FIFO servers; a run's cost on a stage is (its layers) x (one layer's measured cost for T tokens),
plus the vocabulary projection on the last; messages take `--link-ms`; a cancellation reaches
stage k after k links and stops a queued run, or a running one at once (the implementation stops at
its next 5-layer checkpoint). Drafts: each chain of the ReDrafter head is right for a geometric
number of leading tokens (each next one right with probability --alpha, measured on the bench).
`--contention F`: while more than one stage computes, each runs F x slower (ranks that share one
machine's memory bandwidth: measured 1.4-1.7 here; separate Macs: 1.0).
Prints decode tok/s per method and node count, and pipeinfer's ratio over pp-spec.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Dict, List


def interp(table: Dict[int, float], t: int) -> float:
    keys = sorted(table)
    if t in table:
        return table[t]
    lo = max([k for k in keys if k <= t], default=keys[0])
    hi = min([k for k in keys if k >= t], default=keys[-1])
    if hi == lo:
        return table[lo] * (t / lo if t > hi else 1.0)
    return table[lo] + (table[hi] - table[lo]) * (t - lo) / (hi - lo)


class Sim:
    def __init__(self, method, nodes, costs, alpha, link, contention, micro=2, max_runs=1, draft_len=4, seed=0,
                 base_drafts=0):
        self.method, self.n, self.alpha, self.link, self.contention = method, nodes, alpha, link, contention
        self.micro, self.max_runs, self.draft_len = micro, max_runs, draft_len
        self.base_drafts = base_drafts  # pipeinfer: drafts in the known token's run (0: the paper's)
        layers = costs["layers"]
        base, extra = divmod(layers, nodes)
        self.layers = [base + (1 if k >= nodes - extra else 0) for k in range(nodes)]
        self.layer_ms = {int(k): v for k, v in costs["layer_ms"].items()}
        self.vocab_ms = {int(k): v for k, v in costs["vocab_projection_ms"].items()}
        self.draft_ms = costs.get("draft_chain_ms", 5.0)
        self.rng = random.Random(seed)

    def work(self, stage: int, tokens: int) -> float:
        w = self.layers[stage] * interp(self.layer_ms, tokens)
        return w + (interp(self.vocab_ms, tokens) if stage == self.n - 1 else 0.0)

    def chain(self, length: int) -> List[bool]:
        right, out = True, []
        for _ in range(length):
            right = right and self.rng.random() < self.alpha
            out.append(right)
        return out

    def run(self, target_tokens: int = 400, dt: float = 0.25) -> float:
        now, committed = 0.0, 0
        spec: List[bool] = []  # flags of speculative tokens in flight after the committed text
        sent_spec = 0  # how many of them are sent
        runs: List[dict] = []  # in flight, in order
        inbox: List[tuple] = []  # (deliver_at, run)
        queues = [[] for _ in range(self.n)]  # per stage: (deliver_at, run)
        current: List[dict] = [None] * self.n  # per stage: {"run", "left"} (stage 0: the head's job)
        head_jobs: List[tuple] = []  # the head's own queue of jobs: (kind, payload, work)
        chain_ready, chain = False, []
        next_id = 0
        started = None

        def launch(tokens: int, speculative: bool):
            nonlocal next_id
            run = dict(id=next_id, count=tokens, speculative=speculative, cancelled_at=None)
            next_id += 1
            head_jobs.append(("stage0", run, self.work(0, tokens)))

        def start_base():
            if self.method == "pp-spec" or (self.method == "pipeinfer" and self.base_drafts):
                head_jobs.append(("draft", None, self.draft_ms))
            else:
                launch(1, False)
                if self.method == "pipeinfer":
                    head_jobs.append(("draft", None, self.draft_ms))

        start_base()
        while committed < target_tokens:
            now += dt
            busy = sum(1 for c in current if c is not None)
            rate = dt / (self.contention if busy > 1 else 1.0)
            # stages 1..n-1: progress, finish, pick the next queued run
            for k in range(1, self.n):
                job = current[k]
                if job is not None:
                    cancel = job["run"]["cancelled_at"]
                    if cancel is not None and cancel + k * self.link <= now:
                        job["left"] = 0.0
                        job["skipped"] = True
                    job["left"] -= rate
                    if job["left"] <= 0:
                        target = inbox if k == self.n - 1 else queues[k + 1]
                        target.append((now + self.link, job["run"]))
                        current[k] = None
                if current[k] is None:
                    ready = [q for q in queues[k] if q[0] <= now]
                    if ready:
                        queues[k].remove(ready[0])
                        run = ready[0][1]
                        cancel = run["cancelled_at"]
                        skipped = cancel is not None and cancel + k * self.link <= now
                        current[k] = dict(run=run, left=0.0 if skipped else self.work(k, run["count"]))
            # the head
            job = current[0]
            if job is not None:
                job["left"] -= rate
                if job["left"] > 0:
                    continue
                current[0] = None
                kind, run = job["kind"], job["run"]
                if kind == "stage0":
                    runs.append(run)
                    (queues[1] if self.n > 1 else inbox).append((now + self.link, run))
                elif kind == "draft":
                    chain_ready, chain = True, self.chain(self.draft_len)
                    if self.method == "pp-spec":
                        spec, sent_spec = list(chain), len(chain)
                        launch(1 + len(chain), True)
                    elif self.base_drafts and not any(r["cancelled_at"] is None for r in runs) and not spec:
                        take = min(self.base_drafts, len(chain))
                        spec, sent_spec = list(chain[:take]), take
                        launch(1 + take, True)
            if current[0] is None and head_jobs:
                kind, run, work = head_jobs.pop(0)
                current[0] = dict(kind=kind, run=run, left=work)
                continue
            arrived = [item for item in inbox if item[0] <= now]
            if arrived:
                inbox.remove(arrived[0])
                run = arrived[0][1]
                runs.remove(run)
                if run["cancelled_at"] is not None:
                    if not any(r["cancelled_at"] is None for r in runs) and not head_jobs:
                        start_base()
                    continue
                if started is None:
                    started = now
                # verify: the run's rows decide the speculative tokens after its first
                rows = run["count"]
                gained, rejected = 0, False
                for _ in range(rows):
                    if spec:
                        right = spec.pop(0)
                        sent_spec -= 1
                        gained += 1
                        if not right:
                            rejected = True
                            break
                    else:
                        gained += 1  # the bonus token
                        break
                committed += gained
                chain_ready = False
                if rejected or not any(r["cancelled_at"] is None for r in runs):
                    for r in runs:
                        r["cancelled_at"] = now
                    spec, sent_spec = [], 0
                    start_base()
                elif self.method == "pipeinfer":
                    head_jobs.append(("draft", None, self.draft_ms))  # from the newest committed token
                continue
            if self.method == "pipeinfer" and chain_ready and not head_jobs:
                in_flight = sum(1 for r in runs if r["speculative"] and r["cancelled_at"] is None)
                room = self.draft_len - len(spec)
                if in_flight < self.max_runs and room > 0 and all(spec):
                    take = min(self.micro, room)
                    spec += chain[len(spec):len(spec) + take] if len(chain) >= len(spec) + take else self.chain(take)
                    sent_spec += take
                    launch(take, True)
        return committed / ((now - (started or 0.0)) / 1000.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", required=True, help="JSON from benchmarks/pipeline_stage_cost.py")
    parser.add_argument("--alpha", type=float, default=0.5, help="P(next draft right | the ones before were)")
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--link-ms", default="0")
    parser.add_argument("--contention", type=float, default=1.0)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--max-runs", default="auto", help="speculative runs in flight; auto = nodes - 1")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--base-drafts", type=int, default=0, help="pipeinfer: drafts in the known token's run")
    parser.add_argument("--draft-length", type=int, default=4, help="tokens per draft chain")
    args = parser.parse_args()
    costs = json.load(open(args.costs))
    print(f"alpha {args.alpha}, contention {args.contention}, micro-batch {args.micro_batch}, "
          f"max runs {args.max_runs}; decode tok/s (mean of 3 seeds)\n")
    print("| nodes | link ms | pp-ar | pp-spec | pipeinfer | pipeinfer / pp-spec |")
    print("|---:|---:|---:|---:|---:|---:|")
    for link in [float(x) for x in args.link_ms.split(",")]:
        for nodes in [int(x) for x in args.nodes.split(",")]:
            rates = {}
            for method in ("pp-ar", "pp-spec", "pipeinfer"):
                runs = [Sim(method, nodes, costs, args.alpha, link, args.contention, args.micro_batch,
                            (nodes - 1 if args.max_runs == "auto" else int(args.max_runs))
                            if method == "pipeinfer" else 1, args.draft_length, seed,
                            args.base_drafts).run(args.tokens)
                        for seed in range(3)]
                rates[method] = sum(runs) / len(runs)
            print(f"| {nodes} | {link:g} | {rates['pp-ar']:.1f} | {rates['pp-spec']:.1f} | {rates['pipeinfer']:.1f} "
                  f"| {rates['pipeinfer'] / rates['pp-spec']:.2f}x |")


if __name__ == "__main__":
    main()
