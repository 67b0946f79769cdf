"""How honest the head's runners-up are: teacher forced on the default model's greedy answers (128
tokens) to the unseen chats and the first 16 project prompts, the head's 2nd-4th choices for the
first draft, bucketed by the probability it gives them, against how often each is the target's
token; and the top choice's confidence against its hit rate (`redrafter --runners-up`, the card).

    python benchmarks/runners_up_calibration.py
"""
import json
import mlx_specdec  # noqa
import mlx.core as mx
import numpy as np
from mlx_specdec.engine import Engine
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.redrafter_head.beam import compiled_chain
from mlx_specdec.model.forward import forward
e = Engine.load("default")
lm, head = e.lm, e.drafter
embed = lm.model.model.embed_tokens
first = compiled_chain(head, embed, 3)[0]
rows = []
prompts = [json.loads(l)["turns"][0] for l in open("benchmarks/chat_unseen.jsonl")] + \
          [json.loads(l)["turns"][0] for l in open("benchmarks/prompts.jsonl")][:16]
for text in prompts:
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ans = [t for ev in e.generate(text, "ar", GenerationParams(max_tokens=128)) if ev.kind == "token" for t in ev.tokens]
    seq = mx.array([ids + ans])
    out = forward(lm.model, seq, None, logits_for="none")
    P = len(ids)
    h = out.hidden[0, P - 1: P - 1 + len(ans) - 1]  # state that produced ans[i]
    tok = mx.array(ans[:-1])
    state, draft, score, conf, run, rconf = first(h, tok)
    target = np.array(ans[1:])
    rows.append((np.array(draft), np.array(conf), np.array(run), np.array(rconf), target))
draft, conf, run, rconf, target = (np.concatenate(x) for x in zip(*rows))
print("positions", len(target), "top1 right", (draft == target).mean())
wrong = draft != target
for lo, hi in [(0, .02), (.02, .05), (.05, .1), (.1, .15), (.15, .25), (.25, 1.01)]:
    for k in range(3):
        m = (rconf[:, k] >= lo) & (rconf[:, k] < hi)
        if m.sum():
            print(f"runner {k+1} p in [{lo},{hi}): n={m.sum():5d} right {np.mean(run[m, k] == target[m]):.3f} mean p {rconf[m, k].mean():.3f}")
print("top-1 conf by bucket (right rate):")
for lo, hi in [(0, .2), (.2, .4), (.4, .6), (.6, .8), (.8, 1.01)]:
    m = (conf >= lo) & (conf < hi)
    print(f"  [{lo},{hi}) n={m.sum()} right {np.mean(draft[m] == target[m]):.3f}")
