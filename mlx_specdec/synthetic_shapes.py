"""The model shapes `mlx-specdec bench --synthetic NAME` builds, and what their weights and KV cache
weigh: shared by the synthetic bench (bench_synthetic.py) and the GPU prediction (gpu_prediction.py).
No MLX import here: the CLI's parser reads the names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from .errors import UserError

QUANT_GROUP, QUANT_BITS = 64, 4
# a 4-bit weight keeps a float16 scale and bias per group of 64: 4 + 32/64 = 4.5 bits a parameter
QUANT_BITS_PER_PARAM = QUANT_BITS + 2 * 16 / QUANT_GROUP


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    bits: Optional[int] = None  # 4: quantized (group 64); None: the float16 checkpoint
    max_positions: int = 4096  # Vicuna v1.5's window (the bench allows its longest context)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """One block: q, k, v, o, the gated MLP and two norms (Llama: no biases)."""
        kv = self.kv_heads * self.head_dim
        return (2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.ffn
                + 2 * self.hidden)

    def end_params(self) -> int:
        """The embedding table, the final norm and the (untied) vocabulary projection."""
        return 2 * self.vocab * self.hidden + self.hidden

    def params(self, layers: Optional[int] = None) -> int:
        return self.end_params() + (self.layers if layers is None else layers) * self.layer_params()

    def weight_bytes(self, layers: Optional[int] = None, bits: Optional[float] = None) -> float:
        """The weights at `bits` a parameter (default: the shape's own: 4.5 for 4-bit, else 16)."""
        per_param = bits if bits is not None else (QUANT_BITS_PER_PARAM if self.bits else 16)
        return self.params(layers) * per_param / 8

    def kv_bytes(self, context: int, layers: Optional[int] = None, item_bytes: int = 2) -> int:
        """Keys and values of `context` tokens (float16 by default: 2 * layers * kv width * 2 bytes a token)."""
        return 2 * (self.layers if layers is None else layers) * self.kv_heads * self.head_dim * item_bytes * context


def head_params(hidden: int, vocab: int, output: str, draft_vocab: int, blocks: int = 2) -> int:
    """A ReDrafter head for an LLM of this width (redrafter_head/model.py, no input projection: its
    blocks are 2 * hidden wide): U, W and b, the blocks, the output projection, and for an llm_head
    head the LLM's K output rows it scores with (kept beside it in float32)."""
    width = 2 * hidden
    size = 2 * hidden * hidden + hidden + blocks * (width * width + width)
    if output == "draft_vocab":
        return size + width * draft_vocab + draft_vocab
    return size + width * hidden + hidden + draft_vocab * hidden


_7B = dict(layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000)
_13B = dict(layers=40, hidden=5120, ffn=13824, heads=40, kv_heads=40, vocab=32000)
PRESETS: Dict[str, Shape] = {
    "vicuna-7b": Shape(**_7B),
    "vicuna-7b-4bit": Shape(**_7B, bits=QUANT_BITS),
    "vicuna-13b": Shape(**_13B),
    "vicuna-13b-4bit": Shape(**_13B, bits=QUANT_BITS),
}


def preset(name: str) -> Shape:
    if name not in PRESETS:
        public = ", ".join(n for n in PRESETS if not n.startswith("_"))
        raise UserError(f"unknown synthetic model {name!r} (choose {public})")
    return PRESETS[name]


def add_synthetic_args(p) -> None:
    """`bench --synthetic NAME` and its options (the prompts' options do not apply to it)."""
    names = ", ".join(n for n in PRESETS if not n.startswith("_"))
    p.add_argument("--synthetic", default=None, metavar="NAME",
                   help=f"instead of prompts: measure a model of this shape with random weights ({names}): "
                        "the verify-cost curve, each method's fixed costs, TriForce's retrieval level, APAR's "
                        "threads, peak memory, and a GPU prediction (docs/benchmarking.md)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="--synthetic: build only N layers and scale per-layer costs to the full depth")
    p.add_argument("--rounds", type=int, default=3, help="--synthetic: timed rounds, medians (default: %(default)s)")
    p.add_argument("--contexts", default="256,2048,8192,16384",
                   help="--synthetic: cached tokens to measure at (default: %(default)s)")
