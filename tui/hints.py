"""What to tell the user when loading or answering fails: one line for the error, one hint for what to do.

Never imports Textual.
"""

from __future__ import annotations

HINTS = {
    "ContextOverflow": "The conversation no longer fits the model's context window: start a new "
                       "one (Ctrl+N) or lower max tokens (Ctrl+O).",
    "ModelNotFound": "Check --model (a model directory, .gguf file or Hugging Face repo id), or run "
                     "`mlx-specdec fetch` for the default model.",
    "CorruptModel": "The model files are damaged: delete that model directory and fetch or convert it again.",
    "UnsupportedModel": "mlx-specdec runs Llama-family models: choose another --model.",
    "DrafterMismatch": "The draft head was trained for another model: pass --drafter DIR for this "
                       "model, or choose another method (Ctrl+O).",
    "NoDrafter": "Train one with `mlx-specdec train-drafter` and pass --drafter DIR, or choose "
                 "another method (Ctrl+O).",
    "UnknownMethod": "Choose another method (Ctrl+O).",
    "NoControlTokens": "APAR needs a model with [Fork]/[Child] tokens: train an adapter with "
                       "`mlx-specdec train-apar`, or choose another method (Ctrl+O).",
    "AdapterMismatch": "The APAR adapter was trained for another model: pass a matching one, or "
                       "choose another method (Ctrl+O).",
}


def hint_for(exc: BaseException) -> str:
    for cls in type(exc).__mro__:
        if cls.__name__ in HINTS:
            return HINTS[cls.__name__]
    text = str(exc).lower()
    if "adapter" in text or "drafter" in text:
        return "Pass a matching --drafter/adapter for this model, or choose another method (Ctrl+O)."
    if "context" in text:
        return HINTS["ContextOverflow"]
    return "Change the method or settings (Ctrl+O) or start a new conversation (Ctrl+N)."


def error_line(exc: BaseException) -> str:
    from mlx_specdec.errors import UserError

    if isinstance(exc, UserError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
