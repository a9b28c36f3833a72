"""The model a benchmark runs without ``--model``: ``build/llama-SIZE``, built by ``build_tiny`` if missing."""

from __future__ import annotations

from pathlib import Path

BUILD = Path(__file__).resolve().parents[1] / "build"


def model_dir(model: str, size: str) -> str:
    """``model`` if given, else ``build/llama-SIZE``, built once: a random-weight Llama of that preset, or for
    ``trained`` the small Llama benchmarks/train_tiny.py trains (about 2.5 minutes on 2 cores)."""
    if model:
        return model
    path = BUILD / f"llama-{size}"
    if size == "trained":
        if not (path / "training.json").exists():  # written last
            from train_tiny import train

            train(path)
    elif not (path / "config.json").exists():
        from common.models.tiny import build_tiny

        build_tiny("llama", path, size=size)
    return str(path)


def kernel_use(engine) -> dict[str, bool]:
    """Which of the engine's CPU kernels this engine runs (figures depend on it; see common/engine/cpu_kernels)."""
    layouts = {getattr(m, "layout", None) for m in engine.loaded.model.modules()}
    return {"attention_rmsnorm": bool(engine.runner.decode_kernel), "bf16_linear": "bf16_pairs" in layouts,
            "bf16_amx": "bf16_amx" in layouts, "fp32_linear": "fp32_blocks" in layouts,
            "prefill_attention": bool(engine.runner.prefill_kernel)}
