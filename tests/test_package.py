"""The package imports without ComfyUI and without torch work; the XL-shaped networks (CLS timbre) run end to end."""

import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import torch
from flowjam.engine.models.acestep import AceStepModel
from flowjam.engine.models.presets import TINY
from flowjam.engine.session import Session
from spec_keys import official_keys

TINY_XL = replace(
    TINY,
    hidden_size=96,
    intermediate_size=192,
    num_attention_heads=8,
    num_key_value_heads=2,
    encoder_hidden_size=64,
    encoder_intermediate_size=128,
    encoder_num_attention_heads=4,
    encoder_num_key_value_heads=2,
    timbre_cls_token=True,
)


def test_import_is_light_and_help_works():
    code = "import sys, flowjam; print('torch' in sys.modules, len(flowjam.NODE_CLASS_MAPPINGS) > 10)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False True", result.stderr
    help_text = subprocess.run([sys.executable, "-m", "flowjam", "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "render" in help_text.stdout


def test_a_built_wheel_holds_every_package_folder(tmp_path):
    """A non-editable install gets every subpackage (the fused kernels and the sync clocks included)."""
    source = tmp_path / "source"
    skipped = shutil.ignore_patterns(".*", "tests", "build", "*.egg-info", "__pycache__")
    shutil.copytree(Path(__file__).resolve().parents[1], source, ignore=skipped)
    folders = {Path("flowjam", init.parent.relative_to(source)) for init in source.rglob("__init__.py")}
    build = ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)]
    result = subprocess.run([sys.executable, "-m", "pip", *build], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("flowjam-*.whl")
    packed = {Path(name).parent for name in zipfile.ZipFile(wheel).namelist() if name.endswith("/__init__.py")}
    assert folders - packed == set(), "add these packages to [tool.setuptools] packages in pyproject.toml"


def test_xl_shaped_model_uses_a_cls_token_for_timbre_and_embeds_a_narrower_condition():
    torch.manual_seed(0)
    model = AceStepModel(TINY_XL).eval()
    expected = official_keys(TINY_XL)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected
    refs = torch.randn(2, 20, 64)
    with torch.no_grad():
        before = model.encoder.timbre_encoder(refs)
        model.encoder.timbre_encoder.special_token.add_(1.0)
        after = model.encoder.timbre_encoder(refs)
        states, _ = model.encoder(
            torch.randn(1, 5, 32),
            torch.ones(1, 5),
            torch.randn(1, 4, 32),
            torch.ones(1, 4),
            refs[:1],
            torch.zeros(1, dtype=torch.long),
        )
        velocity = model.decoder(
            torch.randn(1, 31, 64), torch.tensor([0.5]), torch.randn(1, 31, 128), encoder_hidden_states=states
        )
    assert not torch.allclose(before, after), "XL timbre must read its CLS token"
    assert states.shape == (1, 10, 64) and velocity.shape == (1, 31, 64)


def test_2b_timbre_reads_the_first_frame_and_ignores_the_special_token():
    torch.manual_seed(0)
    timbre = AceStepModel(TINY).eval().encoder.timbre_encoder
    refs = torch.randn(2, 20, 64)
    with torch.no_grad():
        before = timbre(refs)
        timbre.special_token.add_(1.0)
        after = timbre(refs)
    torch.testing.assert_close(before, after, atol=0, rtol=0)


def test_bfloat16_session_generates_finite_audio():
    session = Session.load(preset="tiny", dtype=torch.bfloat16)
    latent = session.generate(session.encode_text("bf16 check"), seconds=1.0, seed=3)
    assert latent.dtype == torch.bfloat16 and latent.shape == (1, 25, 64)
    audio = session.decode(latent)
    assert audio.shape == (2, 48_000) and torch.isfinite(audio).all()


def test_no_comfyui_node_or_panel_file_is_over_600_lines():
    """The node pack's files stay small enough to read: split one by job before it grows past 600 lines."""
    repo = Path(__file__).resolve().parents[1]
    files = sorted([*repo.glob("nodes/*.py"), *repo.glob("web/*.js"), repo / "__init__.py"])
    long = {str(f.relative_to(repo)): n for f in files if (n := len(f.read_text().splitlines())) > 600}
    assert long == {}, f"split these by job: {long}"
