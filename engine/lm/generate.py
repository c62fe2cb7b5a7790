"""Phase 2: batched audio-code generation with our own prefill + decode loop (not `generate`).

One call generates N sequences, each with its own prompt, length and seed:

- every distinct prompt is prefilled once and its KV rows are copied to the other sequences that share it;
- with CFG the cache holds 2·n rows, conditional rows 0..n-1 and unconditional rows n..2n-1, and one forward per
  step runs them all; CFG `l_u + g·(l_c − l_u)` is taken on the code logits only (a view of the tied embedding);
- exact length control: sequence i yields exactly `num_codes` codes, each sampled among the 64,000 valid codes
  only (EOS and the unused code slots are never candidates, so no step is spent on an end token);
- the host knows in advance at which step each sequence ends, so a finished sequence leaves the batch (its rows
  are compacted away) without reading anything back from the device: the whole loop has one host sync, at the end;
- on CUDA the steady-state step (forward, CFG, sampling, bookkeeping, all in place on static buffers) is captured
  in a CUDA graph per (active sequences, key-range bucket) and replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..models.lm import AUDIO_CODE_BASE, EAGER_STEP, Qwen3LM, compiled_layer_step
from .sampling import SamplingParams, cfg_logits, sample

KEY_BLOCK = 128  # attention reads keys up to the active rows' furthest position, rounded up to this


@dataclass(frozen=True)
class CodeRequest:
    """One sequence to generate: its prompt ids (and unconditional prompt ids for CFG), length and seed."""

    prompt_ids: tuple[int, ...]
    num_codes: int
    seed: int = 0
    uncond_ids: tuple[int, ...] = ()

    def validate(self, guided: bool) -> None:
        if not self.prompt_ids:
            raise ValueError("a code request needs a non-empty prompt")
        if self.num_codes < 1:
            raise ValueError(f"num_codes must be >= 1, got {self.num_codes}")
        if guided and not self.uncond_ids:
            raise ValueError("CFG (cfg > 1) needs the unconditional prompt ids (uncond_ids)")


@dataclass
class DecodeState:
    """Device buffers the decode step updates in place (static addresses, so a CUDA graph can replay the step)."""

    tokens: torch.Tensor  # [rows] token fed at this step: the previous code of each row's sequence
    positions: torch.Tensor  # [rows] where that token is written in the cache
    seeds: torch.Tensor  # [n] seed of the sequence in each slot
    owners: torch.Tensor  # [n] request index of each slot
    step: torch.Tensor  # [] index of the code being sampled
    codes: torch.Tensor  # [N, max_codes] output, by request index
    active: list[int] = field(default_factory=list)  # host copy of owners[:n]
    prompt_lengths: dict[int, int] = field(default_factory=dict)  # request -> its longer prompt length (host)


class CodeGenerator:
    """Generates audio codes for a batch of `CodeRequest`s with one Qwen3LM. Not thread-safe (owns the KV cache).

    Buffers and captured graphs are kept between calls with the same batch size, lengths and prompt lengths."""

    def __init__(
        self,
        lm: Qwen3LM,
        sampling: SamplingParams | None = None,
        cuda_graphs: bool | None = None,
        compile_layers: bool = False,
    ):
        """`cuda_graphs` (default: on for CUDA) replays each step as a graph; `compile_layers` runs the layer step
        through torch.compile (fused norm/RoPE/elementwise kernels; the first steps of a new shape compile)."""
        self.lm = lm
        self._layer_step = compiled_layer_step() if compile_layers else EAGER_STEP
        self._advance = torch.compile(advance, fullgraph=True) if compile_layers else advance
        self.sampling = sampling or SamplingParams()
        self.sampling.validate()
        device = lm.model.embed_tokens.weight.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError("cuda_graphs needs the LM on a CUDA device")
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.state: DecodeState | None = None
        self._layout: tuple[int, ...] = ()
        self._kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def set_sampling(self, sampling: SamplingParams) -> None:
        """New sampling settings for the next call (captured graphs bake them in, so they are dropped)."""
        sampling.validate()
        if sampling != self.sampling:
            self.sampling = sampling
            self._graphs.clear()
            self.state = None  # the row layout depends on CFG being on or off

    @property
    def guided(self) -> bool:
        return self.sampling.guided

    @property
    def device(self) -> torch.device:
        return self.lm.model.embed_tokens.weight.device

    @torch.no_grad()
    def generate(
        self, requests: Sequence[CodeRequest], on_code: Callable[[int, int], None] | None = None
    ) -> list[torch.Tensor]:
        """-> one int64 CPU tensor of exactly `num_codes` codes (0..63,999) per request, in request order.

        `on_code(done, total)` runs on the host after each code step (`total` = the longest request's codes); it
        may raise to stop the generation there (a host UI's Cancel), and it forces no device sync."""
        if not requests:
            raise ValueError("generate needs at least one CodeRequest")
        for request in requests:
            request.validate(self.guided)
        total = max(r.num_codes for r in requests)
        report = on_code or (lambda done, total: None)
        self._start(requests)
        report(1, total)
        state = self.state
        for step in range(1, total):
            active = [i for i in state.active if requests[i].num_codes > step]
            if active != state.active:
                self._compact(active)
            self._run_step(len(active), self._keys_end(step))
            report(step + 1, total)
        codes = state.codes.cpu()  # the one host sync of the whole loop
        return [codes[i, : r.num_codes].clone() for i, r in enumerate(requests)]

    # ---- setup -------------------------------------------------------------------------------------------------

    def _start(self, requests: Sequence[CodeRequest]) -> None:
        """Prefill every distinct prompt once, copy its KV rows to its sharers, sample code 0 of every sequence."""
        n, lm, device = len(requests), self.lm, self.device
        row_prompts = [r.prompt_ids for r in requests] + ([r.uncond_ids for r in requests] if self.guided else [])
        max_codes = max(r.num_codes for r in requests)
        # One position to spare: the keys a step reads never become the whole cache (see `_keys_end`).
        self._allocate(len(row_prompts), max(len(p) for p in row_prompts) + max_codes + 1, n, max_codes)
        last_hidden = torch.empty(
            len(row_prompts), lm.config.hidden_size, dtype=lm.model.embed_tokens.weight.dtype, device=device
        )
        for prompt, rows in _rows_by_prompt(row_prompts).items():
            ids = torch.tensor([prompt], dtype=torch.long, device=device)
            last_hidden[rows] = lm.prefill_hidden(ids, start=0, row=rows[0])[:, -1]
            if len(rows) > 1:
                self._copy_cache_rows(rows[0], rows[1:], len(prompt))
        state = self.state
        state.positions.copy_(torch.tensor([len(p) for p in row_prompts], dtype=torch.long))
        state.seeds.copy_(torch.tensor([r.seed for r in requests], dtype=torch.long))
        state.owners.copy_(torch.arange(n))
        state.step.zero_()
        state.active = list(range(n))
        state.prompt_lengths = {
            i: max(len(row_prompts[i]), len(row_prompts[i + n]) if self.guided else 0) for i in range(n)
        }
        self._sample_and_advance(last_hidden, n)

    def _allocate(self, rows: int, cache_len: int, n: int, max_codes: int) -> None:
        """KV cache and state buffers, reused while the shapes stay the same (so captured graphs stay valid)."""
        layout = (rows, cache_len, n, max_codes)
        if self.state is not None and layout == self._layout and self.lm.kv_cache is self._kv_cache:
            return
        self._graphs.clear()  # they hold the addresses of the buffers being replaced
        self.lm.setup_cache(rows, cache_len)
        self._kv_cache, self._layout = self.lm.kv_cache, layout
        device = self.device
        self.state = DecodeState(
            tokens=torch.zeros(rows, dtype=torch.long, device=device),
            positions=torch.zeros(rows, dtype=torch.long, device=device),
            seeds=torch.zeros(n, dtype=torch.long, device=device),
            owners=torch.zeros(n, dtype=torch.long, device=device),
            step=torch.zeros((), dtype=torch.long, device=device),
            codes=torch.zeros(n, max_codes, dtype=torch.long, device=device),
        )

    def _copy_cache_rows(self, source_row: int, target_rows: list[int], length: int) -> None:
        for keys, values in self.lm.kv_cache:
            keys[target_rows, :, :length] = keys[source_row, :, :length]
            values[target_rows, :, :length] = values[source_row, :, :length]

    # ---- the step ----------------------------------------------------------------------------------------------

    def _rows(self, n: int) -> int:
        return 2 * n if self.guided else n

    def _keys_end(self, step: int) -> int:
        """Keys the attention must read at `step`: up to the furthest active row's position, in KEY_BLOCK buckets,
        short of the cache's spare last position: a compiled step then never sees the keys become the whole
        (contiguous) cache, which would be a second compiled variant."""
        state = self.state
        furthest = max(state.prompt_lengths[i] for i in state.active) + step - 1
        return min(self.lm.cache_len - 1, -(-(furthest + 1) // KEY_BLOCK) * KEY_BLOCK)

    def _decode_step(self, n: int, keys_end: int) -> None:
        """Feed each active row its previous code, then sample and record the next one (all in place)."""
        state, rows = self.state, self._rows(n)
        hidden = self.lm.decode_hidden(state.tokens[:rows], state.positions[:rows], keys_end, self._layer_step)
        self._sample_and_advance(hidden, n, state.positions[:rows])

    def _sample_and_advance(self, hidden: torch.Tensor, n: int, positions: torch.Tensor | None = None) -> None:
        """hidden [rows, H] -> a code per active sequence, written to `codes` and fed back as next tokens (and the
        fed rows' `positions`, when given, moved on by one). After the prefill (no positions) it runs eagerly: once
        a call, and the compiled step keeps one signature."""
        state = self.state
        run = advance if positions is None else self._advance
        in_place = (state.seeds, state.owners, state.step, state.codes, state.tokens, positions)
        run(hidden, self.lm.code_head(), self.sampling, n, *in_place)

    def _run_step(self, n: int, keys_end: int) -> None:
        if not self.cuda_graphs:
            self._decode_step(n, keys_end)
            return
        graph = self._graphs.get((n, keys_end))
        if graph is not None:
            graph.replay()
            return
        self._decode_step(n, keys_end)  # the real step, run eagerly once: it also warms up kernels and workspaces
        self._graphs[(n, keys_end)] = self._capture(n, keys_end)

    def _capture(self, n: int, keys_end: int) -> torch.cuda.CUDAGraph:
        """Record the step without running it (capture executes nothing); state stays as the eager step left it."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._decode_step(n, keys_end)
        return graph

    # ---- compaction --------------------------------------------------------------------------------------------

    def _compact(self, active: list[int]) -> None:
        """Move the slots of the still-active sequences to the front (KV rows, fed tokens, positions, seeds)."""
        state = self.state
        n_old = len(state.active)
        slots = torch.tensor([state.active.index(i) for i in active], dtype=torch.long, device=self.device)
        rows = torch.cat([slots, slots + n_old]) if self.guided else slots
        count = rows.numel()
        for keys, values in self.lm.kv_cache:
            keys[:count] = keys[rows]
            values[:count] = values[rows]
        state.tokens[:count] = state.tokens[rows]
        state.positions[:count] = state.positions[rows]
        state.seeds[: len(active)] = state.seeds[slots]
        state.owners[: len(active)] = state.owners[slots]
        state.active = active


def advance(
    hidden: torch.Tensor,
    head: torch.Tensor,
    sampling: SamplingParams,
    n: int,
    seeds: torch.Tensor,
    owners: torch.Tensor,
    step: torch.Tensor,
    codes: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
) -> None:
    """One code step's end, in place on `DecodeState`'s tensors: the code logits of hidden [rows, H] (rows n..2n-1
    unconditional with CFG), a code per active sequence sampled at (its seed, `step`), written at `codes[owner,
    step]` and fed back as the next tokens; `step` and the fed `positions` move on by one. One compiled region on
    CUDA (a few kernels, not dozens)."""
    logits = F.linear(hidden, head)
    if sampling.guided:
        logits = cfg_logits(logits[:n], logits[n : 2 * n], sampling.cfg)
    steps = step.expand(n)
    code = sample(logits, sampling, seeds[:n], steps)
    codes.index_put_((owners[:n], steps), code)
    token = code + AUDIO_CODE_BASE
    tokens[:n] = token
    if sampling.guided:
        tokens[n : 2 * n] = token
    step += 1
    if positions is not None:
        positions += 1


def _rows_by_prompt(row_prompts: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """Distinct prompts -> the cache rows that start from them."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(row_prompts):
        groups.setdefault(tuple(prompt), []).append(row)
    return groups
