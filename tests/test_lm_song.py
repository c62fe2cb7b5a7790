"""Prompt -> codes -> FSQ hints -> DiT context: Session.generate_codes and `render --lm` on the tiny presets."""

import subprocess
import sys

import pytest
import torch
from flowjam.engine.audio.files import read_audio
from flowjam.engine.lm.song import codes_for_seconds
from flowjam.engine.models.lm import NUM_CODES
from flowjam.engine.render import RenderRequest, render
from flowjam.engine.session import Session

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lm_session():
    """The tiny preset with the tiny LM attached."""
    session = Session.load()
    session.attach_lm()
    return session


def test_codes_cover_the_duration_at_five_per_second():
    assert [codes_for_seconds(s) for s in (10, 60, 12.3, 600)] == [50, 300, 62, 3000]


def test_generate_codes_gives_one_row_per_seed_with_the_given_metadata(lm_session):
    song = lm_session.generate_codes(
        "ambient pads, slow", 12.0, bpm=90, key="C major", time_signature="3/4", seeds=(0, 1, 2)
    )
    assert song.codes.shape == (3, 60) and song.codes.dtype == torch.int64
    assert 0 <= song.codes.min() and song.codes.max() < NUM_CODES
    assert (song.metadata.bpm, song.metadata.keyscale, song.metadata.timesignature, song.metadata.duration_s) == (
        90,
        "C major",
        3,
        12,
    )
    assert not torch.equal(song.codes[0], song.codes[1])
    again = lm_session.generate_codes(
        "ambient pads, slow", 12.0, bpm=90, key="C major", time_signature="3/4", seeds=(1,)
    )
    # A seed's draws do not depend on its batch neighbours. Only the first codes are compared: this random LM's
    # code distribution is nearly flat, so CPU GEMMs of other batch sizes (last-bit differences) can move a CDF
    # boundary later on; test_lm_generate checks whole sequences with a peaked model.
    assert torch.equal(again.codes[0, :8], song.codes[1, :8])


def test_open_metadata_is_written_by_phase_one(lm_session):
    song = lm_session.generate_codes("dark techno", 10.0, seeds=(4,))
    meta = song.metadata
    assert meta.bpm is not None and 30 <= meta.bpm <= 300
    assert meta.keyscale is not None and meta.timesignature in (2, 3, 4, 6) and meta.duration_s == 10


def test_codes_become_the_context_the_dit_is_conditioned_on(lm_session):
    codes = lm_session.generate_codes("lofi beat", 10.0, bpm=80, key="A minor", time_signature=4, seeds=(0,)).codes[0]
    context = lm_session.codes_context(codes, 250)
    assert context.shape == (1, 250, 128)
    expected_hints = lm_session.models.acestep.codes_to_hints(codes[None], 250)
    torch.testing.assert_close(context[..., :64], expected_hints)
    assert torch.equal(context[..., 64:], torch.ones(1, 250, 64))
    other = lm_session.codes_context(torch.roll(codes, 7), 250)
    assert not torch.allclose(other, context), "different codes must give a different structure"
    with pytest.raises(ValueError, match="50 codes cover 10 s but 300 frames need 60"):
        lm_session.codes_context(codes, 300)


def test_the_structure_reaches_the_generated_latent(lm_session):
    conditioning = lm_session.encode_text("lofi beat", bpm=80)
    frames = 250
    song = lm_session.generate_codes("lofi beat", 10.0, bpm=80, key="A minor", time_signature=4, seeds=(0, 1))
    latents = [
        lm_session.generate(conditioning, 10.0, seed=3, context_latents=lm_session.codes_context(codes, frames))
        for codes in song.codes
    ]
    assert latents[0].shape == (1, frames, 64)
    assert (latents[0] - latents[1]).abs().mean() > 1e-3, "other codes, same seed: the latent should change"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"caption": "  ", "duration_s": 10.0}, "the prompt is empty"),
        ({"caption": "x", "duration_s": 700.0}, "outside the LM's range 10..600 s"),
        ({"caption": "x", "duration_s": 5.0}, "outside the LM's range 10..600 s"),
        ({"caption": "x", "duration_s": 10.0, "seeds": ()}, "at least one seed"),
        ({"caption": "x", "duration_s": 10.0, "bpm": 900}, "bpm"),
    ],
)
def test_bad_song_requests_are_refused(lm_session, kwargs, message):
    with pytest.raises(ValueError, match=message):
        lm_session.generate_codes(**kwargs)


def test_unknown_lm_preset_and_missing_lm_are_clear_errors():
    session = Session.load()
    with pytest.raises(RuntimeError, match="attach_lm"):
        session.generate_codes("x", 10.0)
    with pytest.raises(ValueError, match="unknown LM preset 'lm-9b'"):
        session.attach_lm(preset="lm-9b")


def test_render_with_the_lm_writes_exactly_the_requested_length(tmp_path):
    out = tmp_path / "lm.wav"
    args = ["render", "--prompt", "synthwave, driving bass", "--seconds", "4", "--lm", "--out", str(out), "--seed", "2"]
    done = subprocess.run([sys.executable, "-m", "flowjam", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    audio, rate = read_audio(out)
    assert rate == 48_000 and audio.shape == (2, 4 * 48_000) and audio.abs().max() > 0


def test_render_lm_and_cover_together_is_refused(tmp_path):
    request = RenderRequest("x", 4.0, tmp_path / "o.wav", cover=tmp_path / "in.wav", lm=True)
    with pytest.raises(ValueError, match="use one of them"):
        render(Session.load(), request)


def first_live_latent(session, lm: bool, structure: float) -> torch.Tensor:
    from flowjam.live.app import LiveApp, LiveConfig

    app = LiveApp(session, LiveConfig("lofi beat", song_seconds=4.0, playback_mode="null", osc_port=None, lm=lm))
    app.registry.set("structure", structure)
    while app.runner._latest is None:
        app.runner.step()
    return app.runner._latest


def test_live_lm_structure_is_heard_and_the_structure_knob_fades_it(lm_session):
    plain = first_live_latent(lm_session, lm=False, structure=1.0)
    structured = first_live_latent(lm_session, lm=True, structure=1.0)
    faded_out = first_live_latent(lm_session, lm=True, structure=0.0)
    assert (structured - plain).abs().mean() > 1e-3, "the LM structure did not change the stream"
    torch.testing.assert_close(faded_out, plain)


def test_the_lm_vocabulary_maps_code_tags_to_ids_and_back():
    from flowjam.engine.lm.vocabulary import LMTokenizer
    from flowjam.engine.models.text_tokenizer import Qwen3Tokenizer

    tokenizer = LMTokenizer(Qwen3Tokenizer.from_package())
    text = "<|im_start|>assistant\n<|audio_code_0|><|audio_code_63999|><|audio_code_17|><|im_end|>"
    ids = tokenizer.encode(text)
    assert ids == [151_644, 77_091, 198, 151_669, 151_669 + 63_999, 151_669 + 17, 151_645]
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|audio_code_65534|>") == [217_203]  # the last of the 65,535 slots
    with pytest.raises(ValueError, match="beyond the 65535 code tokens"):
        tokenizer.encode("<|audio_code_65535|>")
