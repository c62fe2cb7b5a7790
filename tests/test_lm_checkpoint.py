"""Loading the 5 Hz LM from every real layout (official HF folders, sharded, ComfyUI split file and all-in-one),
seeded random presets, and the errors that name the fix."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from flowjam.engine.checkpoints.loading import CheckpointError
from flowjam.engine.lm.checkpoint import TEXT_ENCODER_VOCAB, load_lm
from flowjam.engine.models.lm import AUDIO_CODE_BASE, LM_PRESETS, Qwen3LM
from qwen_reference import EOS_ID, random_state
from safetensors.torch import save_file

PROMPT = torch.tensor([[151_644, 872, 198, 9_707, AUDIO_CODE_BASE + 7, AUDIO_CODE_BASE + 63_999, EOS_ID]])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference() -> Qwen3LM:
    return load_lm(None, "tiny", seed=5)


@pytest.fixture(scope="module")
def state(reference) -> dict[str, torch.Tensor]:
    """The reference LM in the official key layout (`model.*`, no lm_head)."""
    return {k: v.detach().clone().contiguous() for k, v in reference.state_dict().items()}


def unprefixed(state: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in state.items()}


def assert_no_meta_tensors(lm: Qwen3LM) -> None:
    """The loaders build on the meta device: a buffer added to Qwen3LM would be left there, unfilled."""
    left = [name for name, t in [*lm.named_parameters(), *lm.named_buffers()] if t.is_meta]
    assert not left, f"still on the meta device (recreate them after loading): {left}"


def write(path: Path, tensors: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


# ---- layouts: each writes the reference LM under tmp_path and returns what a user would pass ---------------


def official_folder(state, root):
    return write(root / "acestep-5Hz-lm-1.7B" / "model.safetensors", state).parent


def official_folder_without_prefix(state, root):
    return write(root / "acestep-5Hz-lm-0.6B" / "model.safetensors", unprefixed(state)).parent


def official_folder_with_tied_head_copy(state, root):
    tensors = state | {"lm_head.weight": state["model.embed_tokens.weight"].clone()}
    return write(root / "acestep-5Hz-lm-4B" / "model.safetensors", tensors).parent


def sharded_folder(state, root):
    folder = root / "acestep-5Hz-lm-4B"
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        write(folder / shard, {k: state[k] for k in keys})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def parent_of_official_folder(state, root):
    official_folder(state, root)
    return root


def comfy_split_file(state, root):
    return write(root / "models" / "text_encoders" / "qwen_1.7b_ace15.safetensors", state)


def comfy_models_folder_beside_text_encoder(state, root):
    """ComfyUI keeps the caption encoder (qwen_0.6b_ace15) next to the LM: the LM must be the one picked."""
    encoder = {k: v[:TEXT_ENCODER_VOCAB] if k == "model.embed_tokens.weight" else v for k, v in state.items()}
    write(root / "models" / "text_encoders" / "qwen_0.6b_ace15.safetensors", encoder)
    write(root / "models" / "text_encoders" / "qwen_4b_ace15.safetensors", state)
    return root / "models"


def comfy_all_in_one(state, root):
    tensors = {"text_encoders.qwen3_2b.transformer." + k: v for k, v in state.items()}
    tensors |= {"text_encoders.qwen3_06b.transformer.model.norm.weight": torch.ones(8)}  # the caption encoder
    tensors |= {"model.diffusion_model.decoder.norm_out.weight": torch.ones(8)}  # the DiT
    tensors |= {"vae.decoder.layers.0.weight_v": torch.ones(4, 2, 3)}  # the VAE
    return write(root / "ace_step_1.5_turbo_aio.safetensors", tensors)


LAYOUTS = [
    official_folder,
    official_folder_without_prefix,
    official_folder_with_tied_head_copy,
    sharded_folder,
    parent_of_official_folder,
    comfy_split_file,
    comfy_models_folder_beside_text_encoder,
    comfy_all_in_one,
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda f: f.__name__)
def test_every_layout_loads_the_same_weights_and_logits(layout, reference, state, tmp_path):
    loaded = load_lm(layout(state, tmp_path))
    assert loaded.config == LM_PRESETS["tiny"]
    assert not loaded.training
    loaded_state = loaded.state_dict()
    assert loaded_state.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded_state[key], value), f"{key} differs after loading"
    assert_no_meta_tensors(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT), reference(PROMPT)), "logits differ from the saved model's"


def test_bf16_file_loads_into_the_requested_dtype(state, tmp_path):
    path = write(tmp_path / "qwen_1.7b_ace15.safetensors", {k: v.bfloat16() for k, v in state.items()})
    loaded = load_lm(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert torch.equal(loaded.model.embed_tokens.weight, state["model.embed_tokens.weight"].bfloat16())


def test_shapes_outside_the_presets_still_load(tmp_path):
    config = replace(LM_PRESETS["tiny"], hidden_size=48, num_hidden_layers=3, num_attention_heads=6)
    state = random_state(Qwen3LM(config), seed=1)
    loaded = load_lm(write(tmp_path / "lm" / "model.safetensors", state).parent)
    assert loaded.config == config


def test_config_json_settings_are_used(state, tmp_path):
    folder = official_folder(state, tmp_path)
    (folder / "config.json").write_text(json.dumps({"rope_theta": 500_000.0, "tie_word_embeddings": True}))
    assert load_lm(folder).config.rope_theta == 500_000.0


# ---- random presets --------------------------------------------------------------------------------------------


def test_random_preset_is_deterministic_for_a_seed():
    first, again, other = load_lm(None, "tiny", seed=1), load_lm(None, "tiny", seed=1), load_lm(None, "tiny", seed=2)
    for key, value in first.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), f"{key} differs for the same seed"
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_random_preset_has_unit_norms_small_weights_and_the_requested_dtype():
    lm = load_lm(None, "tiny", seed=0, dtype=torch.bfloat16)
    assert not lm.training
    assert all(p.dtype == torch.bfloat16 for p in lm.parameters())
    assert_no_meta_tensors(lm)
    assert torch.all(lm.model.layers[1].self_attn.q_norm.weight == 1) and torch.all(lm.model.norm.weight == 1)
    assert 0.018 < lm.model.embed_tokens.weight.float().std().item() < 0.022


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid presets: tiny, lm-0.6b, lm-1.7b, lm-4b"):
        load_lm(None, "lm-2b")


# ---- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_text_encoder_file_is_refused_with_the_files_to_pass(prefix, state, tmp_path):
    encoder = {k.removeprefix("model."): v for k, v in state.items()}
    encoder["embed_tokens.weight"] = encoder["embed_tokens.weight"][:TEXT_ENCODER_VOCAB]
    path = write(tmp_path / "qwen_0.6b_ace15.safetensors", {prefix + k: v for k, v in encoder.items()})
    with pytest.raises(CheckpointError) as error:
        load_lm(path)
    message = str(error.value)
    assert "is the Qwen3-Embedding text encoder" in message and "not the 5 Hz LM" in message
    assert "acestep-5Hz-lm-" in message and "qwen_1.7b_ace15.safetensors" in message


def test_untied_head_is_refused(state, tmp_path):
    tensors = state | {"lm_head.weight": state["model.embed_tokens.weight"] + 1}
    with pytest.raises(CheckpointError, match="the output head is not tied"):
        load_lm(write(tmp_path / "lm" / "model.safetensors", tensors).parent)


def test_missing_path_names_it_and_the_expected_files(tmp_path):
    with pytest.raises(CheckpointError) as error:
        load_lm(tmp_path / "nowhere")
    assert f"not found: {tmp_path / 'nowhere'}" in str(error.value)
    assert "acestep-5Hz-lm-{0.6B,1.7B,4B}/" in str(error.value)


def test_folder_without_an_lm_names_the_expected_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"holds no 5 Hz LM; expected an acestep-5Hz-lm-"):
        load_lm(tmp_path)


def test_folder_with_two_lms_asks_which_one(state, tmp_path):
    write(tmp_path / "text_encoders" / "qwen_1.7b_ace15.safetensors", state)
    write(tmp_path / "text_encoders" / "qwen_4b_ace15.safetensors", state)
    with pytest.raises(CheckpointError, match="holds several 5 Hz LMs .*pass the one to use"):
        load_lm(tmp_path)


def test_all_in_one_without_the_lm_is_refused(state, tmp_path):
    tensors = {"text_encoders.qwen3_06b.transformer." + k: v for k, v in state.items()}
    path = write(
        tmp_path / "aio.safetensors", tensors | {"model.diffusion_model.decoder.norm_out.weight": torch.ones(8)}
    )
    with pytest.raises(CheckpointError, match="holds no 5 Hz LM"):
        load_lm(path)


def test_missing_layer_key_is_the_strict_error(state, tmp_path):
    tensors = dict(state)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError) as error:
        load_lm(write(tmp_path / "lm" / "model.safetensors", tensors).parent)
    message = str(error.value)
    assert "1 missing (model.layers.1.mlp.up_proj.weight)" in message
    assert "Pass the matching file for the 5 Hz LM" in message
