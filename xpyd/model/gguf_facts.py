"""What a GGUF file says that transformers' GGUF reader does not carry into the converted model.

The loader converts a GGUF with transformers (`loader._convert_into`). Its reader maps a fixed set of metadata
keys per architecture; two that matter here it drops:
- rope scaling: llama.cpp stores Llama 3.1+'s as per-frequency factors (a ``rope_freqs`` tensor) and linear or
  YaRN scaling as ``{arch}.rope.scaling.*`` keys. A model converted without them computes other positions, so
  such a file is refused with the reason (its safetensors folder serves it);
- the head size of qwen3 (``{arch}.attention.key_length``) and the experts' size of qwen3moe
  (``{arch}.expert_feed_forward_length``): without them the config takes the class defaults (128; 768), which
  some released models have and others not; they are passed on to the conversion (`config_overrides`);
- gemma2's soft-caps (``{arch}.attn_logit_softcapping``, ``final_logit_softcapping``: the config's defaults, 50 and
  30, are the released models', not every file's), and Gemma's query_pre_attn_scalar, which no GGUF stores:
  llama.cpp derives it from the model, as the 27B models' hidden / heads and every other one's head size; the
  conversion would take the class default (256), so that rule is passed on too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# config field <- {arch}.<key>, for the architectures whose GGUF reader leaves it out
_LEFT_OUT = {"qwen3": {"head_dim": "attention.key_length"},
             "qwen3moe": {"head_dim": "attention.key_length", "moe_intermediate_size": "expert_feed_forward_length"},
             "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
                        "final_logit_softcapping": "final_logit_softcapping"}}
_FLOATS = ("attn_logit_softcapping", "final_logit_softcapping")
# llama.cpp's 27B Gemma (by its layer count) scales queries by (hidden / heads) ** -0.5, every other by head size's
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True, slots=True)
class GgufFacts:
    architecture: str
    left_out: dict  # config field -> its value in the file, for the fields the reader leaves out
    rope_scaling: str | None  # {arch}.rope.scaling.type, when not "none"
    rope_freqs: bool  # a rope_freqs tensor (llama.cpp's Llama 3.1+ rope scaling)

    @classmethod
    def read(cls, path: Path) -> "GgufFacts":
        import gguf

        reader = gguf.GGUFReader(str(path))
        fields = reader.fields

        def value(key: str):
            field = fields.get(key)
            return None if field is None else field.contents()

        arch = str(value("general.architecture"))
        scaling = value(f"{arch}.rope.scaling.type")
        left_out = {field: (float if field in _FLOATS else int)(value(f"{arch}.{key}"))
                    for field, key in _LEFT_OUT.get(arch, {}).items() if value(f"{arch}.{key}") is not None}
        if arch in _GEMMA_27B_LAYERS:
            is_27b = value(f"{arch}.block_count") == _GEMMA_27B_LAYERS[arch]
            scalar = (value(f"{arch}.embedding_length") // value(f"{arch}.attention.head_count") if is_27b
                      else value(f"{arch}.attention.key_length"))
            if scalar is not None:
                left_out["query_pre_attn_scalar"] = int(scalar)
        return cls(architecture=arch, left_out=left_out,
                   rope_scaling=None if scaling in (None, "none") else str(scaling),
                   rope_freqs=any(t.name == "rope_freqs.weight" for t in reader.tensors))

    def check_convertible(self, path: Path) -> None:
        """ValueError, saying why, for a file whose converted model would not compute what the file does."""
        what = ("per-frequency rope factors (rope_freqs: Llama 3.1+ rope scaling)" if self.rope_freqs
                else f"rope scaling {self.rope_scaling!r}" if self.rope_scaling else None)
        if what is not None:
            raise ValueError(f"{path}: the GGUF carries {what}, which transformers' GGUF reader drops (the converted "
                             f"model would compute other positions); serve the model's safetensors folder instead")

    def config_overrides(self) -> dict:
        """Config fields to pass to the conversion that its reader leaves out."""
        return dict(self.left_out)
