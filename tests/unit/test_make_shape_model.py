"""scripts/gpu/make_shape_model.py: weightless model folders that transformers, xpyd's tokenizer and the worker's
loader accept, with the shape each preset names and a tokenizer that decodes every id of the vocabulary."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from xpyd.model.loader import ensure_converted
from xpyd.model.runner import SUPPORTED_MODEL_TYPES, kv_token_bytes
from xpyd.model.sim.runner import ModelFacts
from xpyd.tokenization.tokenizer import LightTokenizer

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_shape_model", ROOT / "scripts" / "gpu" / "make_shape_model.py")
msm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(msm)

# Parameter counts: SmolLM2-135M (tied embeddings) and Meta-Llama-3-8B, as their model cards give them.
PARAMS = {"smollm2-135m": 134_515_008, "llama3-8b": 8_030_261_248}
# KV bytes per token: layers x 2 (K, V) x KV heads x head_dim x element size.
KV_BYTES = {("smollm2-135m", torch.float32): 30 * 2 * 3 * 64 * 4, ("llama3-8b", torch.bfloat16): 32 * 2 * 8 * 128 * 2}
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo, wörld! 123 <b>tags</b> and\ttabs\n"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again?"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shape")
    return {p: msm.write_shape_model(root / p, p) for p in msm.PRESETS}


@pytest.fixture(scope="module")
def tokenizers(folders: dict[str, Path]) -> dict[str, tuple]:
    return {p: (AutoTokenizer.from_pretrained(str(d)), LightTokenizer.from_folder(d)) for p, d in folders.items()}


def test_smollm2_preset_is_the_default_models_config(smollm_dir: Path) -> None:
    default = json.loads((smollm_dir / "config.json").read_text())
    default.pop("transformers_version")
    preset = dict(msm.PRESETS["smollm2-135m"])
    preset.pop("transformers_version")
    assert preset == default


def test_carried_tokenizer_is_the_default_models(smollm_dir: Path) -> None:
    for name in msm.TOKENIZER_FILES:
        ours, theirs = msm.DEFAULT_TOKENIZER_DIR / name, smollm_dir / name
        if name.endswith(".json"):
            mine = json.loads(ours.read_text())
            default = json.loads(theirs.read_text())
            for key in ("is_local", "local_files_only"):  # the loader's, not the tokenizer's
                default.pop(key, None)
            assert mine == default, name
        else:
            assert ours.read_bytes() == theirs.read_bytes(), name


@pytest.mark.parametrize("preset", sorted(msm.PRESETS))
def test_config_has_the_presets_shape(folders: dict[str, Path], preset: str) -> None:
    config = AutoConfig.from_pretrained(str(folders[preset]))
    assert config.model_type in SUPPORTED_MODEL_TYPES
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
             config.head_dim, config.intermediate_size, config.vocab_size, config.rope_parameters["rope_theta"],
             config.rms_norm_eps, config.max_position_embeddings, config.tie_word_embeddings, config.dtype)
    expected = {
        "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, 100000.0, 9.999999747378752e-06, 8192, True, torch.float32),
        "llama3-8b": (4096, 32, 32, 8, 128, 14336, 128256, 500000.0, 1e-05, 8192, False, torch.bfloat16),
    }[preset]
    assert shape == expected
    generation = json.loads((folders[preset] / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert not any(p.suffix in msm.WEIGHT_SUFFIXES for p in folders[preset].iterdir())


@pytest.mark.parametrize("preset", sorted(msm.PRESETS))
def test_config_names_a_transformers_5_version(preset: str) -> None:
    # transformers 5.17 warns of a wrong "Mistral regex" on loading a local tokenizer whose config.json has
    # no transformers_version (5.24 no longer does), so the config says which format it is written in.
    assert int(msm.PRESETS[preset]["transformers_version"].split(".")[0]) == 5


@pytest.mark.parametrize("preset", sorted(msm.PRESETS))
def test_parameter_count(folders: dict[str, Path], preset: str) -> None:
    config = AutoConfig.from_pretrained(str(folders[preset]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PARAMS[preset]


@pytest.mark.parametrize("preset", sorted(msm.PRESETS))
def test_every_id_decodes_alike_in_both_tokenizers(folders: dict[str, Path], tokenizers: dict, preset: str) -> None:
    hf, light = tokenizers[preset]
    vocab = AutoConfig.from_pretrained(str(folders[preset])).vocab_size
    assert len(hf) == len(light) == vocab
    ids = [[i] for i in range(vocab)]
    hf_texts = hf.batch_decode(ids)
    light_texts = light.backend_tokenizer.decode_batch(ids, skip_special_tokens=False)
    assert hf_texts == light_texts
    assert all(hf_texts), [i for i, t in enumerate(hf_texts) if not t][:10]
    fillers = hf_texts[49152:]
    assert fillers == [msm.filler_token(i) for i in range(49152, vocab)]
    assert hf.decode(list(range(49152, vocab)), skip_special_tokens=True) == ""  # fillers are special tokens


def test_chats_encode_to_the_same_ids_in_every_preset(tokenizers: dict) -> None:
    encodings = set()
    for hf, light in tokenizers.values():
        for add_generation_prompt in (False, True):
            want = hf.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          return_dict=True)["input_ids"]
            assert light.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt) == want
            encodings.add((add_generation_prompt, tuple(want)))
        encodings.add(("text", tuple(hf(CHAT[1]["content"]).input_ids)))
        assert light(CHAT[1]["content"]).input_ids == list(hf(CHAT[1]["content"]).input_ids)
    assert len(encodings) == 3  # one per kind, the same in every preset
    assert max(max(ids) for _, ids in encodings) < 49152


@pytest.mark.parametrize("preset,dtype", sorted(KV_BYTES))
def test_worker_loader_accepts_the_folder(folders: dict[str, Path], preset: str, dtype: torch.dtype) -> None:
    resolved = ensure_converted(str(folders[preset]), progress=False)
    assert resolved.path == folders[preset].resolve()
    assert resolved.served_name == preset
    assert kv_token_bytes(resolved.path, dtype) == KV_BYTES[(preset, dtype)]
    facts = ModelFacts.read(resolved.path)
    assert (facts.vocab_size, facts.max_position_embeddings, facts.eos_token_ids) == \
        (msm.PRESETS[preset]["vocab_size"], 8192, frozenset({2}))


def test_refuses_a_folder_with_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match="holds weights"):
        msm.write_shape_model(tmp_path, "llama3-8b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_refuses_a_tokenizer_larger_than_the_vocabulary() -> None:
    tokenizer = json.loads((msm.DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="49152 ids, more than the model's vocab_size 49151"):
        msm.extend_vocabulary(tokenizer, 49151)
    assert msm.extend_vocabulary(tokenizer, 49152)["added_tokens"] == tokenizer["added_tokens"]


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert msm.main([str(tmp_path / "m"), "--preset", "smollm2-135m"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(
        ("config.json", "generation_config.json") + msm.TOKENIZER_FILES)
    (tmp_path / "tok").mkdir()
    assert msm.main([str(tmp_path / "n"), "--preset", "llama3-8b", "--tokenizer", str(tmp_path / "tok")]) == 1
    assert "lacks tokenizer.json, tokenizer_config.json, chat_template.jinja" in capsys.readouterr().err
    assert not (tmp_path / "n").exists()
