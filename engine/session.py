"""Session: load the networks once, then encode text, prepare source audio, generate latents and decode audio."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import prompts
from .audio.files import resample
from .audio.window_decode import WindowDecoder, plan_window
from .checkpoints.loading import ModelBundle, load_models, silence_frames
from .conditioning import Conditioning, blend_conditionings
from .lm.checkpoint import load_lm
from .lm.sampling import SamplingParams
from .lm.song import CODE_RATE_HZ, SongCodes, SongWriter
from .lora import LoraAdapter, MergedLora, check_fits, lora_set, read_lora, structure_lock
from .lora import merge as merge_lora
from .lora import unmerge as unmerge_lora
from .lora.folded import FOLDABLE_DTYPES
from .models.fp8 import check_fp8_device, to_fp8
from .params import DEFAULT_PRECISION, DEFAULT_SHIFT, DEFAULT_STEPS, LORA_MODES, PRECISIONS, seconds_to_frames
from .stream import Finished, SlotRequest, StreamPipeline, seeded_noise
from .stream.windowed import WindowedStream
from .stream.windows import Timeline

CAPTION_MAX_TOKENS = 256
DECODE_MARGIN_FRAMES = 12
LYRIC_MAX_TOKENS = 2048


@dataclass
class Source:
    """Source audio in latent form: clean VAE latents and the FSQ structure hints a cover conditions on."""

    latents: torch.Tensor  # [1, T, 64]
    hints: torch.Tensor  # [1, T, 64]
    codes: torch.Tensor  # [1, ceil(T/5)] int

    @property
    def frames(self) -> int:
        return self.latents.shape[1]


class Session:
    def __init__(self, models: ModelBundle, backend: str = "eager"):
        self.models = models
        self.backend = backend  # how this session's streams run the DiT (engine.backends)
        self.song_writer: SongWriter | None = None  # the 5 Hz LM, once `attach_lm` has loaded it
        self.lm_origin: tuple | None = None  # (checkpoint, preset, seed) the LM was loaded from
        self.merged_loras: dict[str, MergedLora] = {}  # LoRAs merged into the DiT's weights, by name

    @classmethod
    def load(
        cls,
        checkpoint: str | Path | None = None,
        preset: str = "tiny",
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        precision: str = DEFAULT_PRECISION,
    ) -> Session:
        """Weights from a local checkpoint path, or the seeded preset (default: tiny, no files needed).

        `precision="fp8"` runs the DiT's per-tick linear layers in FP8 (Ada/Hopper GPUs; see models/fp8.py)."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        if precision == "fp8":
            check_fp8_device(torch.device(device))
        session = cls(load_models(checkpoint, preset=preset, device=device, dtype=dtype, seed=seed))
        if precision == "fp8":
            to_fp8(session.models.acestep.decoder)
        return session

    @property
    def device(self) -> torch.device:
        return self.models.device

    @property
    def dtype(self) -> torch.dtype:
        return self.models.dtype

    @property
    def sample_rate(self) -> int:
        return self.models.vae.sample_rate

    def attach_lm(
        self,
        checkpoint: str | Path | None = None,
        preset: str = "tiny",
        sampling: SamplingParams | None = None,
        seed: int = 0,
        compile_layers: bool = False,
    ) -> SongWriter:
        """Load the 5 Hz LM (a local file or folder, else the seeded `preset`) on this session's device and dtype;
        `compile_layers` (CUDA) trades a ~10 s first call for ~30 % faster decode steps."""
        lm = load_lm(checkpoint, preset=preset, device=self.device, dtype=self.dtype, seed=seed)
        self.song_writer = SongWriter(lm, self.models.tokenizer, sampling, compile_layers)
        self.lm_origin = (None if checkpoint is None else str(checkpoint), preset, seed)
        return self.song_writer

    # ---- LoRAs -----------------------------------------------------------------------------------------------

    def load_lora(
        self, lora: str | Path | LoraAdapter, strength: float = 1.0, name: str | None = None, mode: str = "auto"
    ) -> str:
        """Load a LoRA for the DiT (PEFT folder or .safetensors, see lora/formats.py, or what `read_lora` read);
        returns its name (its knob is `lora/<name>`). Modes: `live` runs its low-rank GEMMs in every tick (no extra
        memory); `folded` folds it into the weights on the tick after a strength change (ticks cost what a merge
        does; keeps a copy of the layers it touches); both play their strength with `set_lora_strength`. `merged`
        bakes it in at `strength` (fixed; `unload_lora` restores the exact weights). `auto`: folded where the DiT's
        weights are bf16/fp16/fp32 on a GPU, else live."""
        decoder = self.models.acestep.decoder
        adapter = lora if isinstance(lora, LoraAdapter) else self.read_lora(lora, name)
        if adapter.name in self.loras:
            raise ValueError(f"a LoRA named {adapter.name!r} is loaded already: unload it or pass another name")
        mode = self.lora_mode(mode)
        if mode == "merged":
            self.merged_loras[adapter.name] = merge_lora(decoder, adapter, strength)
        else:
            lora_set(decoder).attach(adapter, strength, mode)
        return adapter.name

    def read_lora(self, path: str | Path, name: str | None = None) -> LoraAdapter:
        """A LoRA file read and checked against this DiT, nothing loaded: a bad file fails here, before a caller
        that swaps LoRAs (`swap_loras`) changes anything."""
        decoder = self.models.acestep.decoder
        adapter = read_lora(path, {module for module, _ in decoder.named_modules()}, name)
        check_fits(decoder, adapter)
        return adapter

    def swap_loras(self, unload: list[str], load: list[tuple[LoraAdapter, float, str]]) -> None:
        """Unload the LoRAs named in `unload`, then load each (adapter from `read_lora`, strength, mode), as one
        change: no tick runs between its steps, and if a load fails every LoRA is put back as it was (the error is
        raised), so a stream playing this session keeps exactly the LoRAs it had."""
        with structure_lock(self.models.acestep.decoder):
            removed = [self._loaded_lora(name) for name in unload]
            for name in unload:
                self.unload_lora(name)
            added = []
            try:
                for adapter, strength, mode in load:
                    added.append(self.load_lora(adapter, strength, mode=mode))
            except BaseException:
                for name in reversed(added):
                    self.unload_lora(name)
                for adapter, strength, mode in removed:
                    self.load_lora(adapter, strength, mode=mode)
                raise

    def _loaded_lora(self, name: str) -> tuple[LoraAdapter, float, str]:
        """(adapter, strength, mode) of a loaded LoRA: what `load_lora` takes to load it again."""
        if name in self.merged_loras:
            merged = self.merged_loras[name]
            return merged.adapter, merged.strength, "merged"
        attached = lora_set(self.models.acestep.decoder)
        return attached.attached[name][1], attached.strength(name), attached.mode(name)

    def lora_mode(self, mode: str) -> str:
        """The mode `mode` means here (`auto` resolved), or an error naming the choices."""
        if mode not in LORA_MODES:
            raise ValueError(f"unknown LoRA mode {mode!r}: choose one of {', '.join(LORA_MODES)}")
        if mode != "auto":
            return mode
        layer = self.models.acestep.decoder.layers[0].mlp.up_proj
        weight = getattr(getattr(layer, "base", layer), "weight", None)
        foldable = weight is not None and weight.dtype in FOLDABLE_DTYPES and weight.device.type == "cuda"
        return "folded" if foldable else "live"

    def set_lora_strength(self, name: str, strength: float) -> None:
        """A loaded live or folded LoRA's strength, felt from the next tick by every generation in flight."""
        if name in self.merged_loras:
            raise ValueError(
                f"LoRA {name!r} is merged into the weights at a fixed strength: load it live or folded to play it"
            )
        lora_set(self.models.acestep.decoder).set_strength(name, strength)

    def unload_lora(self, name: str) -> None:
        decoder = self.models.acestep.decoder
        if name in self.merged_loras:
            unmerge_lora(decoder, self.merged_loras.pop(name))
        else:
            lora_set(decoder).detach(name)

    @property
    def loras(self) -> dict[str, tuple[float, str]]:
        """name -> (strength, mode: live, folded or merged) of every loaded LoRA."""
        attached = lora_set(self.models.acestep.decoder)
        loaded = {name: (attached.strength(name), attached.mode(name)) for name in attached.attached}
        loaded.update({name: (merged.strength, "merged") for name, merged in self.merged_loras.items()})
        return loaded

    # ---- structure from text (5 Hz LM) -----------------------------------------------------------------------

    def generate_codes(self, caption: str, duration_s: float, **song: Any) -> SongCodes:
        """Prompt -> 5 Hz audio codes (Phase 1 metadata if bpm/key/time signature are open, then Phase 2);
        `song` takes lyrics, bpm, key, time_signature, language, seeds, negative, on_code (see `SongWriter.write`)."""
        if self.song_writer is None:
            raise RuntimeError("no 5 Hz LM loaded: call session.attach_lm(checkpoint or preset) first")
        return self.song_writer.write(caption, duration_s, **song)

    @torch.no_grad()
    def codes_context(self, codes: torch.Tensor, frames: int) -> torch.Tensor:
        """Codes [N] or [1, N] -> the DiT's context latents [1, frames, 128]: FSQ detokenizer hints || ones."""
        codes = codes.reshape(1, -1).to(self.device)
        needed = math.ceil(frames / self.models.config.pool_window_size)
        if codes.shape[1] < needed:
            raise ValueError(
                f"{codes.shape[1]} codes cover {codes.shape[1] / CODE_RATE_HZ:g} s but {frames} frames need {needed}"
            )
        return with_chunk_mask(self.models.acestep.codes_to_hints(codes, frames).to(self.dtype))

    # ---- conditioning ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_text(
        self,
        tags: str,
        lyrics: str = "",
        bpm: float | None = None,
        key: str | None = None,
        time_signature: int | str | None = None,
        duration_s: float | None = None,
        task: str = "text2music",
        language: str = prompts.UNKNOWN_LANGUAGE,
        timbre: Source | None = None,
    ) -> Conditioning:
        """Caption + metas + lyrics (+ an optional timbre reference) -> the DiT's condition."""
        if task not in prompts.TASK_INSTRUCTIONS:
            raise ValueError(f"unknown task {task!r}: choose one of {', '.join(prompts.TASK_INSTRUCTIONS)}")
        caption = prompts.caption_prompt(
            tags,
            prompts.TASK_INSTRUCTIONS[task],
            bpm=bpm,
            time_signature=time_signature,
            key_scale=key,
            duration_s=duration_s,
        )
        lyric = prompts.lyric_prompt(lyrics.strip() or prompts.INSTRUMENTAL_LYRICS, language)
        tokenizer, text_encoder = self.models.tokenizer, self.models.text_encoder
        caption_ids, caption_mask = tokenizer.batch_encode([caption], CAPTION_MAX_TOKENS)
        lyric_ids, lyric_mask = tokenizer.batch_encode([lyric], LYRIC_MAX_TOKENS)
        caption_ids, lyric_ids = caption_ids.to(self.device), lyric_ids.to(self.device)
        text_states = text_encoder(caption_ids, caption_mask.to(self.device))
        lyric_states = text_encoder.embed(lyric_ids)
        reference = (
            timbre.latents
            if timbre is not None
            else silence_frames(self.models.silence_latent, self.models.config.timbre_fix_frame)
        )
        states, _ = self.models.acestep.encoder(
            text_states,
            caption_mask.to(self.device),
            lyric_states,
            lyric_mask.to(self.device),
            reference[:, : self.models.config.timbre_fix_frame].to(self.device, self.dtype),
            torch.zeros(1, dtype=torch.long, device=self.device),
        )
        return Conditioning(states, task, tags)

    def null_conditioning(self, like: Conditioning) -> Conditioning:
        """The unconditional condition for CFG: `null_condition_emb` in every position of `like`."""
        return Conditioning(self.models.acestep.null_condition(like.encoder_hidden_states), like.task, "")

    def blend_conditionings(self, a: Conditioning, b: Conditioning, alpha: float) -> Conditioning:
        """Prompt morph in embedding space: alpha 0 = a, 1 = b."""
        return blend_conditionings(a, b, alpha, self.models.acestep.null_condition_emb.detach())

    # ---- source audio ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def prepare_source(self, audio: torch.Tensor, sample_rate: int) -> Source:
        """Audio [C, N] or [1, C, N] at any rate (mono is duplicated) -> VAE latents + FSQ structure hints."""
        if audio.dim() == 3:
            audio = audio[0]
        if audio.dim() != 2 or audio.shape[0] not in (1, 2):
            raise ValueError(f"source audio must be [channels (1 or 2), samples], got {tuple(audio.shape)}")
        if not torch.isfinite(audio).all():
            raise ValueError("source audio contains NaN or infinite samples")
        audio = resample(audio.float(), sample_rate, self.sample_rate)
        if audio.shape[0] == 1:
            audio = audio.expand(2, -1)
        hop = self.models.vae.hop_samples
        if audio.shape[-1] < hop:
            raise ValueError(f"source audio is shorter than one latent frame ({hop} samples at {self.sample_rate} Hz)")
        audio = audio[:, : audio.shape[-1] // hop * hop]
        latents = self.models.vae.encode(audio[None].to(self.device, self.dtype)).transpose(1, 2)
        model = self.models.acestep
        quantized, codes = model.tokenize(latents, self.models.silence_latent)
        hints = model.detokenize(quantized)[:, : latents.shape[1]]
        return Source(latents, hints, codes[..., 0])

    # ---- generation ------------------------------------------------------------------------------------------

    def context_latents(self, frames: int, source: Source | None) -> torch.Tensor:
        """[1, T, 128] = source context (silence for text2music, structure hints for a cover) || chunk mask of ones."""
        if source is None:
            return with_chunk_mask(silence_frames(self.models.silence_latent, frames).to(self.device, self.dtype))
        return with_chunk_mask(source.hints[:, :frames])

    def initial_noise(self, frames: int, seed: int) -> torch.Tensor:
        """The seeded starting noise [1, T, 64] of a generation (drawn on the CPU: same on every device)."""
        return seeded_noise(seed, frames, self.models.config.audio_acoustic_hidden_dim).to(self.device, self.dtype)

    def make_request(
        self,
        conditioning: Conditioning,
        seconds: float | None = None,
        source: Source | None = None,
        seed: int = 0,
        steps: int = DEFAULT_STEPS,
        shift: float = DEFAULT_SHIFT,
        denoise: float = 1.0,
        **options: Any,
    ) -> SlotRequest:
        """A stream request: T from the source (cropped to `seconds`) or from `seconds`; `options` are any other
        `SlotRequest` fields (cfg_mode, negative, guidance, curves, x0_target, latent_mask, dcw, ...)."""
        if source is None:
            frames = seconds_to_frames(seconds if seconds is not None else 0.0)
            source_latents = options.pop("source_latents", None)
        else:
            frames = source.frames if seconds is None else min(source.frames, seconds_to_frames(seconds))
            source_latents = options.pop("source_latents", source.latents[:, :frames])
        if denoise < 1.0 and source_latents is None:
            raise ValueError("denoise < 1 needs source audio to start from (a cover); use denoise 1 for text2music")
        context = options.pop("context_latents", None)
        if context is None:
            context = self.context_latents(frames, source)
        return SlotRequest(
            conditioning=conditioning,
            context_latents=context,
            seed=seed,
            steps=steps,
            shift=shift,
            denoise=denoise,
            source_latents=source_latents,
            **options,
        )

    def generate(
        self,
        conditioning: Conditioning,
        seconds: float | None = None,
        seed: int = 0,
        steps: int = DEFAULT_STEPS,
        shift: float = DEFAULT_SHIFT,
        denoise: float = 1.0,
        source: Source | None = None,
        on_step: Callable[[int, int], None] | None = None,
        **options: Any,
    ) -> torch.Tensor:
        """One-shot generation -> latent [1, T, 64]: the same pipeline as a stream, at depth 1."""
        request = self.make_request(conditioning, seconds, source, seed, steps, shift, denoise, **options)
        pipeline = StreamPipeline(self.models.acestep.decoder, depth=1)
        pipeline.submit(request)
        total = request.steps if request.denoise > 1e-6 else 1
        for tick in range(1, total + 1):
            finished = pipeline.tick()
            if on_step is not None:
                on_step(tick, total)
            if finished:
                return finished[0].latent
        raise RuntimeError("generation did not finish within its schedule")

    def stream(
        self,
        depth: int = 4,
        backend: str | None = None,
        paced: bool = False,
        window_s: float = 0.0,
        song_seconds: float | None = None,
        endless: bool = False,
    ) -> StreamHandle:
        """A live pipeline on this session's decoder; feed it requests from `make_request` (`paced`: see
        StreamPipeline). `window_s` W with `song_seconds` (or `endless`): a windowed stream (`WindowedStream`) whose
        requests, made for the whole song (endless: for `timeline.ring` frames, read cyclically), run on W seconds at
        the write point given to `submit`, so a tick costs W, not the song; W = 0 or W >= the song: every request
        runs whole, as without a window."""
        pipeline = StreamPipeline(
            self.models.acestep.decoder, depth=depth, backend=backend or self.backend, paced=paced
        )
        handle = StreamHandle(self, pipeline)
        if not window_s and not endless:
            return handle
        if song_seconds is None and not endless:
            raise ValueError("a windowed stream needs song_seconds (the loop's length) or endless=True")
        song = None if endless else seconds_to_frames(song_seconds)
        windowed = WindowedStream.over(pipeline, window_s, song, self.device, self.dtype, "window_s")
        return handle if windowed is None else WindowedStreamHandle(self, pipeline, windowed)

    # ---- decoding --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(
        self,
        latent: torch.Tensor,
        t_start: float | None = None,
        window_s: float | None = None,
        margin_frames: int = DECODE_MARGIN_FRAMES,
        cyclic: bool = False,
    ) -> torch.Tensor:
        """Latent [1, T, 64] -> stereo audio at 48 kHz, as the VAE decodes it (no normalisation: windows of one
        latent must join seamlessly; see `peak_normalize` for offline renders).

        Without `t_start`, the whole latent ([2, T*1920]). With it, only `window_s` seconds from `t_start`
        ([2, window_frames*1920]), decoded with `margin_frames` of context on each side (the VAE decoder sees
        about 9 frames each way, so the kept audio equals a full decode); `cyclic` takes the context across the
        loop seam."""
        if t_start is None:
            return self._vae_decode(latent)
        window = plan_window(latent.shape[1], t_start, window_s, margin_frames, cyclic)
        audio = self._vae_decode(window.frames_of(latent))
        return audio[:, window.kept_samples(self.models.vae.hop_samples)]

    def window_decoder(self, capture: bool = True) -> WindowDecoder:
        """A decoder of windows for one thread: CUDA-graph replays on a GPU, the same audio as `decode`."""
        return WindowDecoder(self.models.vae, self.device, self.dtype, capture=capture)

    def _vae_decode(self, latent: torch.Tensor) -> torch.Tensor:
        return self.models.vae.decode(latent.transpose(1, 2).to(self.device, self.dtype))[0].float()


def with_chunk_mask(src: torch.Tensor) -> torch.Tensor:
    """Source context [1, T, 64] -> the DiT's context latents [1, T, 128]: src || a chunk mask of ones."""
    return torch.cat([src, torch.ones_like(src)], dim=-1)


def peak_normalize(audio: torch.Tensor) -> torch.Tensor:
    """Scale down to a peak of 1 if the audio would clip (what the official pipeline does after decoding)."""
    peak = audio.abs().max()
    return audio / peak if peak > 1.0 else audio


class StreamHandle:
    """A session's live stream: submit requests, tick, steer shared curves and depth, decode windows."""

    def __init__(self, session: Session, pipeline: StreamPipeline):
        self.session = session
        self.pipeline = pipeline

    def submit(self, request: SlotRequest, supersedes: bool = False) -> None:
        self.pipeline.submit(request, supersedes)

    def tick(self) -> list[Finished]:
        return self.pipeline.tick()

    def set_shared_curve(self, name: str, value: Any) -> None:
        self.pipeline.set_shared_curve(name, value)

    def set_depth(self, depth: int) -> None:
        self.pipeline.set_depth(depth)

    @property
    def depth(self) -> int:
        return self.pipeline.depth

    def shared_curves(self) -> dict[str, torch.Tensor]:
        return self.pipeline.shared_curves()

    def stats(self) -> dict[str, Any]:
        return self.pipeline.stats()

    def decode(self, latent: torch.Tensor, t_start: float, window_s: float, cyclic: bool = True) -> torch.Tensor:
        return self.session.decode(latent, t_start, window_s, cyclic=cyclic)


class WindowedStreamHandle(StreamHandle):
    """A session's windowed stream (`Session.stream(window_s=W, ...)`): `submit(request, at_frame=...)` places the
    song-long request on the window at that write point, `tick(frozen_frame)` merges what it delivers into
    `timeline`."""

    def __init__(self, session: Session, pipeline: StreamPipeline, windowed: WindowedStream):
        super().__init__(session, pipeline)
        self.windowed = windowed

    @property
    def timeline(self) -> Timeline:
        return self.windowed.timeline

    def submit(
        self, request: SlotRequest, supersedes: bool = False, at_frame: int = 0, denoise: float | None = None
    ) -> None:
        """See `WindowedStream.submit`."""
        self.windowed.submit(request, supersedes, at_frame, denoise)

    def tick(self, frozen_frame: int = 0) -> list[Finished]:
        return self.windowed.tick(frozen_frame)
