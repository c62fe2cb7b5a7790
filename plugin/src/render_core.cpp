// See render_core.hpp. Each step names the BlockRenderer method it mirrors; numpy's float32 arithmetic is done in
// float here in the same order, its Python scalars (float64) are cast to float where numpy casts them.
#include "render_core.hpp"

#include <cmath>
#include <cstring>

#include "flowjam_generated.h"

namespace flowjam {

namespace {

int64_t floor_mod(int64_t a, int64_t b) {
    const int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

double py_fmod(double a, double b) {  // Python's float %: the sign of the divisor
    double r = std::fmod(a, b);
    if (r != 0.0) {
        if ((b < 0) != (r < 0)) r += b;
    } else {
        r = std::copysign(0.0, b);
    }
    return r;
}

int64_t py_round(double x) { return static_cast<int64_t>(std::nearbyint(x)); }  // half to even, as round()

// LoopBuffer.read_into: frames from `position` modulo the region's loop, wrapping.
void read_into(const LoopView& view, float* out, int frames, int64_t position, int64_t region) {
    const int64_t loop = view.counters[counter::LENGTHS[region]];
    const float* base = view.data + region * view.capacity * view.channels;
    int64_t start = floor_mod(position, loop);
    int done = 0;
    while (done < frames) {
        const int64_t take = std::min<int64_t>(frames - done, loop - start);
        std::memcpy(out + done * view.channels, base + start * view.channels, sizeof(float) * take * view.channels);
        done += static_cast<int>(take);
        start = 0;
    }
}

// BlockRenderer.switch
void do_switch(const LoopView& view, int64_t played, int frames) {
    int64_t* c = view.counters;
    double* r = view.reals;
    const int64_t switchAt = c[counter::SWITCH_AT];
    if (0 <= switchAt && switchAt < played + frames) {
        r[real::CLICK_BAR] = r[real::NEXT_CLICK_BAR];
        r[real::CLICK_CYCLE] = r[real::NEXT_CLICK_CYCLE];
        c[counter::ACTIVE] = c[counter::SWITCH_TO];
        c[counter::SWITCH_AT] = -1;
    }
}

// BlockRenderer.read
void read_block(RenderState& s, const LoopView& view, float* out, int frames, int64_t played) {
    do_switch(view, played, frames);
    const int64_t region = view.counters[counter::ACTIVE];
    const int64_t shift = view.counters[counter::SHIFTS[region]];
    read_into(view, out, frames, played + shift, region);
    if ((region != s.appliedRegion || shift != s.appliedShift) && frames == s.blocksize) {
        float* before = s.before.data();
        read_into(view, before, frames, played + s.appliedShift, s.appliedRegion);
        for (int i = 0; i < frames; ++i)
            for (int ch = 0; ch < s.channels; ++ch) {
                float& o = out[i * s.channels + ch];
                o = o * s.rise[i];
                const float b = before[i * s.channels + ch] * s.fall[i];
                o = o + b;
            }
    }
    s.appliedRegion = region;
    s.appliedShift = shift;
}

// BlockRenderer.count_gap
void count_gap(RenderState& s, const LoopView& view, const float* out, int frames) {
    bool any = false;
    for (int i = 0; i < frames * s.channels && !any; ++i) any = out[i] != 0.0f;
    const double* r = view.reals;
    if (any) {
        s.heard = true;
    } else if (s.heard && r[real::TRANSPORT] == 1.0 && r[real::APPLIED_TRANSPORT] == 1.0 && r[real::GAIN] > 0) {
        view.counters[counter::GAPS] += 1;
    }
}

void add_click(RenderState& s, float* out, int offset, int64_t from, int64_t take) {
    for (int64_t i = 0; i < take; ++i)
        for (int ch = 0; ch < s.channels; ++ch) {
            float& o = out[(offset + i) * s.channels + ch];
            o = o + s.click[from + i];
        }
}

// BlockRenderer.add_clicks
void add_clicks(RenderState& s, const LoopView& view, float* out, int frames, int64_t position) {
    const int64_t clickFrames = static_cast<int64_t>(s.click.size());
    if (s.clickLeft) {
        const int64_t done = clickFrames - s.clickLeft;
        const int64_t take = std::min<int64_t>(frames, s.clickLeft);
        add_click(s, out, 0, done, take);
        s.clickLeft -= take;
    }
    const int64_t moved = s.clickRegion == s.appliedRegion ? s.appliedShift - s.clickShift : 0;
    s.clickRegion = s.appliedRegion;
    s.clickShift = s.appliedShift;
    const double bar = view.reals[real::CLICK_BAR];
    if (bar <= 0.0) return;
    double cycle = view.reals[real::CLICK_CYCLE];
    if (cycle == 0.0) cycle = static_cast<double>(view.counters[counter::LENGTHS[s.appliedRegion]]);
    double start = py_fmod(static_cast<double>(position), cycle);
    const int64_t low = std::abs(static_cast<double>(moved)) < 0.5 * bar ? -moved : 0;
    int64_t index = std::max<int64_t>(0, static_cast<int64_t>(std::ceil((start + low) / bar - 1e-9)));
    while (true) {
        int64_t at = py_round(static_cast<double>(index) * bar);
        if (static_cast<double>(at) >= cycle - 0.5 * bar) {
            index = 0;
            start = start - cycle;
            at = 0;
        }
        int64_t offset = py_round(static_cast<double>(at) - start);
        if (offset >= frames) return;
        if (offset >= low) {
            offset = std::max<int64_t>(offset, 0);
            const int64_t take = std::min<int64_t>(frames - offset, clickFrames);
            add_click(s, out, static_cast<int>(offset), 0, take);
            s.clickLeft = clickFrames - take;
        }
        index += 1;
    }
}

void scale(float* out, int frames, int channels, float by) {
    for (int i = 0; i < frames * channels; ++i) out[i] = out[i] * by;
}

// BlockRenderer.apply_transport
void apply_transport(RenderState& s, const LoopView& view, float* out, int frames, int64_t played) {
    int64_t* c = view.counters;
    double* r = view.reals;
    const int64_t startAt = c[counter::START_AT];
    if (0 <= startAt && startAt < played + frames) {
        c[counter::START_AT] = -1;
        c[counter::FADE_STARTED] = startAt;
        r[real::TRANSPORT] = r[real::APPLIED_TRANSPORT] = 1.0;
        const int64_t begin = std::max<int64_t>(0, startAt - played);
        std::memset(out, 0, sizeof(float) * begin * s.channels);
        const int64_t ramp = std::min<int64_t>(START_FADE_FRAMES, frames - begin);
        for (int64_t i = 0; i < ramp; ++i)
            for (int ch = 0; ch < s.channels; ++ch) {
                float& o = out[(begin + i) * s.channels + ch];
                o = o * s.startRamp[i];
            }
        return;
    }
    const double target = r[real::TRANSPORT];
    double applied = r[real::APPLIED_TRANSPORT];
    if (target != applied && frames == s.blocksize) {
        if (applied == 0.0 || applied == 1.0) c[counter::FADE_STARTED] = played;
        const float sign = target > applied ? 1.0f : -1.0f, from = static_cast<float>(applied);
        for (int i = 0; i < frames; ++i) {
            float v = s.fadeSteps[i] * sign;
            v = v + from;
            v = v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v);
            s.fadeCurve[i] = v;
            for (int ch = 0; ch < s.channels; ++ch) out[i * s.channels + ch] = out[i * s.channels + ch] * v;
        }
        r[real::APPLIED_TRANSPORT] = static_cast<double>(s.fadeCurve[frames - 1]);
        return;
    }
    if (target != applied) {
        c[counter::FADE_STARTED] = played;
        r[real::APPLIED_TRANSPORT] = applied = target;
    }
    if (applied == 0.0)
        std::memset(out, 0, sizeof(float) * frames * s.channels);
    else if (applied != 1.0)
        scale(out, frames, s.channels, static_cast<float>(applied));
}

}  // namespace

bool loop_view(void* base, uint64_t bytes, LoopView& view) {
    if (base == nullptr || bytes < static_cast<uint64_t>(HEADER_BYTES)) return false;
    auto* counters = static_cast<int64_t*>(base);
    if (counters[0] != LOOP_MAGIC) return false;
    const int64_t frames = counters[counter::FRAMES], channels = counters[counter::CHANNELS];
    const int64_t regions = counters[counter::REGIONS];
    if (frames <= 0 || channels <= 0 || channels > 64 || regions < 1 || regions > MAX_REGIONS) return false;
    if (bytes < static_cast<uint64_t>(HEADER_BYTES + 4 * frames * channels * regions)) return false;
    view.counters = counters;
    view.reals = reinterpret_cast<double*>(static_cast<char*>(base) + 8 * HEADER_COUNTERS);
    view.data = reinterpret_cast<float*>(static_cast<char*>(base) + HEADER_BYTES);
    view.capacity = frames;
    view.channels = static_cast<int>(channels);
    return true;
}

void render_prepare(RenderState& s, int blocksize, int channels, int sampleRate) {
    s.blocksize = blocksize;
    s.channels = channels;
    s.unitRamp.resize(blocksize);
    s.gainCurve.resize(blocksize);
    s.fadeSteps.resize(blocksize);
    s.fadeCurve.resize(blocksize);
    s.rise.resize(blocksize);
    s.fall.resize(blocksize);
    s.before.resize(static_cast<size_t>(blocksize) * channels);
    for (int k = 0; k < blocksize; ++k) {
        s.unitRamp[k] = (static_cast<float>(k) + 1.0f) / static_cast<float>(blocksize);
        s.fadeSteps[k] = (static_cast<float>(k) + 1.0f) / static_cast<float>(TRANSPORT_FADE_FRAMES);
        const double sine = std::sin(0.5 * M_PI * (k + 0.5) / blocksize);
        s.rise[k] = static_cast<float>(sine * sine);
        s.fall[k] = 1.0f - s.rise[k];
    }
    s.startRamp.resize(START_FADE_FRAMES);
    for (int k = 0; k < START_FADE_FRAMES; ++k)
        s.startRamp[k] = (static_cast<float>(k) + 1.0f) / static_cast<float>(START_FADE_FRAMES);
    const int clickFrames = static_cast<int>(6 * CLICK_DECAY_S * sampleRate);
    s.click.resize(clickFrames);
    for (int n = 0; n < clickFrames; ++n)
        s.click[n] = static_cast<float>(CLICK_GAIN * std::cos(2 * M_PI * CLICK_HZ * n / sampleRate) *
                                        std::exp(-n / (CLICK_DECAY_S * sampleRate)));
}

void render_attach(RenderState& s, const LoopView& view) {
    s.heard = false;
    s.clickLeft = 0;
    s.clickRegion = -1;
    s.appliedRegion = view.counters[counter::ACTIVE];
    s.appliedShift = view.counters[counter::SHIFTS[s.appliedRegion]];
}

// BlockRenderer.render
void render_block(RenderState& s, const LoopView& view, float* out, int frames, double nowS) {
    int64_t* c = view.counters;
    double* r = view.reals;
    const int64_t played = c[counter::PLAYED];
    c[counter::BLOCK_PLAYED] = -1;
    r[real::BLOCK_TIME] = nowS;
    c[counter::BLOCK_PLAYED] = played;
    read_block(s, view, out, frames, played);
    const double target = r[real::GAIN], applied = r[real::APPLIED_GAIN];
    if (target != applied && frames == s.blocksize) {
        const float delta = static_cast<float>(target - applied), from = static_cast<float>(applied);
        for (int i = 0; i < frames; ++i) {
            float g = s.unitRamp[i] * delta;
            g = g + from;
            s.gainCurve[i] = g;
            for (int ch = 0; ch < s.channels; ++ch) out[i * s.channels + ch] = out[i * s.channels + ch] * g;
        }
    } else if (target != 1.0) {
        scale(out, frames, s.channels, static_cast<float>(target));
    }
    r[real::APPLIED_GAIN] = target;
    count_gap(s, view, out, frames);
    add_clicks(s, view, out, frames, played + s.appliedShift);
    apply_transport(s, view, out, frames, played);
    c[counter::PLAYED] = played + frames;
    c[counter::CALLBACKS] += 1;
}

}  // namespace flowjam
