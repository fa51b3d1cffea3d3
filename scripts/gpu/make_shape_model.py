#!/usr/bin/env python3
"""Write a model folder without weights: a model's shape and a tokenizer, for workers that make random weights.

    python3 scripts/gpu/make_shape_model.py OUT_DIR --preset smollm2-135m|llama3-8b [--tokenizer DIR]

OUT_DIR gets config.json, generation_config.json and the tokenizer files (tokenizer.json, tokenizer_config.json,
chat_template.jinja); a worker started on it with ``--load-format dummy`` makes the weights on its device. The
shape, not the weights, sets the speed, so a Llama-3-8B-shaped folder measures what an 8B model costs without
16 GB of weights to carry.

Presets (written here literally: nothing is read at run time but the tokenizer folder):
- ``smollm2-135m``: the config of xpyd's default model (SmolLM2-135M-Instruct, as ``ensure_converted(None)``
  writes it): 30 layers, hidden 576, 9 heads, 3 KV heads, vocab 49152, tied embeddings; 134,515,008 parameters.
- ``llama3-8b``: Meta-Llama-3-8B's shape: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
  intermediate 14336, vocab 128256, rope_theta 500000, untied lm_head, bfloat16; 8,030,261,248 parameters.

The tokenizer is SmolLM2's (``assets/smollm2-tokenizer`` beside this script, or ``--tokenizer DIR`` with a
tokenizer.json, tokenizer_config.json and chat_template.jinja). When the preset's vocabulary is larger than the
tokenizer's, filler special tokens ``<|reserved_ID|>`` fill ids up to vocab_size-1, so every id a random model
samples decodes; text encodes to the same ids in every preset (the fillers never match plain text).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")

# SmolLM2's special tokens: ids 0 (<|endoftext|>), 1 (<|im_start|>), 2 (<|im_end|>).
_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

PRESETS: dict[str, dict] = {
    # config.json of ensure_converted(None) (the default model's converted folder), as written there.
    "smollm2-135m": {
        "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "float32",
        "eos_token_id": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 576,
        "initializer_range": 0.02,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "pad_token_id": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 9.999999747378752e-06,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "transformers_version": "5.24.0",
        "unk_token_id": 0,
        "use_cache": True,
        "vocab_size": 49152,
    },
    # Meta-Llama-3-8B's shape; the special token ids are the tokenizer's (SmolLM2's), not Llama 3's.
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pad_token_id": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        # A transformers 5 config (rope_parameters, dtype). Without a version, transformers 5.17 (the GPU
        # machine's) takes the local tokenizer for a Mistral one and warns that its regex is wrong.
        "transformers_version": "5.17.0",
        "unk_token_id": 0,
        "use_cache": True,
        "vocab_size": 128256,
    },
}

GENERATION_CONFIG = {"_from_model_config": True, **_SPECIAL_IDS, "use_cache": True}


def filler_token(token_id: int) -> str:
    return f"<|reserved_{token_id}|>"


def tokenizer_size(tokenizer_json: dict) -> int:
    """Ids the tokenizer uses: one past the largest id of its vocabulary and added tokens."""
    ids = list(tokenizer_json["model"]["vocab"].values()) + [t["id"] for t in tokenizer_json.get("added_tokens", [])]
    return max(ids) + 1


def extend_vocabulary(tokenizer_json: dict, vocab_size: int) -> dict:
    """``tokenizer_json`` with filler special tokens at every id from its size to ``vocab_size``-1 (ValueError
    when the tokenizer already uses ids at or past ``vocab_size``: the model could not embed them)."""
    size = tokenizer_size(tokenizer_json)
    if size > vocab_size:
        raise ValueError(f"the tokenizer uses {size} ids, more than the model's vocab_size {vocab_size}")
    fillers = [{"id": i, "content": filler_token(i), "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i in range(size, vocab_size)]
    return {**tokenizer_json, "added_tokens": list(tokenizer_json.get("added_tokens", [])) + fillers}


def write_shape_model(out_dir: Path, preset: str, tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR) -> Path:
    """Write the folder (see the module docstring); ValueError for an unknown preset, a tokenizer folder that
    lacks a file, or an ``out_dir`` that holds weights (a folder of real weights is never overwritten)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    missing = [name for name in TOKENIZER_FILES if not (tokenizer_dir / name).is_file()]
    if missing:
        raise ValueError(f"tokenizer folder {tokenizer_dir} lacks {', '.join(missing)}")
    if out_dir.is_dir():
        weights = sorted(p.name for p in out_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        if weights:
            raise ValueError(f"{out_dir} holds weights ({', '.join(weights)}); give an empty or new folder")
    config = PRESETS[preset]
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer = extend_vocabulary(tokenizer, config["vocab_size"])
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", GENERATION_CONFIG)
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, separators=(",", ":")),
                                            encoding="utf-8")
    for name in TOKENIZER_FILES[1:]:
        (out_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out_dir


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="the model folder to write (created; must hold no weights)")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER_DIR,
                        help=f"folder with {', '.join(TOKENIZER_FILES)} (default: {DEFAULT_TOKENIZER_DIR})")
    args = parser.parse_args(argv)
    try:
        out = write_shape_model(args.out_dir, args.preset, args.tokenizer)
    except (ValueError, OSError) as e:
        print(f"make_shape_model: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
