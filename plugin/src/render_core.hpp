// The block renderer of live/renderer.py in C++: one specification in two languages, held equal bit for bit by
// tests/test_plugin_parity.py. Plain functions over a mapped loop buffer; render_block allocates nothing, takes no
// lock and makes no system call. Compile without -ffast-math and with -ffp-contract=off (the Makefile does).
#pragma once
#include <stdint.h>
#include <vector>

namespace flowjam {

// A loop buffer as mapped: its header's counters and reals, and its interleaved float32 audio.
struct LoopView {
    int64_t* counters = nullptr;
    double* reals = nullptr;
    float* data = nullptr;
    int64_t capacity = 0;  // a region's frames
    int channels = 0;
};

// What live/renderer.py's BlockRenderer keeps between blocks, and its curves, sized for one block size.
struct RenderState {
    int blocksize = 0, channels = 0;
    std::vector<float> unitRamp, gainCurve, fadeSteps, fadeCurve, rise, fall, before, startRamp, click;
    int64_t clickLeft = 0;
    int64_t clickRegion = -1, clickShift = 0;  // the region and shift the last block's clicks were placed at
    bool heard = false;
    int64_t appliedRegion = 0, appliedShift = 0;
};

// A view of the loop buffer mapped at `base` (its header checked: magic, channels); false if it is none.
bool loop_view(void* base, uint64_t bytes, LoopView& view);

// Size the curves for `blocksize` frames at `sampleRate` (allocates: call outside the audio thread).
void render_prepare(RenderState& state, int blocksize, int channels, int sampleRate);

// Forget the previous buffer: the state a new BlockRenderer starts from (allocates nothing).
void render_attach(RenderState& state, const LoopView& view);

// One block of `frames` (<= blocksize) interleaved frames into `out`, as BlockRenderer.render without a recording;
// BLOCK_TIME gets `nowS`.
void render_block(RenderState& state, const LoopView& view, float* out, int frames, double nowS);

}  // namespace flowjam
