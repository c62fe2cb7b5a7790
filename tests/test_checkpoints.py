"""Loading real checkpoint layouts (official HF folders, ComfyUI split files and AIO, flowjam files) and their errors."""

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from flowjam.engine.checkpoints.loading import (
    CheckpointError,
    build_random,
    load_checkpoint,
    read_safetensors,
    save_flowjam_file,
)
from flowjam.engine.models.presets import get_preset
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def tiny():
    return build_random("tiny", seed=3)


@pytest.fixture(scope="module")
def official_heads():
    """Tiny widths with ACE-Step 1.5's head_dim 128 and window 128: what a file without a config may hold."""
    preset = get_preset("tiny")
    return build_random(
        replace(preset, name="tiny-128", dit=replace(preset.dit, head_dim=128, sliding_window=128)), seed=3
    )


def comfy_vae_name(key: str) -> str:
    """Official diffusers VAE key -> ComfyUI (stable-audio-tools) key, spelled out from ComfyUI's module tree."""
    top = {"conv1": 0, "snake1": 6, "conv2": 7}
    m = re.fullmatch(r"(encoder|decoder)\.(conv1|snake1|conv2)\.(\w+)", key)
    if m:
        return f"{m[1]}.layers.{top[m[2]]}.{m[3]}"
    m = re.fullmatch(r"encoder\.block\.(\d)\.res_unit(\d)\.(snake1|conv1|snake2|conv2)\.(\w+)", key)
    if m:
        part = ("snake1", "conv1", "snake2", "conv2").index(m[3])
        return f"encoder.layers.{int(m[1]) + 1}.layers.{int(m[2]) - 1}.layers.{part}.{m[4]}"
    m = re.fullmatch(r"encoder\.block\.(\d)\.(snake1|conv1)\.(\w+)", key)
    if m:
        return f"encoder.layers.{int(m[1]) + 1}.layers.{3 if m[2] == 'snake1' else 4}.{m[3]}"
    m = re.fullmatch(r"decoder\.block\.(\d)\.res_unit(\d)\.(snake1|conv1|snake2|conv2)\.(\w+)", key)
    if m:
        part = ("snake1", "conv1", "snake2", "conv2").index(m[3])
        return f"decoder.layers.{int(m[1]) + 1}.layers.{int(m[2]) + 1}.layers.{part}.{m[4]}"
    m = re.fullmatch(r"decoder\.block\.(\d)\.(snake1|conv_t1)\.(\w+)", key)
    assert m, key
    return f"decoder.layers.{int(m[1]) + 1}.layers.{0 if m[2] == 'snake1' else 1}.{m[3]}"


def comfy_vae_state(vae) -> dict:
    out = {}
    for key, value in vae.state_dict().items():
        name = comfy_vae_name(key)
        if name.endswith((".alpha", ".beta")):
            value = value.flatten()  # ComfyUI's SnakeBeta stores [C]
        if "decoder.layers.2." in name:  # a re-saved file may use parametrized weight-norm names
            name = name.replace("weight_g", "parametrizations.weight.original0").replace(
                "weight_v", "parametrizations.weight.original1"
            )
        out[name] = value.clone().contiguous()
    return out


def assert_same_weights(a, b):
    for name in ("acestep", "text_encoder", "vae"):
        left, right = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert left.keys() == right.keys(), name
        for key in left:
            assert torch.equal(left[key], right[key]), f"{name}.{key} differs after loading"


def plain(net) -> dict:
    return {k: v.clone().contiguous() for k, v in net.state_dict().items()}


def test_official_folder_layout_loads_exactly(tiny, tmp_path):
    dit_dir, vae_dir, text_dir = tmp_path / "acestep-v15-turbo", tmp_path / "vae", tmp_path / "Qwen3-Embedding-0.6B"
    for folder in (dit_dir, vae_dir, text_dir):
        folder.mkdir()
    save_file(plain(tiny.acestep), str(dit_dir / "model.safetensors"))
    (dit_dir / "config.json").write_text(json.dumps({"model_type": "acestep", "sliding_window": 8}))
    torch.save(tiny.silence_latent[0].t().contiguous().unsqueeze(0), dit_dir / "silence_latent.pt")  # [1, 64, F]
    save_file(plain(tiny.vae), str(vae_dir / "diffusion_pytorch_model.safetensors"))
    save_file(plain(tiny.text_encoder), str(text_dir / "model.safetensors"))
    loaded = load_checkpoint(tmp_path)
    assert_same_weights(tiny, loaded)
    assert torch.equal(loaded.silence_latent, tiny.silence_latent)
    assert loaded.config == tiny.config
    assert load_checkpoint(dit_dir).config == tiny.config  # the DiT folder itself works too


def write_comfy_split_files(bundle, models, dit: dict | None = None) -> None:
    """ComfyUI's models/ folder: the DiT (no config, no metadata), the text encoder and the VAE in their layouts."""
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (models / sub).mkdir(parents=True, exist_ok=True)
    save_file(
        plain(bundle.acestep) if dit is None else dit,
        str(models / "diffusion_models" / "acestep_v1.5_turbo.safetensors"),
    )
    save_file(
        {"model." + k: v for k, v in plain(bundle.text_encoder).items()},
        str(models / "text_encoders" / "qwen_0.6b_ace15.safetensors"),
    )
    save_file(comfy_vae_state(bundle.vae), str(models / "vae" / "ace_1.5_vae.safetensors"))


def test_comfyui_split_files_and_bf16_load(official_heads, tmp_path):
    models = tmp_path / "models"
    write_comfy_split_files(official_heads, models)
    loaded = load_checkpoint(models)
    assert_same_weights(official_heads, loaded)
    assert loaded.config == official_heads.config  # the official window 128 comes with the official head size
    assert_same_weights(official_heads, load_checkpoint(models / "diffusion_models" / "acestep_v1.5_turbo.safetensors"))

    save_file(
        {k: v.bfloat16() for k, v in plain(official_heads.acestep).items()},
        str(models / "diffusion_models" / "acestep_v1.5_turbo.safetensors"),
    )
    loaded = load_checkpoint(models)
    weight = loaded.acestep.decoder.proj_in[1].weight
    assert weight.dtype == torch.float32
    assert torch.equal(weight, official_heads.acestep.decoder.proj_in[1].weight.bfloat16().float())


def test_comfyui_all_in_one_checkpoint(official_heads, tmp_path):
    state = {"model.diffusion_model." + k: v for k, v in plain(official_heads.acestep).items()}
    state |= {"vae." + k: v for k, v in comfy_vae_state(official_heads.vae).items()}
    state |= {
        "text_encoders.qwen3_06b.transformer.model." + k: v for k, v in plain(official_heads.text_encoder).items()
    }
    state["text_encoders.qwen3_2b.transformer.model.norm.weight"] = torch.ones(8)  # the LM rides along; ignored here
    path = tmp_path / "ace_step_1.5_turbo_aio.safetensors"
    save_file(state, str(path))
    loaded = load_checkpoint(path)
    assert_same_weights(official_heads, loaded)
    assert loaded.config == official_heads.config


def test_flowjam_single_file_round_trip_keeps_the_sliding_window(tiny, tmp_path):
    loaded = load_checkpoint(save_flowjam_file(tiny, tmp_path / "tiny.safetensors"))
    assert_same_weights(tiny, loaded)
    assert torch.equal(loaded.silence_latent, tiny.silence_latent)
    assert loaded.config == tiny.config and loaded.config.sliding_window == 8  # from the file's metadata


@pytest.mark.parametrize("layout", ["comfyui split files", "official folder without config.json"])
def test_unofficial_head_size_without_a_config_is_refused_with_the_fix(tiny, tmp_path, layout):
    """head_dim 16 (not 128) and nothing that states the sliding window: no guess, an error that names the fix."""
    if layout == "comfyui split files":
        write_comfy_split_files(tiny, tmp_path / "models")
        path = tmp_path / "models"
    else:
        for folder, net, name in (
            ("acestep-v15-turbo", tiny.acestep, "model"),
            ("vae", tiny.vae, "diffusion_pytorch_model"),
            ("Qwen3-Embedding-0.6B", tiny.text_encoder, "model"),
        ):
            (tmp_path / folder).mkdir()
            save_file(plain(net), str(tmp_path / folder / f"{name}.safetensors"))
        path = tmp_path
    with pytest.raises(
        CheckpointError, match=r"head_dim 16, not ACE-Step 1.5's 128, and no config gives its sliding window"
    ) as error:
        load_checkpoint(path)
    assert 'config.json (with "sliding_window")' in str(error.value) and "save_flowjam_file" in str(error.value)


def test_wrong_key_set_is_one_error_listing_every_problem(official_heads, tmp_path):
    models = tmp_path / "models"
    dit = plain(official_heads.acestep)
    del dit["decoder.norm_out.weight"]
    dit["decoder.extra_tensor"] = torch.zeros(3)
    dit["decoder.scale_shift_table"] = torch.zeros(1, 2, 65)
    write_comfy_split_files(official_heads, models, dit)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(models)
    message = str(error.value)
    assert "1 missing (decoder.norm_out.weight)" in message
    assert "1 unexpected (decoder.extra_tensor)" in message
    assert "decoder.scale_shift_table (1, 2, 65) != (1, 2, 64)" in message


def test_missing_paths_name_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint path not found"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no acestep-v15"):
        load_checkpoint(tmp_path)
    (tmp_path / "acestep-v15-turbo").mkdir()
    with pytest.raises(CheckpointError, match="vae/ and Qwen3-Embedding-0.6B/"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--checkpoint", "/no/such/dir"], "checkpoint path not found: /no/such/dir"),
        (["--seconds", "0"], "seconds must be a finite number > 0"),
        (["--seconds", "-3"], "seconds must be a finite number > 0"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--checkpoint", "WRONG_KEYS"], "is not an ACE-Step 1.5 checkpoint"),
    ],
)
def test_cli_bad_input_prints_one_clear_error_line(args, expected, tmp_path):
    if "WRONG_KEYS" in args:
        wrong = tmp_path / "other_model.safetensors"
        save_file({"unet.conv_in.weight": torch.zeros(4, 4)}, str(wrong))
        args = [str(wrong) if a == "WRONG_KEYS" else a for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "flowjam", "render", "--prompt", "ambient", "--out", str(tmp_path / "x.wav"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not (tmp_path / "x.wav").exists()


def bad_safetensors(folder) -> dict:
    """name -> (a broken .safetensors file, what the error says about it)."""
    whole = folder / "whole.safetensors"
    save_file({"a": torch.zeros(1000)}, str(whole))
    raw = whole.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    files = {
        "empty": (b"", "is empty (0 bytes)"),
        "text": (b"model weights go here\n", "is not a .safetensors file"),
        "truncated": (raw[: header_end + 1000], "is truncated (1,000 of 4,000 bytes of tensor data)"),
        "header only": (raw[:header_end], "is truncated (0 of 4,000 bytes of tensor data)"),
    }
    for name, (data, _) in files.items():
        (folder / f"{name}.safetensors").write_bytes(data)
    return {name: (folder / f"{name}.safetensors", expected) for name, (_, expected) in files.items()}


@pytest.mark.parametrize("name", ["empty", "text", "truncated", "header only"])
def test_broken_safetensors_files_say_what_is_wrong_for_both_loaders(name, tmp_path):
    from flowjam.engine.lm.checkpoint import load_lm

    path, expected = bad_safetensors(tmp_path)[name]
    for load in (load_checkpoint, load_lm):
        with pytest.raises(CheckpointError) as error:
            load(path)
        assert str(path) in str(error.value) and expected in str(error.value), f"{load.__name__}: {error.value}"


def test_integer_weights_are_refused_at_load_naming_the_tensor_and_the_fix(tiny, tmp_path):
    """Cast to float as they were, int8 weights loaded silently and a render ended in NaN audio; now the load (before
    any rendering) says which tensor and what checkpoint to give, for the DiT and the 5 Hz LM alike."""
    from flowjam.engine.lm.checkpoint import build_random_lm, load_lm

    path = save_flowjam_file(tiny, tmp_path / "float.safetensors")
    state, meta = read_safetensors(path)
    quantized = tmp_path / "int8.safetensors"
    save_file(
        {
            k: (v * 127).round().clamp(-128, 127).to(torch.int8) if k.startswith("acestep.") else v
            for k, v in state.items()
        },
        str(quantized),
        metadata=meta,
    )
    fix = "flowjam needs float weights: give a float16, bfloat16 or float32 checkpoint of the model"
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(quantized)
    assert f"{quantized}: tensor " in str(error.value) and "holds int8 weights" in str(error.value), error.value
    assert fix in str(error.value), error.value

    lm_file = tmp_path / "lm_int8.safetensors"
    save_file({k: v.to(torch.int8) for k, v in plain(build_random_lm("tiny")).items()}, str(lm_file))
    with pytest.raises(CheckpointError, match="holds int8 weights"):
        load_lm(lm_file)

    out = tmp_path / "x.wav"
    result = subprocess.run(
        [sys.executable, "-m", "flowjam", "render", "--prompt", "ambient", "--seconds", "2", "--checkpoint"]
        + [str(quantized), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and fix in lines[0], result.stderr
    assert "denoise" not in result.stderr and not out.exists(), "refused only after rendering"
