"""APAR: paragraph trees, structure extraction, control tokens, the adapter and its training.

The decoding strategy itself is `mlx_specdec.decoding.apar` (method `apar`).
"""

from .tokens import CONVENTIONS, ControlTokens, control_tokens_for, find_control_tokens
from .tree import Fork, ParagraphTree, restore_answer, restore_tokens, tree_from_events

__all__ = ["CONVENTIONS", "ControlTokens", "Fork", "ParagraphTree", "control_tokens_for",
           "find_control_tokens", "restore_answer", "restore_tokens", "tree_from_events"]
